"""One snapshot being streamed to one requester, a chunk at a time.

How this works: a snapshot of a million keys must not stall the reactor, so it
is sent in bounded chunks between other work.  When it starts, a
:class:`SnapshotStream` copies the key list (one C-level list copy) and records
the store's sequence: that is what KTHXBAI will carry.  Each chunk then looks up
the *current* value of the next keys, skipping keys deleted since, and keys
outside the subtree.  This is the fuzzy snapshot of ``docs/protocol.md``: a
KVSYNC may be newer than KTHXBAI's sequence, and a client that replays the
KVPUBs after that sequence converges on the server's state.

The I/O layer drives it with :meth:`peek` / :meth:`advance`: it tries to send
the frames ``peek`` returns and calls ``advance`` only when the send succeeded,
so a full socket (EAGAIN) never drops an entry -- it just retries the same
frames later.  Sans-IO: no sockets, no clock.
"""

from __future__ import annotations

from clone.codec import encode_kthxbai, encode_kv
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
        "_store",
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
        self._store = store
        self._keys = store.keys()
        self._total = len(self._keys)
        self._index = 0
        self._current: list[bytes] | None = None
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

    def peek(self) -> list[bytes] | None:
        """The next message's frames (identity first), or None.

        None means either the stream is done, or ``SCAN_BUDGET`` keys outside
        the subtree were skipped and the caller should yield before asking
        again (check :attr:`done`).
        """
        if self._current is not None:
            return self._current
        if self._done:
            return None
        keys = self._keys
        get = self._store.get
        subtree = self.subtree
        scanned = 0
        while self._index < len(keys):
            key = keys[self._index]
            self._index += 1
            if subtree and not key.startswith(subtree):
                scanned += 1
                if scanned >= SCAN_BUDGET:
                    return None
                continue
            msg = get(key)
            if msg is None:  # deleted since the snapshot started
                continue
            self._current = [self.identity, *encode_kv(msg)]
            return self._current
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
