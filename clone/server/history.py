"""The active server's most recent updates, for catch-up from a sequence.

How this works: a passive server that restarts with its state on disk asks
for the updates after its last sequence (:mod:`clone.wire.delta`).  The
active answers from a :class:`History`: the newest updates it published, as
the exact KVPUB frames, contiguous in sequence, so "every update after N" is
a suffix of it.  The history is bounded twice, in updates and in bytes: a
burst of large values must not pin memory, and a requester too far behind
gets a full snapshot anyway, which is cheaper than replaying most of the
store.

Contiguity is the invariant everything rests on: were an update missing, a
delta would silently lose it.  So an update that does not follow the newest
one (the sequence jumped, after a full resync or a bug) *restarts* the
history at it; :attr:`History.restarts` counts that, and :meth:`History.reset`
is the way to say "the store is now at sequence N" without an update (after
a full resync).  A new history is empty and accepts any first update.

The database log can drop rows below :attr:`History.keep_from`: this history
never needs them again.

An index from each held update's uuid to what is held for it (which holds
its sequence: no int object per update) answers "what sequence did the write
with this uuid get" in O(1) (a retried call, and every write a split brain's
loser forwards, asks it: a scan per write stalled a healing server for a
minute).  It is built when first asked, in one pass over the ring, and then
kept up where the ring changes: an append adds (the newest update with a uuid
wins, as a newest-first scan would find it), an eviction removes the entry if
it still names the evicted update, a restart or reset clears it.  Once the
ring has turned over wholly (``max_updates`` appends) without a question, the
index is dropped: the question is rare outside a heal, and a dict slot and a
uuid object per held update were about 100 bytes per key at 100,000 keys
(the memory per key at fleet scale).  Building it costs one turn of
O(updates held): about 20-50 ms for 100,000 on an idle machine.
Sans-IO: no sockets, no clock, no database.

An update the store holds packed (:mod:`clone.server.store`: no properties,
a 16-byte uuid) is held here as its key and the store's own packed ``bytes``
object, in two parallel rings (no tuple per update: 48 bytes each), and turned
back into its five frames when read: at 100,000 keys the
default history holds one update per key, and its own sequence, uuid and
value objects cost about 200 bytes per key next to the store's packed copy
(the memory per key at fleet scale).  When the key is written again the store
lets go of the old packed object and the history keeps it alone.

The term each update was written under is kept as runs, ``(first sequence,
term)`` per change of term, not beside each update: terms change once per
failover, and a ``(frames, term)`` pair per held update cost 64 bytes each,
6.4 MB of a full 100,000-update history (the memory per key at fleet scale).
"""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from itertools import islice, repeat
from math import inf
from operator import itemgetter

__all__ = ["History"]

_UPDATE_FRAMES = 5
# An update's frames, held as a tuple: a tuple of bytes is untracked by the
# garbage collector, a list never is, and 100,000 held lists (and the tuples
# holding them) made every full collection walk them: 200-500 ms stalls of
# the loop during a split brain's heal, on a loaded machine.
_Frames = tuple[bytes, ...]
_Entry = tuple[_Frames, int]  # an update's frames and the term it was written under
# What is held per update beside its key: the store's packed entry --
# sequence (8), uuid (16), body; no properties -- or the update's frames.
_Held = bytes | _Frames


def _size(key: bytes, held: _Held) -> int:
    if isinstance(held, bytes):
        return len(key) + len(held)
    return len(held[0]) + len(held[1]) + len(held[2]) + len(held[3]) + len(held[4])


def _frames(key: bytes, held: _Held) -> _Frames:
    """An update's five frames from its key and what is held for it."""
    if type(held) is bytes:
        return (key, held[:8], held[8:24], b"", held[24:])
    return held  # type: ignore[return-value]


_SEQ = itemgetter(slice(0, 8))
_UUID = itemgetter(slice(8, 24))
_BODY = itemgetter(slice(24, None))


def _all_packed(held: Sequence[_Held]) -> bool:
    return set(map(type, held)) <= {bytes}


def _frames_of(keys: list[bytes], held: list[_Held]) -> list[_Frames]:
    """:func:`_frames` of many: in C when all are packed (the usual case: a
    catch-up or a demotion may read 100,000 of them, 0.15-0.3 s one by one
    in Python on a loaded machine)."""
    if not _all_packed(held):
        return list(map(_frames, keys, held))
    packed: list[bytes] = held  # type: ignore[assignment]
    return list(zip(keys, map(_SEQ, packed), map(_UUID, packed), repeat(b""), map(_BODY, packed)))


def _uuid(held: _Held) -> bytes:
    return held[8:24] if type(held) is bytes else held[2]  # type: ignore[return-value]


def _seq_frame(held: _Held) -> bytes:
    return held[:8] if type(held) is bytes else held[1]  # type: ignore[return-value]


_Uuid = bytes  # the class below has a property named bytes


class History:
    """The most recent updates, contiguous in sequence, bounded in count and bytes."""

    __slots__ = (
        "_anchored",
        "_base",
        "_bytes",
        "_index",
        "_keys",
        "_max_bytes",
        "_max_updates",
        "_terms",
        "_unasked",
        "_updates",
        "restarts",
    )

    def __init__(self, max_updates: int, max_bytes: int) -> None:
        if max_updates < 1:
            raise ValueError(f"max_updates must be at least 1, not {max_updates}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be at least 1, not {max_bytes}")
        self._max_updates = max_updates
        self._max_bytes = max_bytes
        # Two parallel rings: each held update's key, and its packed entry or
        # frames (a tuple per update would cost 56 bytes more).
        self._keys: deque[bytes] = deque()
        self._updates: deque[_Held] = deque()
        # (first sequence, term) at each change of term, oldest first; the
        # first run may start before the oldest held update (evicted below it).
        self._terms: list[tuple[int, int]] = []
        # The sequence the history starts after: the first update is _base + 1.
        self._base = 0
        # Whether _base is known (reset() or an update seen): until then, any
        # first update is accepted without counting a restart.
        self._anchored = False
        self._bytes = 0
        # uuid -> the newest held update with it (its sequence is in it);
        # None until sequence_of() asks, and again once unasked for a while.
        self._index: dict[_Uuid, _Held] | None = None
        # Appends since sequence_of() last asked.
        self._unasked = 0
        #: Times the history was cleared because an update did not follow.
        self.restarts = 0

    # ----------------------------------------------------------------------
    # Changes

    def append(self, frames: Sequence[bytes], term: int, packed: bytes | None = None) -> None:
        """Add the update ``frames`` (a KVPUB's 5 frames) written under ``term``.

        The history keeps a tuple of the frames (a tuple given is kept as is),
        or the key and ``packed`` when ``packed`` is the store's packed form of
        this very update (checked: no properties, its length, sequence and
        uuid; a sequence names one update).
        """
        if len(frames) != _UPDATE_FRAMES or len(frames[1]) != 8:
            raise ValueError("an update is 5 frames with an 8-byte sequence")
        seq = int.from_bytes(frames[1], "big")
        if seq < 1:
            raise ValueError("an update's sequence is at least 1")
        updates, keys = self._updates, self._keys
        if seq != self._base + len(updates) + 1:
            if updates or self._anchored:
                self.restarts += 1
            self._clear()
            self._base = seq - 1
        self._anchored = True
        stored: _Held
        if (
            packed is not None
            and not frames[3]
            and len(packed) == 24 + len(frames[4])
            and packed.startswith(frames[1])
            and packed[8:24] == frames[2]
        ):
            stored = packed
        else:
            stored = frames if type(frames) is tuple else tuple(frames)
        key = frames[0]
        updates.append(stored)
        keys.append(key)
        terms = self._terms
        if not terms or terms[-1][1] != term:
            terms.append((seq, term))
        index = self._index
        if index is not None:
            index[frames[2]] = stored
            self._unasked += 1
            if self._unasked > self._max_updates:
                # The ring turned over with no question: let the index go.
                self._index = index = None
        self._bytes += _size(key, stored)
        # Evict the oldest, but never the newest: it anchors the next append.
        while len(updates) > 1 and (
            len(updates) > self._max_updates or self._bytes > self._max_bytes
        ):
            old = updates.popleft()
            self._bytes -= _size(keys.popleft(), old)
            self._base += 1
            if index is not None:
                # A newer update with the same uuid keeps its entry.
                uuid = _uuid(old)
                if index.get(uuid) is old:
                    del index[uuid]
        # Runs wholly below the oldest held update are no one's any more.
        first = self._base + 1
        if len(terms) > 1 and terms[1][0] <= first:
            while len(terms) > 1 and terms[1][0] <= first:
                del terms[0]

    def _clear(self) -> None:
        self._updates.clear()
        self._keys.clear()
        self._terms.clear()
        self._bytes = 0
        if self._index is not None:
            self._index.clear()

    def reset(self, sequence: int) -> None:
        """Empty the history; the next update will be ``sequence + 1``.

        For a full resync: the store jumped to ``sequence`` without updates
        this history could hold.
        """
        if sequence < 0:
            raise ValueError(f"sequence must not be negative, not {sequence}")
        self._clear()
        self._base = sequence
        self._anchored = True

    def load(
        self,
        rows: Iterable[tuple[Sequence[bytes], int, float]],
        packed_of: Callable[[bytes], bytes | None] | None = None,
    ) -> None:
        """Append the database log's rows ``(frames, term, at)``, oldest first.

        ``packed_of``: the store's packed entry of a key (``Store.packed``), to
        share as :meth:`append` does (a restart's history then costs what a
        running server's does)."""
        for frames, term, _at in rows:
            self.append(frames, term, None if packed_of is None else packed_of(frames[0]))

    # ----------------------------------------------------------------------
    # Queries

    def __len__(self) -> int:
        return len(self._updates)

    @property
    def first(self) -> int | None:
        """The oldest update's sequence, or None when empty."""
        return self._base + 1 if self._updates else None

    @property
    def last(self) -> int | None:
        """The newest update's sequence, or None when empty."""
        return self._base + len(self._updates) if self._updates else None

    @property
    def base(self) -> int:
        """The sequence the history starts after (``first - 1``, or the reset value)."""
        return self._base

    @property
    def bytes(self) -> int:
        """Bytes held: the sum of the frames' lengths (5 per update)."""
        return self._bytes

    @property
    def keep_from(self) -> int:
        """The lowest sequence still needed: the database log may drop below it."""
        return self._base + 1

    @property
    def indexed(self) -> bool:
        """Whether the uuid index is built (it is dropped when unasked)."""
        return self._index is not None

    def covers(self, since: int) -> bool:
        """Whether every update after ``since``, up to the newest, is held."""
        return self._base <= since <= self._base + len(self._updates)

    def since(self, seq: int) -> list[_Frames]:
        """The updates after ``seq``, oldest first; ``covers(seq)`` must hold.

        O(k) for the k updates returned: they are taken from the newest end,
        so a requester slightly behind costs little however long the history.
        """
        if not self.covers(seq):
            raise ValueError(f"history ({self._base}, {self.last}] does not cover {seq}")
        count = self._base + len(self._updates) - seq
        held = list(islice(reversed(self._updates), count))
        held.reverse()
        keys = list(islice(reversed(self._keys), count))
        keys.reverse()
        return _frames_of(keys, held)

    def sequence_of(self, uuid: _Uuid) -> int | None:
        """The sequence of the newest held update with ``uuid``, if any: O(1)
        once the index is built (the first question after a quiet while
        builds it: O(updates held))."""
        index = self._index
        if index is None:
            updates = self._updates
            uuids = map(_UUID, updates) if _all_packed(updates) else map(_uuid, updates)
            # Oldest first, so the newest update with a uuid wins.
            index = self._index = dict(zip(uuids, updates, strict=True))
        self._unasked = 0
        held = index.get(uuid)
        return None if held is None else int.from_bytes(_seq_frame(held), "big")

    def written_under(self, term: int) -> list[_Frames]:
        """The held updates recorded under ``term``, oldest first: what a
        server wrote while active in it (a demoted one's split-brain writes
        are among them)."""
        out: list[_Held] = []
        out_keys: list[bytes] = []
        terms, updates, base = self._terms, self._updates, self._base
        for i, (start, t) in enumerate(terms):
            if t != term:
                continue
            end = terms[i + 1][0] if i + 1 < len(terms) else base + len(updates) + 1
            lo, hi = max(start - base - 1, 0), max(end - base - 1, 0)
            out.extend(islice(updates, lo, hi))
            out_keys.extend(islice(self._keys, lo, hi))
        return _frames_of(out_keys, out)

    def entry(self, seq: int) -> _Entry | None:
        """The update at ``seq`` and its term, or None if not held."""
        index = seq - self._base - 1
        if 0 <= index < len(self._updates):
            terms = self._terms
            held = _frames(self._keys[index], self._updates[index])
            return held, terms[bisect_right(terms, (seq, inf)) - 1][1]
        return None
