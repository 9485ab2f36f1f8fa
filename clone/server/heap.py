"""The garbage collector and a store of millions of keys: freeze the state.

Why: CPython's cyclic collector, on a full collection, traverses every
container it tracks, and the store's dict is one: traversing it touches each
of its keys and values, tens of millions of objects spread over the heap.  At
10,000,000 keys a full collection held the loop for 2 to 4.7 s, several times
during one snapshot (a `clone dump` then gave up, and a pair's backup took
over from a primary that was only collecting); with the collector off the
same dump ran with no heartbeat over 0.45 s late.  The store holds no cycles
(bytes and tuples of bytes), so the collector has nothing to find in it.

How: :func:`freeze_state` moves every object alive now to the collector's
permanent generation (``gc.freeze``, O(1)): later collections skip them,
while reference counting still frees any of them that is dropped.  Called
where the store's dict is (re)built: at the start (after a data directory was
loaded, or on the empty in-memory store) and after a full sync from the peer
replaced the state; and when a snapshot of :data:`FREEZE_KEYS` keys or more
has copied the key list it walks (by the opener of the snapshot port's
streams, :mod:`clone.server.opening`: a process-wide step stays out of the
sans-IO stream).  A store that grows by writes keeps its
(frozen) dict.  What it costs: a cycle that is garbage at that moment is
never collected, a leak bounded by the cycles alive at each of those moments.
"""

from __future__ import annotations

import gc

__all__ = ["FREEZE_KEYS", "freeze_state"]

#: A snapshot of at least this many keys freezes its copy of the key list (a
#: list is a container the collector walks, item by item, while it lives).
FREEZE_KEYS = 1_000_000


def freeze_state() -> None:
    """Keep the objects alive now out of every later collection."""
    gc.freeze()
