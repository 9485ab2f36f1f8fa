"""The role switch: Binary Star's callbacks promote or demote the server.

How this works: a promotion first takes in what already arrived (the old
active's KVPUBs unread in the follower's SUB, clients' KVSETs unread in the
collector), commits it under the old term, then lets the core apply the
pending list and publishes the result; a demotion aborts the snapshots being
served, drops the unsent output and starts following the active peer (the
:class:`~clone.server.following.Follower` part).

Why this is still a mixin: a role change touches nearly every duty at once
(the durability's commit and term, the healer's split writes, the snapshot
port's streams and held votes, the publisher), and those are mixins this
round; once they are parts this becomes the server's own method over them.
"""

from __future__ import annotations

from clone.server.base import ServerBase, log
from clone.server.core import Role
from clone.server.following import take_backlog

__all__ = ["RoleMixin"]


class RoleMixin(ServerBase):
    """Take a role (Binary Star's ``on_active`` / ``on_passive``)."""

    def _on_became_active(self) -> None:
        core = self.core
        if core.role is Role.ACTIVE:
            return
        was = core.role
        follower = self.follower
        taken = follower.take_backlog() if follower is not None else 0
        self._take_collector_backlog()
        # What the old active sent is written under its term, before ours starts.
        self._commit()
        pending = len(core.pending)
        assert self._ha is not None
        heard = self._ha.heard_peer
        core.term = self._ha.epoch
        core.become_active(self._wallclock(), self._clock())
        self._apply_split_writes_here()
        self._note_role(was.value, core.role.value)
        if was is Role.PASSIVE:
            self.counters["failovers"] += 1
            self._last_failover = self._wallclock()
            # Took over from a peer presumed dead: if it was active meanwhile
            # (a split brain), its first sync from us is its step-down, and its
            # clients' writes race its forwarded ones (clone.server.healing).
            self._await_peer_sync = True
        self._record_term()
        self._record_following(False)
        batch = self._commit()
        self._close_peer()
        self.publisher.publish_bulk(batch)
        if not heard:
            log.warning(
                "serving without having heard the peer since we started (%.1f s of"
                " --peer-wait): our state (term %d, sequence %d) may be older than the peer's",
                self.config.effective_peer_wait,
                self._data_term,
                core.store.sequence,
            )
        log.warning(
            "now ACTIVE (was %s): serving at sequence %d, %d keys; published %d of %d "
            "pending updates; took %d updates the old active had sent",
            was.value,
            core.store.sequence,
            len(core.store),
            len(batch),
            pending,
            taken,
        )
        # Tell subscribers at once that this server is alive and where it stands.
        self.publisher.publish(core.hugz(self._heartbeat_ms))
        if self._deferred:
            self._recheck_deferred_soon()  # not from here: we may be inside accept_vote()

    def _on_synced(self) -> None:
        """A sync from the active peer completed: we hold what it confirmed
        (up to replication lag, which the clients' pending lists cover), so a
        vote may make us active again; then the healer sends any split writes."""
        if self._ha is not None:
            self._ha.set_behind_peer(False)
        self._forward_split_writes()

    def _split_fork_known(self) -> None:
        """The follower learnt the winner's fork: the healer sends the split
        writes now, unless it has begun already."""
        if not self._split_queue and not self._split_scheduled:
            self._forward_split_writes()

    def _take_collector_backlog(self) -> None:
        """Before a promotion, park every client update already received.

        A client's copy of a write the old active confirmed may still sit
        unread in our collector queue (we were busy, say with a sync).  Read
        after the promotion it would be applied only after we had served
        snapshots without it: clients would see the key go back, then forward.
        Parked now, it is applied with the pending list, before any snapshot.
        """
        sock = self._collector
        if sock is None or self.core.role is Role.ACTIVE:
            return
        take_backlog(sock, self.core.on_kvset, self.shared, "kvset", "a client update")

    def _on_became_passive(self) -> None:
        core = self.core
        was = core.role
        core.become_passive()
        if was is not Role.PASSIVE:
            self._note_role(was.value, core.role.value)
        if was is Role.ACTIVE:
            self._stepped_down_at = self._wallclock()  # a split brain's loser
        if self._ha is not None:
            core.term = self._ha.peer_epoch
            if self._storage is not None:
                # Until the first sync from the active completes our data is
                # older than what it confirmed: no vote makes us active on it.
                self._ha.set_behind_peer(True)
        self._record_following(True)
        for stream in list(self._snapshots):
            self._abort_snapshot(stream, "server became passive")
        dropped = self.publisher.drop()
        if dropped:
            self.counters["outq_dropped"] += dropped
        log.warning(
            "now PASSIVE (was %s): following the active server at %s", was.value, self.config.peer
        )
        self._follow()
