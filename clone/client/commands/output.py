"""What every subcommand shares: exit codes and how entries are printed."""

from __future__ import annotations

import base64
import json
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clone.client.results import Entry

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
