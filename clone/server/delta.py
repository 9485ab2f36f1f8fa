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
sequence of the last one.  Sans-IO: no sockets, no clock.

When :func:`open_catch_up` returns None the requester gets a full snapshot;
the rules are in :mod:`clone.wire.delta`.
"""

from __future__ import annotations

from collections.abc import Sequence

from clone.server.history import History
from clone.wire.codec import encode_kthxbai
from clone.wire.delta import SinceRequest, encode_kvdelta, update_digest

__all__ = ["DeltaStream", "open_catch_up"]


class DeltaStream:
    """The state of one KVDELTA reply in flight."""

    __slots__ = (
        "_current",
        "_done",
        "_ended",
        "_head",
        "_index",
        "_preamble",
        "_updates",
        "from_sequence",
        "identity",
        "sent",
        "sequence",
    )

    #: The whole store: a delta is never for a subtree.
    subtree = ""
    #: Never batched: updates go out as KVSYNCs (for the pump's bookkeeping).
    batch = False
    #: KVBATCH messages sent: always none.
    batches_sent = 0

    def __init__(
        self,
        identity: bytes,
        updates: list[list[bytes]],
        from_sequence: int,
        sequence: int,
        *,
        preamble: Sequence[Sequence[bytes]] = (),
    ) -> None:
        if sequence - from_sequence != len(updates):
            # The updates must be exactly from_sequence+1 .. sequence, or the
            # requester would end up with a gap or a stale sequence.
            raise ValueError(
                f"{len(updates)} updates do not lead from {from_sequence} to {sequence}"
            )
        self.identity = identity
        self.from_sequence = from_sequence
        #: What KTHXBAI carries: the sequence of the last update sent.
        self.sequence = sequence
        # Reversed, so the next one is popped off the end.
        self._preamble = [[identity, *frames] for frames in reversed(preamble)]
        self._head: list[bytes] | None = [identity, *encode_kvdelta(from_sequence)]
        self._updates = updates
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
            self._current = [self.identity, *self._updates[self._index]]
        else:
            self._updates = []  # free the references as soon as possible
            self._ended = True
            self._current = [self.identity, *encode_kthxbai(self.sequence, "")]
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
) -> DeltaStream | None:
    """A delta for ``request``, or None when the requester needs a full snapshot.

    ``sequence`` is the store's: the delta is given only if the history ends
    there, so that it holds every update the store has applied.  None when:
    the request is for sequence 0 or for a subtree, the history does not
    cover the request's sequence, no update is held at that sequence to
    compare digests with, or the digests differ (the requester's history
    diverged from ours).
    """
    since = request.sequence
    if since == 0 or subtree:
        return None
    if history.base + len(history) != sequence or not history.covers(since):
        return None
    held = history.entry(since)
    if held is None or update_digest(held[0]) != request.digest:
        return None
    return DeltaStream(identity, history.since(since), since, sequence, preamble=preamble)
