"""The hostile drill's HUGZ watcher, in a process of its own.

How this works: ``python -m clone.tools.hostile.watcher NAME=ENDPOINT ...``
subscribes to HUGZ on each server's publisher and prints ``HUGZ <unix time>
<name>`` for each, as it arrives; :class:`WatcherProcess` starts it in the
drill's process group and reads the lines back from its log.  Its waits are
short (:data:`POLL`), so it also measures the host: a wait that ends more than
:data:`WAKE_REPORTED` past its timeout prints ``WAKE <unix time> <ms late>``
(the machine gave this process no CPU for that long; a HUGZ gap of the same
moment is the machine's, not the server's).

Why a process: the harness also syncs healthy clients, and a client decoding
a snapshot of hundreds of MB holds the interpreter lock for most of a second
at a time; a watcher thread in that process stamps HUGZ when it gets the lock
back, so it measured the harness, not the servers.  The drill keeps the
in-process watcher too (:class:`~clone.tools.drill.watch.HugzMonitor`) and
prints both gaps.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from clone.tools.drill.watch import subscribe_hugz
from clone.tools.procs import ManagedProcess, ProcessGroup, python_module_argv
from clone.wire.protocol import HUGZ

__all__ = ["WatcherProcess", "main", "parse_hugz_lines"]

_PREFIX = "HUGZ "
_WAKE = "WAKE "
#: The watcher's wait for HUGZ, seconds: the resolution of its wake check.
POLL = 0.05
#: A wake this much past its timeout is reported, seconds.
WAKE_REPORTED = 0.1


def parse_hugz_lines(text: str, prefix: str = _PREFIX) -> list[tuple[float, str]]:
    """The (time, server) of each ``HUGZ <time> <name>`` line (with ``prefix``
    "WAKE ", each late wake's (time, ms)); other lines and a torn last line are
    skipped."""
    out: list[tuple[float, str]] = []
    for line in text.splitlines():
        if not line.startswith(prefix):
            continue
        parts = line.split()
        if len(parts) != 3:
            continue
        try:
            out.append((float(parts[1]), parts[2]))
        except ValueError:
            continue
    return out


class WatcherProcess:
    """The watcher process of one attack: started in ``group``, read from its log."""

    def __init__(self, group: ProcessGroup, publishers: dict[str, str], *,
                 own_session: bool = False) -> None:  # fmt: skip
        args = [f"{name}={endpoint}" for name, endpoint in publishers.items()]
        self._proc: ManagedProcess = group.add(
            "hugz-watcher", python_module_argv("clone.tools.hostile.watcher", *args),
            own_session=own_session)

    def stop(self) -> None:
        self._proc.stop()

    def _text(self) -> str:
        try:
            return self._proc.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def hugz_after(self, name: str, t: float, until: float) -> list[float]:
        """When ``name``'s HUGZ arrived, strictly between ``t`` and ``until``."""
        return [ts for ts, n in parse_hugz_lines(self._text()) if n == name and t < ts < until]

    def late_wakes(self, t: float, until: float) -> list[tuple[float, float]]:
        """(when, seconds late) of each late wake of the watcher between ``t``
        and ``until``: when the host gave it no CPU."""
        wakes = parse_hugz_lines(self._text(), _WAKE)
        return [(ts, float(ms) / 1000) for ts, ms in wakes if t < ts < until]


def main(argv: Sequence[str] | None = None) -> int:
    pairs = [a.partition("=") for a in (sys.argv[1:] if argv is None else argv)]
    if not pairs or any(not name or not endpoint for name, _, endpoint in pairs):
        print("usage: python -m clone.tools.hostile.watcher NAME=ENDPOINT ...", file=sys.stderr)
        return 2
    ctx: zmq.Context[Any] = zmq.Context()
    poller = zmq.Poller()
    try:
        names = subscribe_hugz(ctx, poller, ((name, endpoint) for name, _, endpoint in pairs))
        while True:
            asked = time.monotonic()
            events = poller.poll(int(POLL * 1000))
            late = time.monotonic() - asked - POLL
            if not events and late > WAKE_REPORTED:
                print(f"{_WAKE}{time.time():.6f} {late * 1000:.0f}", flush=True)
            for sock, _ in events:
                with contextlib.suppress(zmq.Again):
                    while True:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                        if frames[0] == HUGZ:
                            print(f"{_PREFIX}{time.time():.6f} {names[sock]}", flush=True)
    except KeyboardInterrupt:
        return 0
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    sys.exit(main())
