"""What the client API hands back: entries, status, and streams of changes.

:class:`Entry` and :class:`Status` are plain values.  :class:`ChangeStream` is
the iterator :meth:`clone.Clone.changes` returns; it is registered with its
client when it is created, so no change between the call and the first
``next()`` is lost.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from clone.wire.codec import Properties

__all__ = [
    "STOP",
    "ChangeStream",
    "CloseReport",
    "Entry",
    "Freshness",
    "Status",
    "Watcher",
    "WatcherRegistry",
]


@dataclass(frozen=True, slots=True)
class Freshness:
    """How current a read from the local replica is.

    ``synced``: the client holds a complete, live copy (state ``active``);
    before the first sync a read returns the default, during an outage the
    last value it had.  ``silent_for``: seconds since the current server was
    last heard from (None: no current server).
    """

    synced: bool
    state: str
    silent_for: float | None


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What :meth:`clone.Clone.close` dropped: writes never sent (made while no
    server had answered), confirmed writes and calls still waiting (failed with
    ClosedError), and leases not revoked in time (they end within their ttl)."""

    unsent_writes: int = 0
    unconfirmed_writes: int = 0
    waiting: int = 0
    leases_unrevoked: int = 0

    @property
    def dropped(self) -> bool:
        return bool(self.unsent_writes or self.unconfirmed_writes or self.waiting)


@dataclass(frozen=True, slots=True)
class Entry:
    """A key's value as the client holds it; in a change, ``value`` None = deleted."""

    key: str
    value: bytes | None
    sequence: int = 0
    properties: Properties = ()
    #: Set on what :meth:`clone.Clone.entry` returns: how current the read is.
    freshness: Freshness | None = field(default=None, compare=False, repr=False)
    #: In a change: True when it comes from a resync (a fresh snapshot that
    #: replaced the map), not from an update, so the key's updates since the
    #: last change you were told of are not known.  Told in order with the
    #: other changes: every change that skips updates says so.
    resync: bool = field(default=False, compare=False)

    @property
    def deleted(self) -> bool:
        return self.value is None

    def prop(self, name: str, default: str | None = None) -> str | None:
        for pname, value in self.properties:
            if pname == name:
                return value
        return default

    @property
    def lease(self) -> str | None:
        """The id of the lease this key is bound to (deleted when it ends), or None."""
        return self.prop("lease")


@dataclass(frozen=True, slots=True)
class Status:
    """What the agent is doing, for health checks and tests."""

    state: str  # "initial", "syncing" or "active"
    server: str | None  # the server we sync from / listen to
    sequence: int  # last sequence applied
    keys: int
    pending_writes: int
    servers: tuple[str, ...] = ()
    subtrees: tuple[str, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    pending_calls: int = 0  # compare-and-set and lease calls awaiting a reply
    leases: int = 0  # leases the agent keeps alive

    @property
    def gaps(self) -> int:
        return self.counters.get("gaps", 0)

    @property
    def resyncs(self) -> int:
        return self.counters.get("resyncs", 0)

    @property
    def failovers(self) -> int:
        return self.counters.get("failovers", 0)

    @property
    def protocol_errors(self) -> int:
        return self.counters.get("protocol_errors", 0)


class WatcherRegistry(Protocol):
    """The side of a client a :class:`ChangeStream` registers with."""

    def _add_watcher(self, watcher: Watcher) -> None: ...

    def _remove_watcher(self, watcher: Watcher) -> None: ...


#: Put on a queue to wake and end whoever reads it.
STOP = object()


class Watcher:
    """One ``changes()`` iterator's queue, as the dispatcher sees it.

    ``closed`` is set without the client's lock (from ``__del__``, which may run
    anywhere, even in a thread holding that lock); the dispatcher skips closed
    watchers and registration prunes them.
    """

    __slots__ = ("closed", "queue")

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue[Entry | object] = queue.SimpleQueue()
        self.closed = False


class ChangeStream(Iterator[Entry]):
    """The iterator :meth:`Clone.changes` returns, registered from its creation.

    Iterating blocks until the next change under ``prefix`` and stops at the
    deadline, when the client closes or after :meth:`close`.  Dropping the last
    reference unregisters it too.  An error its feed queues (``changes(since=N)``'s
    :class:`~clone.errors.HistoryCompacted`) is raised by ``next()`` and ends it.
    """

    def __init__(self, client: WatcherRegistry, timeout: float | None, prefix: str) -> None:
        self._client = client
        self._prefix = prefix
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._watcher = Watcher()
        client._add_watcher(self._watcher)

    def __iter__(self) -> ChangeStream:
        return self

    def __next__(self) -> Entry:
        while not self._watcher.closed:
            if self._deadline is None:
                wait = 1.0
            else:
                wait = self._deadline - time.monotonic()
                if wait <= 0:
                    break
            try:
                item = self._watcher.queue.get(timeout=min(wait, 1.0))
            except queue.Empty:
                continue
            if item is STOP:
                break
            if isinstance(item, Exception):
                # Its feed failed (changes(since=N): HistoryCompacted, say).
                self.close()
                raise item
            assert isinstance(item, Entry)
            if item.key.startswith(self._prefix):
                return item
        self.close()
        raise StopIteration

    def close(self) -> None:
        """Stop queueing changes for this iterator; iterating then stops."""
        if not self._watcher.closed:
            self._client._remove_watcher(self._watcher)
            self._watcher.queue.put(STOP)  # wake a thread blocked in next()

    def __enter__(self) -> ChangeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # No lock here: see Watcher.
        watcher = getattr(self, "_watcher", None)
        if watcher is not None:
            watcher.closed = True
