"""A full snapshot encoded once and streamed to every requester of it (pure).

Why: after a failover every client that cannot catch up asks for the whole
state at once.  Encoding it for each of them cost the server about 6 ms of CPU
per 10,000-key KVBATCH snapshot, 6 s for 1,000 requesters, on the loop that
also sends the heartbeats; the bytes were the same for all of them.

How this works: a :class:`SharedSnapshot` holds the messages (without the
routing id) that one private :class:`~clone.server.snapshot.SnapshotStream`,
its *source*, has produced so far; it encodes the next one only when its
fastest reader needs it, so the work of a turn stays what one stream's was.
Each requester reads it through a :class:`SharedStream` of its own: its
routing id, its place in the list, its own ``peek`` / ``advance``, so the
pump, the windows and the slot rules treat it like any stream.  Large frames
are wrapped once (``wrap``: the server makes them ``zmq.Frame`` objects, which
libzmq sends by reference, so a thousand readers cost no copies).

Who may share (:class:`ShareKey`): the same subtree, batch mode, read prefixes
(``None``: everything) and KTHXBAI properties (a restricted view's id and
count), so requesters whose views differ never share (a CURVE user gets only
what its own rights allow: security fails closed).  A peer server's sync (the
applied list first, ephemeral keys with their time left) and catch-ups are
never shared.  And the same *version* of the store: a requester subscribed
before it asked, so a snapshot is right for it only if it starts from the
state at its request.  Messages encoded while the store has not changed since
the snapshot started are exactly that state; those encoded later are newer,
which the fuzzy snapshot allows (a later KVPUB is replayed over them).  So a
snapshot may be joined only while the store's version is the one it started
at; once the store changes it leaves the index (no new readers) and its bytes
are freed when its last reader ends.  The version counts every change to the
store (:attr:`clone.server.store.Store.version`), not only the sequence: a
follower's swap can land on the same sequence with other contents.

Bounded in bytes: a snapshot is started only if its estimate (the store's
bytes, an overestimate for a subtree, plus :data:`ENTRY_OVERHEAD` per key)
fits in what the live ones leave of ``limit`` (a quarter of
``--snapshot-bytes``, :class:`~clone.server.snapwindow.SnapshotBudget`); else
the requester gets a private stream, as before.  Writes made while it is
encoded can make it larger than its estimate: it then counts its real size.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from clone.wire.codec import Properties

__all__ = ["ENTRY_OVERHEAD", "ShareKey", "SharedSnapshot", "SharedSnapshots", "SharedStream",
           "Source"]

#: Bytes a snapshot adds to each entry's held bytes: a KVBATCH's column
#: lengths, or a KVSYNC's frame boundaries.
ENTRY_OVERHEAD = 32


class Source(Protocol):
    """What a shared snapshot needs of the private stream that encodes it."""

    @property
    def done(self) -> bool: ...

    @property
    def sent(self) -> int: ...

    @property
    def total_keys(self) -> int: ...

    def peek(self) -> Sequence[Any] | None: ...

    def advance(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ShareKey:
    """Requesters with equal keys get byte-identical snapshots."""

    subtree: str
    batch: bool
    #: The requester's read prefixes, exactly (None: it may read everything).
    allowed: tuple[bytes, ...] | None
    end_properties: Properties
    #: The store's sequence and version when the snapshot started.
    sequence: int
    version: int


class SharedSnapshot:
    """One snapshot's messages, encoded once, in order, as readers need them."""

    __slots__ = ("_source", "_wrap", "ended", "estimate", "key", "messages", "nbytes", "readers",
                 "total_keys")

    def __init__(self, key: ShareKey, source: Source, estimate: int,
                 wrap: Callable[[bytes], Any]) -> None:  # fmt: skip
        self.key = key
        self._source: Source | None = source
        self._wrap = wrap
        self.total_keys = source.total_keys
        #: (frames without the routing id, entries in it), in order.
        self.messages: list[tuple[tuple[Any, ...], int]] = []
        #: Bytes of the messages encoded so far.
        self.nbytes = 0
        self.estimate = estimate
        #: Whether the last message (KTHXBAI) is in :attr:`messages`.
        self.ended = False
        self.readers = 0

    @property
    def held(self) -> int:
        """What it counts against the budget: its estimate, or more once larger."""
        return max(self.estimate, self.nbytes)

    def message(self, index: int) -> tuple[tuple[Any, ...], int] | None:
        """Message ``index`` (encoded now if it is the next one), or None: not
        yet (the source skipped a long run of keys: ask again next turn), or
        past the end."""
        if index < len(self.messages):
            return self.messages[index]
        source = self._source
        if source is None or index != len(self.messages):
            return None
        frames = source.peek()
        if frames is None:
            return None
        before = source.sent
        source.advance()
        wrap = self._wrap
        body = tuple(wrap(frame) for frame in frames[1:])  # without the routing id
        self.nbytes += sum(map(len, frames[1:]))
        self.messages.append((body, source.sent - before))
        if source.done:
            self.ended = True
            self._source = None  # frees its copy of the key list
        return self.messages[index]


class SharedStream:
    """One requester's reading of a :class:`SharedSnapshot`: what the pump
    drives (``peek`` / ``advance``, as a :class:`SnapshotStream`)."""

    __slots__ = ("_closed", "_current", "_index", "_on_close", "_shared", "batch", "batches_sent",
                 "done", "identity", "sent", "sequence", "subtree", "total_keys")

    def __init__(self, identity: bytes, shared: SharedSnapshot,
                 on_close: Callable[[SharedSnapshot], None]) -> None:  # fmt: skip
        self.identity = identity
        self._shared = shared
        self._on_close = on_close
        self._index = 0
        self._current: list[Any] | None = None
        self._closed = False
        shared.readers += 1
        key = shared.key
        self.batch = key.batch
        self.subtree = key.subtree
        self.sequence = key.sequence
        self.total_keys = shared.total_keys
        #: True once KTHXBAI has been sent.
        self.done = False
        #: Entries sent so far (KTHXBAI not counted), and KVBATCH messages.
        self.sent = 0
        self.batches_sent = 0

    def peek(self) -> Sequence[Any] | None:
        """The next message's frames (routing id first), or None: done, or not
        encoded yet (ask again after the loop's turn; see :attr:`done`)."""
        if self._current is not None:
            return self._current
        if self.done:
            return None
        got = self._shared.message(self._index)
        if got is None:
            return None
        self._current = [self.identity, *got[0]]
        return self._current

    def advance(self) -> None:
        """The frames from :meth:`peek` were sent; move on."""
        if self._current is None:
            raise ValueError("advance() without a successful peek()")
        self._current = None
        shared = self._shared
        entries = shared.messages[self._index][1]
        self._index += 1
        if shared.ended and self._index == len(shared.messages):
            self.done = True
            self.close()
        elif entries:
            self.sent += entries
            if self.batch:
                self.batches_sent += 1

    def close(self) -> None:
        """This reader is done or aborted (idempotent): the snapshot loses a reader."""
        if not self._closed:
            self._closed = True
            self._shared.readers -= 1
            self._on_close(self._shared)


class SharedSnapshots:
    """The shared snapshots of one server: the joinable ones by key, and the
    bytes of every live one within ``limit``."""

    def __init__(self, limit: int, wrap: Callable[[bytes], Any] = lambda frame: frame) -> None:
        self.limit = limit
        self._wrap = wrap
        self._joinable: dict[ShareKey, SharedSnapshot] = {}
        self._live: set[SharedSnapshot] = set()
        #: Readers that found their snapshot already started, and snapshots
        #: started (each encoded once); a snapshot not started for the budget.
        self.joined = 0
        self.started = 0
        self.over_budget = 0

    @property
    def held(self) -> int:
        """Bytes the live snapshots count against the limit."""
        return sum(s.held for s in self._live)

    def __len__(self) -> int:
        """Live snapshots (joinable or still read)."""
        return len(self._live)

    def join(self, identity: bytes, key: ShareKey) -> SharedStream | None:
        """A reader of the snapshot for ``key`` if one is joinable (the key
        holds the store's current sequence and version), else None."""
        self._forget_stale(key)
        shared = self._joinable.get(key)
        if shared is None:
            return None
        self.joined += 1
        return SharedStream(identity, shared, self._closed)

    def start(self, identity: bytes, key: ShareKey, source: Source,
              estimate: int) -> SharedStream | None:  # fmt: skip
        """Share ``source`` (a private stream nothing was sent from) as the
        snapshot for ``key``: its first reader, or None (the budget has no room:
        the caller streams ``source`` itself).  Joins the snapshot already
        started for ``key``, if any, instead."""
        reader = self.join(identity, key)
        if reader is not None:
            return reader
        if estimate + self.held > self.limit:
            self.over_budget += 1
            return None
        shared = SharedSnapshot(key, source, estimate, self._wrap)
        self._joinable[key] = shared
        self._live.add(shared)
        self.started += 1
        return SharedStream(identity, shared, self._closed)

    def clear(self) -> None:
        """The server stops: forget every snapshot (their readers are gone)."""
        self._joinable.clear()
        self._live.clear()

    def _forget_stale(self, key: ShareKey) -> None:
        """The store moved on from snapshots of other versions: no new readers
        for them; dropped now if none reads them."""
        stale = [k for k in self._joinable
                 if (k.sequence, k.version) != (key.sequence, key.version)]  # fmt: skip
        for k in stale:
            shared = self._joinable.pop(k)
            if shared.readers <= 0:
                self._live.discard(shared)

    def _closed(self, shared: SharedSnapshot) -> None:
        """A reader ended: the last one frees the snapshot."""
        if shared.readers <= 0:
            self._live.discard(shared)
            if self._joinable.get(shared.key) is shared:
                del self._joinable[shared.key]
