"""A catch-up reply (KVDELTA) being streamed to one requester.

How this works: when a restarted server asks for the updates after its last
sequence (``X-CHP-Since``, :mod:`clone.wire.delta`) and the active's
:class:`~clone.server.history.History` can answer, :func:`open_catch_up`
takes the updates it is missing from the history, at once (a list of
references, O(k) for k updates), and a :class:`DeltaStream` sends them::

    preamble messages (KVAPPLIED, when asked for)
    KVDELTA (from_sequence)
    KVSYNC per update, in order, as published (deletes have an empty body)
    KTHXBAI (sequence, subtree "")

It has the interface :mod:`clone.server.serving` drives a
:class:`~clone.server.snapshot.SnapshotStream` through -- :meth:`peek` /
:meth:`advance`, ``sent``, ``done``, ``sequence``... -- so the same pump
serves it: a send that fails (EAGAIN) is retried with the same frames and
drops nothing.  Unlike a snapshot it is exact, not fuzzy: the updates are
those of the history when the stream opened, and KTHXBAI carries the
sequence of the last one.  An update of an ephemeral key that the key still
holds goes out with the time it has left as its ``ttl`` (``served``, see
:meth:`clone.server.store.Store.served`), not the whole ttl it was granted
long ago.  Sans-IO: no sockets; the clock is read only through ``served``.

When :func:`open_catch_up` returns None the requester gets a full snapshot;
the rules are in :mod:`clone.wire.delta`.

A client's *history request* (no digest, ``changes(since=N)``) is answered by
:func:`open_history`, which always returns a stream: the updates after N under
the requested subtree and, for a restricted requester, under its read
prefixes (so the delta may skip sequences: it is exact within that filter),
or -- when the history no longer reaches back to N -- a KVDELTA saying
``compacted=<oldest held>`` followed directly by KTHXBAI.

:func:`open_stream` chooses among the three for a request (history, catch-up
or the whole state as a snapshot); the core calls it for every ICANHAZ?.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from clone.server.history import History
from clone.server.snapshot import SnapshotStream, effective_prefixes
from clone.server.store import Entry, Served, Store
from clone.wire.codec import Properties, encode_kthxbai
from clone.wire.delta import SinceRequest, encode_kvdelta, update_digest

__all__ = ["DeltaStream", "open_catch_up", "open_history", "open_stream"]


class DeltaStream:
    """The state of one KVDELTA reply in flight."""

    __slots__ = (
        "_current",
        "_done",
        "_end_properties",
        "_ended",
        "_head",
        "_index",
        "_preamble",
        "_served",
        "_updates",
        "compacted",
        "from_sequence",
        "identity",
        "sent",
        "sequence",
        "subtree",
    )

    #: Never batched: updates go out as KVSYNCs (for the pump's bookkeeping).
    batch = False
    #: KVBATCH messages sent: always none.
    batches_sent = 0

    def __init__(
        self,
        identity: bytes,
        updates: Sequence[Sequence[bytes]],
        from_sequence: int,
        sequence: int,
        *,
        preamble: Sequence[Sequence[bytes]] = (),
        subtree: str = "",
        filtered: bool = False,
        compacted: int | None = None,
        end_properties: Properties = (),
        served: Served | None = None,
    ) -> None:
        if not filtered and compacted is None and sequence - from_sequence != len(updates):
            # The updates must be exactly from_sequence+1 .. sequence, or the
            # requester would end up with a gap or a stale sequence.  A
            # filtered delta (a history request's subtree or read prefixes)
            # skips the others by design.
            raise ValueError(
                f"{len(updates)} updates do not lead from {from_sequence} to {sequence}"
            )
        if compacted is not None and updates:
            raise ValueError("a compacted reply carries no update")
        self.identity = identity
        self.from_sequence = from_sequence
        #: What KTHXBAI carries: the store's sequence when the stream opened
        #: (that of the last update held).
        self.sequence = sequence
        #: The subtree KTHXBAI names ("" but for a history request).
        self.subtree = subtree
        #: The oldest sequence held, when the history request cannot be answered.
        self.compacted = compacted
        self._end_properties = end_properties
        # Reversed, so the next one is popped off the end.
        self._preamble = [[identity, *frames] for frames in reversed(preamble)]
        self._head: list[bytes] | None = [identity, *encode_kvdelta(from_sequence, compacted)]
        self._updates = updates
        self._served = served
        self._index = 0
        self._current: list[bytes] | None = None
        self._ended = False  # KTHXBAI has been produced
        self._done = False  # KTHXBAI has been sent
        #: Updates sent so far (preamble, KVDELTA and KTHXBAI not counted).
        self.sent = 0

    @property
    def done(self) -> bool:
        """True once KTHXBAI has been sent."""
        return self._done

    @property
    def total_keys(self) -> int:
        """Updates in the delta (named as on a snapshot, for the pump's log)."""
        return len(self._updates)

    def peek(self) -> Sequence[bytes] | None:
        """The next message's frames (identity first), or None once done."""
        if self._current is not None:
            return self._current
        if self._done:
            return None
        if self._preamble:
            self._current = self._preamble[-1]
        elif self._head is not None:
            self._current = self._head
        elif self._index < len(self._updates):
            update = self._updates[self._index]
            if self._served is not None and update[3]:
                key, seq, uuid, props, body = update
                update = [key, *self._served(key, (seq, uuid, props, body))]
            self._current = [self.identity, *update]
        else:
            self._updates = []  # free the references as soon as possible
            self._ended = True
            self._current = [
                self.identity,
                *encode_kthxbai(self.sequence, self.subtree, self._end_properties),
            ]
        return self._current

    def advance(self) -> None:
        """The frames from :meth:`peek` were sent; move on."""
        if self._current is None:
            raise ValueError("advance() without a successful peek()")
        self._current = None
        if self._ended:
            self._done = True
        elif self._preamble:
            self._preamble.pop()
        elif self._head is not None:
            self._head = None
        else:
            self._index += 1
            self.sent += 1


def open_catch_up(
    history: History,
    request: SinceRequest,
    identity: bytes,
    sequence: int,
    preamble: Sequence[Sequence[bytes]] = (),
    *,
    subtree: str = "",
    served: Served | None = None,
) -> DeltaStream | None:
    """A delta for ``request``, or None when the requester needs a full snapshot.

    ``sequence`` is the store's: the delta is given only if the history ends
    there, so that it holds every update the store has applied.  None when:
    the request is for sequence 0 or for a subtree, the history does not
    cover the request's sequence, no update is held at that sequence to
    compare digests with, or the digests differ (the requester's history
    diverged from ours), or the requester names the term its update was
    written under and ours was written under another.

    Why the term: after a failover the new active publishes its pending list
    (client writes the old one may also have published) with fresh
    sequences, and can publish the very update the old active had at the
    same sequence after a different one before it: the digests agree and the
    histories do not.  One active per term writes each term's updates, so
    the same update under the same term has the same history before it.
    """
    since = request.sequence
    if since == 0 or subtree:
        return None
    if history.base + len(history) != sequence or not history.covers(since):
        return None
    held = history.entry(since)
    if held is None or update_digest(held[0]) != request.digest:
        return None
    if request.term is not None and held[1] != request.term:
        return None
    return DeltaStream(
        identity, history.since(since), since, sequence, preamble=preamble, served=served
    )


def open_history(
    history: History,
    request: SinceRequest,
    identity: bytes,
    sequence: int,
    preamble: Sequence[Sequence[bytes]] = (),
    *,
    subtree: str = "",
    allowed: Sequence[bytes] | None = None,
    end_properties: Properties = (),
    served: Served | None = None,
) -> DeltaStream:
    """The reply to a client's history request: every update after
    ``request.sequence`` under ``subtree`` and the ``allowed`` read prefixes
    (None: all), or a compacted reply when the history does not reach back.

    ``sequence`` is the store's.  A request at or beyond it has nothing to
    replay: an empty delta (KTHXBAI then carries ``sequence``, which may be
    below ``from_sequence``; the requester goes live from its own).  Otherwise
    the history must end at ``sequence`` and cover the request, or the reply
    is compacted, naming the oldest sequence still held (``sequence + 1``
    when none is: only updates from now on can be replayed).
    """
    since = request.sequence
    prefixes = effective_prefixes(subtree.encode("utf-8"), allowed)
    filtered = prefixes != (b"",)
    if since >= sequence:
        return DeltaStream(
            identity,
            [],
            since,
            sequence,
            preamble=preamble,
            subtree=subtree,
            filtered=True,
            end_properties=end_properties,
        )
    last = history.base + len(history)
    if last != sequence or not history.covers(since):
        oldest = history.base + 1 if last == sequence else sequence + 1
        return DeltaStream(
            identity,
            [],
            since,
            sequence,
            preamble=preamble,
            subtree=subtree,
            compacted=oldest,
            end_properties=end_properties,
        )
    updates = history.since(since)
    if filtered:
        updates = [frames for frames in updates if frames[0].startswith(prefixes)]
    return DeltaStream(
        identity,
        updates,
        since,
        sequence,
        preamble=preamble,
        subtree=subtree,
        filtered=filtered,
        end_properties=end_properties,
        served=served,
    )


def open_stream(
    store: Store,
    history: History,
    identity: bytes,
    subtree: str,
    preamble: Sequence[Sequence[bytes]] = (),
    *,
    batch: bool = False,
    since: SinceRequest | None = None,
    allowed: Sequence[bytes] | None = None,
    end_properties: Properties = (),
    clock: Callable[[], float] | None = None,
) -> SnapshotStream | DeltaStream:
    """What a snapshot request gets, after ``preamble``: a client's history
    request (``since`` without a digest) always a delta or a compacted reply
    (:func:`open_history`); a peer's catch-up request the updates it lacks if
    the history still reaches back to it (:func:`open_catch_up`; never for a
    subtree or a restricted requester); otherwise the whole state under
    ``subtree`` (KVBATCH if ``batch``).  ``clock`` (monotonic; a peer
    server's request) is read as entries go out, so that an ephemeral key
    carries the time it has left (:meth:`Store.served`)."""
    served: Served | None = None
    if clock is not None:
        read = clock

        def served(raw_key: bytes, entry: Entry) -> Entry:
            return store.served(raw_key, entry, read())

    if since is not None and since.history:
        # A client's history request: the updates it asked for, or why not;
        # never a snapshot.
        return open_history(
            history,
            since,
            identity,
            store.sequence,
            preamble,
            subtree=subtree,
            allowed=allowed,
            end_properties=end_properties,
        )
    if since is not None and not subtree and allowed is None:
        delta = open_catch_up(history, since, identity, store.sequence, preamble, served=served)
        if delta is not None:
            return delta
    return SnapshotStream(
        identity,
        subtree,
        store,
        batch=batch,
        preamble=preamble,
        allowed=allowed,
        end_properties=end_properties,
        served=served,
    )
