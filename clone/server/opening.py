"""What an accepted snapshot request gets: a private stream, or a share of one.

How this works: under CURVE the requester's rights decide what it may read
(its read prefixes, and its view's id and count in the KTHXBAI); the core then
opens a catch-up or the whole state (:func:`clone.server.delta.open_stream`).
A full snapshot that is the same for several requesters (the same subtree,
batch mode and view, at the same version of the store) is encoded once and
read by each (:mod:`.sharedsnap`): a requester without a catch-up joins one
already started before the core copies the key list for it; one whose
catch-up fell back to a full snapshot joins, or starts, one with the stream
the core made.  A peer server's sync (the applied list, ephemeral keys with
their time left) is never shared.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping

from clone.security import PEER_USER
from clone.server.access import Access
from clone.server.core import ServerCore
from clone.server.delta import DeltaStream
from clone.server.heap import FREEZE_KEYS, freeze_state
from clone.server.sharedsnap import ENTRY_OVERHEAD, SharedSnapshots, SharedStream, ShareKey
from clone.server.snapshot import SnapshotStream
from clone.wire.control import view_id
from clone.wire.delta import SinceRequest

__all__ = ["AnyStream", "Opener"]

#: A reply being streamed from the snapshot port: the state (private or
#: shared), or a catch-up.
AnyStream = SnapshotStream | DeltaStream | SharedStream


class Opener:
    """Opens the reply to each accepted request, for :class:`SnapshotStreams`."""

    def __init__(
        self,
        core: ServerCore,
        access: Access,
        shares: SharedSnapshots,
        counters: MutableMapping[str, int],
        *,
        secure: bool,
        view_count: Callable[[str], int],
        wallclock: Callable[[], float],
        clock: Callable[[], float],
    ) -> None:
        self.core = core
        self._access = access
        self.shares = shares
        self._counters = counters
        self._secure = secure
        self._view_count = view_count
        self._wallclock = wallclock
        self._clock = clock

    def open(
        self,
        identity: bytes,
        subtree: str,
        *,
        batch: bool,
        applied: bool,
        since: SinceRequest | None,
        user: str | None,
        ttl_left: bool,
    ) -> tuple[AnyStream, bool]:
        """The stream for a request, and whether it carries the applied list
        (a peer's sync: the rights may have taken it away)."""
        allowed: tuple[bytes, ...] | None = None
        end_properties: tuple[tuple[str, str], ...] = ()
        if self._secure:
            # CURVE: the requester's rights decide what the snapshot holds;
            # the peer-only extensions are for the pair's own key alone.
            rights = self._access.rights_of(user if user in self._access.admitted else None)
            if user != PEER_USER:
                # A client's history request stays, filtered by its read
                # prefixes below.  A digest catch-up extends the requester's
                # whole map, so it is for those who may read everything: a
                # restricted client's view count comes only from the KTHXBAI
                # of a filtered snapshot.
                applied = False
                if since is not None and not since.history and not rights.read_all:
                    since = None
            if not rights.read_all:
                allowed = tuple(rights.read)
                vid = view_id(rights.read)
                count = self._view_count(vid)
                end_properties = (("view", vid), ("view_count", str(count)))
        store = self.core.store
        key = ShareKey(subtree, batch, allowed, end_properties, store.sequence, store.version)
        shareable = not applied and not ttl_left
        if shareable and since is None:
            reader = self.shares.join(identity, key)
            if reader is not None:
                self._counters["snapshots_shared"] += 1
                return reader, applied
        stream = self.core.open_snapshot(
            identity,
            subtree,
            batch=batch,
            applied=applied,
            now=self._wallclock(),
            clock=self._clock if ttl_left else None,
            since=since,
            allowed=allowed,
            end_properties=end_properties,
        )
        if isinstance(stream, SnapshotStream) and stream.total_keys >= FREEZE_KEYS:
            # Its key list would be walked item by item by every full collection:
            # a process-wide step, so here and not in the stream (clone.server.heap).
            freeze_state()
        if isinstance(stream, DeltaStream):
            if since is not None and not since.history:
                # The peer always asks for the applied list too; a client never does.
                self._counters["catchups_served" if applied else "client_catchups_served"] += 1
            return stream, applied
        if shareable:
            estimate = store.nbytes + ENTRY_OVERHEAD * len(store)
            before = self.shares.started
            reader = self.shares.start(identity, key, stream, estimate)
            if reader is not None:
                # A new encoding, or (another requester started it meanwhile) a joined one.
                new = self.shares.started > before
                self._counters["snapshot_encodings_shared" if new else "snapshots_shared"] += 1
                return reader, applied
            self._counters["snapshot_shares_over_budget"] += 1
        return stream, applied
