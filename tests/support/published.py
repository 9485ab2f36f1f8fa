"""What a server core publishes, read where the reactor reads it: its journal.

The core's event methods return no frames (one output channel: docs/
architecture.md, "The core"); these helpers run an event and take the KVPUBs
it recorded, through :func:`clone.server.journal.published`, the function the
reactor's commit uses.  Each takes (and drops) what earlier events left in the
journal first, so what it returns is this event's alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from clone.server.core import ServerCore
from clone.server.journal import published as _published

__all__ = ["kvset", "promote", "published", "release", "tick"]


def published(core: ServerCore) -> list[list[bytes]]:
    """Every KVPUB the core recorded since the journal was last taken, in order."""
    return _published(core.journal.take())


def kvset(
    core: ServerCore, frames: Sequence[bytes], now: float, mono: float | None = None
) -> list[bytes] | None:
    """:meth:`ServerCore.on_kvset`; the KVPUB it recorded, None if none."""
    core.journal.take()
    core.on_kvset(frames, now, mono)
    out = published(core)
    assert len(out) <= 1, out
    return out[0] if out else None


def promote(core: ServerCore, now: float, mono: float | None = None) -> list[list[bytes]]:
    """:meth:`ServerCore.become_active`; the KVPUBs it recorded."""
    core.journal.take()
    core.become_active(now, mono)
    return published(core)


def release(core: ServerCore, now: float) -> list[list[bytes]]:
    """:meth:`ServerCore.release_held`; the KVPUBs it recorded."""
    core.journal.take()
    core.release_held(now)
    return published(core)


def tick(core: ServerCore, now: float, mono: float | None = None) -> list[list[bytes]]:
    """:meth:`ServerCore.tick`; the deletes it recorded."""
    core.journal.take()
    core.tick(now, mono)
    return published(core)
