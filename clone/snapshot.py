"""One snapshot being streamed to one requester, a chunk at a time.

How this works: a snapshot of a million keys must not stall the reactor, so it
is sent in bounded chunks between other work.  When it starts, a
:class:`SnapshotStream` copies the raw key list (one C-level list copy, about
5 ms for a million keys) and records the store's sequence: that is what KTHXBAI
will carry.  Each chunk then looks up the *current* frames of the next keys,
skipping keys deleted since, and keys outside the subtree (a byte prefix, the
same rule as the text prefix for UTF-8).  The store keeps every key's frames as
published, so an entry is sent as it is, never re-encoded.  This is the fuzzy
snapshot of ``docs/protocol.md``: a KVSYNC may be newer than KTHXBAI's
sequence, and a client that replays the KVPUBs after that sequence converges on the server's state.

The I/O layer drives it with :meth:`peek` / :meth:`advance`: it tries to send
the frames ``peek`` returns and calls ``advance`` only when the send succeeded,
so a full socket (EAGAIN) never drops an entry -- it just retries the same
frames later.  Sans-IO: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

from clone.codec import encode_kthxbai
from clone.store import Store

__all__ = ["SnapshotStream"]

# How many keys outside the subtree one peek() may skip before giving the
# reactor back; bounds the work of a turn for a sparse subtree.
SCAN_BUDGET = 10_000


class SnapshotStream:
    """The state of one ICANHAZ? reply in flight."""

    __slots__ = (
        "_current",
        "_done",
        "_ended",
        "_index",
        "_keys",
        "_lookup",
        "_prefix",
        "_total",
        "identity",
        "sent",
        "sequence",
        "subtree",
    )

    def __init__(self, identity: bytes, subtree: str, store: Store) -> None:
        self.identity = identity
        self.subtree = subtree
        self.sequence = store.sequence
        self._prefix = subtree.encode("utf-8")
        self._lookup = store.entry
        self._keys = store.raw_keys()
        self._total = len(self._keys)
        self._index = 0
        self._current: Sequence[bytes] | None = None
        self._ended = False  # KTHXBAI has been produced
        self._done = False  # KTHXBAI has been sent
        #: KVSYNCs sent so far (KTHXBAI not counted).
        self.sent = 0

    @property
    def done(self) -> bool:
        """True once KTHXBAI has been sent."""
        return self._done

    @property
    def total_keys(self) -> int:
        """Keys in the store when the snapshot started (before subtree filter)."""
        return self._total

    def peek(self) -> Sequence[bytes] | None:
        """The next message's frames (identity first, six in all), or None.

        None means either the stream is done, or ``SCAN_BUDGET`` keys outside
        the subtree were skipped and the caller should yield before asking
        again (check :attr:`done`).
        """
        if self._current is not None:
            return self._current
        if self._done:
            return None
        keys = self._keys
        lookup = self._lookup
        prefix = self._prefix
        index = self._index
        end = len(keys)
        scanned = 0
        while index < end:
            key = keys[index]
            index += 1
            if prefix and not key.startswith(prefix):
                scanned += 1
                if scanned >= SCAN_BUDGET:
                    self._index = index
                    return None
                continue
            entry = lookup(key)
            if entry is None:  # deleted since the snapshot started
                continue
            self._index = index
            self._current = (self.identity, key, *entry)
            return self._current
        self._index = index
        self._keys = []  # free the copy as soon as it is no longer needed
        self._ended = True
        self._current = [self.identity, *encode_kthxbai(self.sequence, self.subtree)]
        return self._current

    def advance(self) -> None:
        """The frames from :meth:`peek` were sent; move on."""
        if self._current is None:
            raise ValueError("advance() without a successful peek()")
        self._current = None
        if self._ended:
            self._done = True
        else:
            self.sent += 1
