"""What every subcommand shares: exit codes, how entries are printed, the
progress of a wait, and a quiet stdout once its reader is gone."""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clone.client.results import Entry
    from clone.progress import Progress

EXIT_OK, EXIT_MISSING, EXIT_UNREACHABLE, EXIT_UNCONFIRMED, EXIT_ERROR = 0, 1, 2, 3, 4
EXIT_CONFLICT = 5
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE  # 141


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def fail(message: str) -> None:
    """One line on stderr, prefixed as every error of the command is."""
    print(f"clone: {message}", file=sys.stderr)


def text(value: bytes) -> str:
    """One printable line: invalid UTF-8 and control characters as escapes."""
    decoded = value.decode("utf-8", "backslashreplace")
    if decoded.isprintable():
        return decoded
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in decoded)


def value_fields(value: bytes | None) -> dict[str, Any]:
    """``value`` as JSON: the text, or base64 with ``"base64": true`` for bytes
    that are not UTF-8; None (and ``"deleted": true``) for a deletion."""
    if value is None:
        return {"value": None, "deleted": True}
    try:
        return {"value": value.decode("utf-8")}
    except UnicodeDecodeError:
        return {"value": base64.b64encode(value).decode("ascii"), "base64": True}


def json_line(entry: Entry) -> str:
    obj: dict[str, object] = {"key": entry.key, **value_fields(entry.value)}
    obj["sequence"] = entry.sequence
    obj["properties"] = dict(entry.properties)
    return json.dumps(obj, ensure_ascii=False)


def plain_line(entry: Entry) -> str:
    if entry.value is None:
        return f"{entry.key} (deleted)"
    return f"{entry.key}={text(entry.value)}"


def waiting(what: str, timeout: float, status: Callable[[], str] | None = None) -> Progress:
    """The progress of a wait of up to ``timeout`` s: on a terminal, a bar of
    the time spent (drawn only after a second, gone at the end); elsewhere an
    INFO line every few seconds, shown with --verbose.  The agent's status does
    not count a snapshot's keys before it is complete, so time is what we show."""
    from clone.progress import Progress

    started = time.monotonic()

    def poll(bar: Progress) -> None:
        bar.update(min(time.monotonic() - started, timeout),
                   status=status() if status is not None else None)

    return Progress(what, timeout, unit="s", rate=False, poll=poll, poll_every=0.2,
                    show_after=1.0, transient=True)


def discard_stdout() -> None:
    """Point stdout at /dev/null: the reader is gone, and without this the
    interpreter's final flush of what is still buffered fails again and prints
    "Exception ignored ... BrokenPipeError" on the way out."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real file descriptor (stdout replaced in-process)
        pass
    finally:
        os.close(devnull)
