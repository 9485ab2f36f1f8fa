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
frames later.  An ephemeral key goes out with the time it has left as its
``ttl`` (``served``, see :meth:`clone.server.store.Store.served`), so the
receiver counts it from when it gets it.  Sans-IO: no sockets; the clock is
read only through ``served``.

In batch mode (a requester that negotiated our KVBATCH extension, see
:mod:`clone.wire.batch`) each message packs up to ``MAX_BATCH_ENTRIES`` entries, and
the per-key work is done a column at a time in C: a window of the key list is
filtered by prefix with ``compress``, looked up with ``map``, and keys deleted
since are dropped.  Keys that did not fit under the batch's byte target are
carried into the next batch and looked up again then.

With ``allowed`` (the read prefixes of a restricted requester, see
:mod:`clone.server.security`) a key must lie under the subtree *and* under
one of them: both are folded into one tuple of prefixes at the start
(:func:`effective_prefixes`), and a key is tested with one C-level
``bytes.startswith(tuple)``.  ``end_properties`` go into the KTHXBAI (the
requester's view and its count).

A ``preamble`` of whole messages goes out before the first entry: a peer
server's sync gets the KVAPPLIED list there (:mod:`clone.wire.applied`), built when
the stream starts so that it is consistent with the recorded sequence.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from itertools import accumulate, compress, repeat
from operator import itemgetter
from typing import cast

from clone.server.store import Entry, Served, Store
from clone.wire.batch import batch_size, encode_kvbatch
from clone.wire.codec import Properties, encode_kthxbai
from clone.wire.protocol import BATCH_TARGET_BYTES, MAX_BATCH_ENTRIES

__all__ = ["SnapshotStream", "effective_prefixes"]

_PROPS = itemgetter(2)  # an entry's properties frame
_BODY = itemgetter(3)  # ... and its value

# How many keys outside the subtree one peek() may skip before giving the
# reactor back; bounds the work of a turn for a sparse subtree.
SCAN_BUDGET = 10_000


def effective_prefixes(subtree: bytes, allowed: Sequence[bytes] | None) -> tuple[bytes, ...]:
    """The prefixes a key must start with (one of them) to be in the snapshot.

    ``(b"",)`` is everything; ``()`` nothing (the requester may read none of
    the subtree).
    """
    if allowed is None:
        return (subtree,)
    out: list[bytes] = []
    for prefix in allowed:
        if subtree.startswith(prefix):
            return (subtree,)  # the whole subtree lies under one allowed prefix
        if prefix.startswith(subtree):
            out.append(prefix)
    return tuple(out)


class SnapshotStream:
    """The state of one ICANHAZ? reply in flight."""

    __slots__ = (
        "_carry",
        "_current",
        "_current_entries",
        "_done",
        "_end_properties",
        "_ended",
        "_index",
        "_keys",
        "_lookup",
        "_lookup_many",
        "_preamble",
        "_prefix",
        "_prefixes",
        "_served",
        "_sizes",
        "_total",
        "batch",
        "batches_sent",
        "identity",
        "sent",
        "sequence",
        "subtree",
    )

    def __init__(
        self,
        identity: bytes,
        subtree: str,
        store: Store,
        *,
        batch: bool = False,
        preamble: Sequence[Sequence[bytes]] = (),
        allowed: Sequence[bytes] | None = None,
        end_properties: Properties = (),
        served: Served | None = None,
    ) -> None:
        self.identity = identity
        # Reversed, so the next one is popped off the end.
        self._preamble = [[identity, *frames] for frames in reversed(preamble)]
        #: Whether entries go out as KVBATCH messages rather than KVSYNCs.
        self.batch = batch
        self.subtree = subtree
        self.sequence = store.sequence
        self._prefixes = effective_prefixes(subtree.encode("utf-8"), allowed)
        # One prefix (the common case): tested as before; b"" = every key.
        self._prefix = self._prefixes[0] if len(self._prefixes) == 1 else None
        self._end_properties = end_properties
        self._lookup = store.entry
        self._lookup_many = store.entries
        self._sizes = store.held_sizes
        self._served = served
        self._keys = store.raw_keys()
        self._total = len(self._keys)
        self._index = 0
        self._current: Sequence[bytes] | None = None
        self._current_entries = 0  # entries in _current
        self._carry: list[bytes] = []  # batch mode: keys picked but not yet sent
        self._ended = False  # KTHXBAI has been produced
        self._done = False  # KTHXBAI has been sent
        #: Entries sent so far, one per KVSYNC or per key in a KVBATCH (KTHXBAI
        #: not counted).
        self.sent = 0
        #: KVBATCH messages sent so far (batch mode).
        self.batches_sent = 0

    @property
    def done(self) -> bool:
        """True once KTHXBAI has been sent."""
        return self._done

    @property
    def total_keys(self) -> int:
        """Keys in the store when the snapshot started (before subtree filter)."""
        return self._total

    def peek(self) -> Sequence[bytes] | None:
        """The next message's frames (identity first), or None.

        Six frames for a KVSYNC or KTHXBAI, eleven for a KVBATCH.  None means
        either the stream is done, or ``SCAN_BUDGET`` keys were skipped (outside
        the subtree, or deleted since) and the caller should yield before
        asking again (check :attr:`done`).
        """
        if self._current is not None:
            return self._current
        if self._done:
            return None
        if self._preamble:
            self._current = self._preamble[-1]
            self._current_entries = 0
            return self._current
        if self.batch:
            return self._peek_batch()
        keys = self._keys
        lookup = self._lookup
        prefix = self._prefix if self._prefix is not None else self._prefixes
        index = self._index
        end = len(keys)
        scanned = 0
        while index < end:
            key = keys[index]
            index += 1
            if prefix != b"" and not key.startswith(prefix):
                scanned += 1
                if scanned >= SCAN_BUDGET:
                    self._index = index
                    return None
                continue
            entry = lookup(key)
            if entry is None:  # deleted since the snapshot started
                continue
            if entry[2] and self._served is not None:
                entry = self._served(key, entry)
            self._index = index
            self._current = (self.identity, key, *entry)
            self._current_entries = 1
            return self._current
        self._index = index
        return self._end()

    def _end(self) -> Sequence[bytes]:
        self._keys = []  # free the copy as soon as it is no longer needed
        self._ended = True
        self._current_entries = 0
        self._current = [
            self.identity,
            *encode_kthxbai(self.sequence, self.subtree, self._end_properties),
        ]
        return self._current

    def _peek_batch(self) -> Sequence[bytes] | None:
        keys = self._keys
        prefix = self._prefix if self._prefix is not None else self._prefixes
        index = self._index
        end = len(keys)
        picked, self._carry = self._carry, []
        scanned = 0
        while len(picked) < MAX_BATCH_ENTRIES and index < end and scanned < SCAN_BUDGET:
            # Whole windows, so a subtree that matches one key in two does not
            # make a long run of ever smaller windows; the excess is carried.
            window = keys[index : index + MAX_BATCH_ENTRIES]
            index += len(window)
            scanned += len(window)
            if prefix != b"":
                window = list(compress(window, map(bytes.startswith, window, repeat(prefix))))
            picked += window
        self._index = index
        if len(picked) > MAX_BATCH_ENTRIES:
            self._carry = picked[MAX_BATCH_ENTRIES:]
            del picked[MAX_BATCH_ENTRIES:]
        if not picked:
            return None if index < end else self._end()
        sizes = self._sizes(picked)
        if sum(sizes) >= BATCH_TARGET_BYTES and len(picked) > 1:
            # Large values: cut the batch at the byte target before slicing
            # them out of the store.  Looking up the whole window first copied
            # every remaining value at each batch (the hostile drill's disk
            # attack, 165 MB of 512 KB values: 4.6 s of one loop turn).
            n = max(1, bisect_left(list(accumulate(sizes)), BATCH_TARGET_BYTES) + 1)
            if n < len(picked):
                self._carry[:0] = picked[n:]
                del picked[n:]
        found = self._lookup_many(picked)
        if None in found:  # deleted since the snapshot started
            kept = [(k, e) for k, e in zip(picked, found, strict=True) if e is not None]
            if not kept:
                if self._carry or index < end:
                    return None
                return self._end()
            picked = [k for k, _ in kept]
            entries = [e for _, e in kept]
        else:
            entries = cast(list[Entry], found)
        served = self._served
        if served is not None and any(map(_PROPS, entries)):  # in C: most batches have none
            entries = [served(k, e) if e[2] else e for k, e in zip(picked, entries, strict=True)]
        n = len(picked)
        if sum(map(len, map(_BODY, entries))) >= BATCH_TARGET_BYTES // 4:
            # Large values: size the batch before encoding it.  Encoding all of
            # them first built a frame of every remaining value at each batch
            # (660 MB of 512 KB values: 23 s of one loop turn, and the memory).
            n = batch_size(picked, entries)
            if n < len(picked):
                self._carry[:0] = picked[n:]
                picked, entries = picked[:n], entries[:n]
        frames = encode_kvbatch(picked, entries)
        if len(frames[2]) + len(frames[7]) + len(frames[9]) >= BATCH_TARGET_BYTES:
            # Over the byte target (large values; rare): fewer entries.
            n = batch_size(picked, entries)
            if n < len(picked):
                self._carry[:0] = picked[n:]
                frames = encode_kvbatch(picked[:n], entries[:n])
        self._current = [self.identity, *frames]
        self._current_entries = n
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
        else:
            self.sent += self._current_entries
            if self.batch:
                self.batches_sent += 1
