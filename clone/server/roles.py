"""The role switch: Binary Star's callbacks promote or demote the server.

How this works: a promotion first takes in what already arrived (the old
active's KVPUBs unread in the follower's SUB, clients' KVSETs unread in the
collector), commits it under the old term, then lets the core apply the
pending list and publishes the result; a demotion aborts the snapshots being
served, drops the unsent output and starts following the active peer (the
:class:`~clone.server.following.Follower` part).

A role change touches nearly every duty at once (the durability's commit and
term, the healer's split writes, the snapshot streams and held votes, the
publisher, the follower, the monitor's history), so :class:`RoleSwitch` is the
one part built with all of them, last, and it talks to each only through its
public methods.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import zmq

from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore
from clone.server.durability import Durability
from clone.server.following import Follower, take_backlog
from clone.server.healing import Healer
from clone.server.monitoring import Monitor
from clone.server.publishing import Publisher
from clone.server.shared import Shared
from clone.server.streaming import SnapshotStreams
from clone.server.voting import HeldVotes

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar

__all__ = ["RoleSwitch"]

log = logging.getLogger("clone.server.reactor")


class RoleSwitch:
    """Take a role (Binary Star's ``on_active`` / ``on_passive``).

    A part of the server, built once the others are: ``ha`` (Binary Star,
    whose epochs are the terms; None unpaired), ``collector`` (the SUB whose
    unread client updates a promotion parks first), the follower (None for
    a standalone server), and the parts a role change reaches.
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        *,
        ha: BinaryStar | None,
        collector: zmq.Socket[Any],
        follower: Follower | None,
        durability: Durability,
        healer: Healer,
        monitor: Monitor,
        publisher: Publisher,
        streams: SnapshotStreams,
        votes: HeldVotes,
        heartbeat_ms: int,
    ) -> None:
        self.config = config
        self.core = core
        self.shared = shared
        self.counters = shared.counters
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._ha = ha
        self._collector = collector
        self.follower = follower
        self.durability = durability
        self.healer = healer
        self.monitor = monitor
        self.publisher = publisher
        self.streams = streams
        self.votes = votes
        self._heartbeat_ms = heartbeat_ms

    def on_active(self) -> None:
        """Binary Star made us active (or a vote we won did, first)."""
        core = self.core
        if core.role is Role.ACTIVE:
            return
        was = core.role
        follower = self.follower
        taken = follower.take_backlog() if follower is not None else 0
        self._take_collector_backlog()
        # What the old active sent is written under its term, before ours starts.
        self.durability.commit()
        pending = len(core.pending)
        assert self._ha is not None
        heard = self._ha.heard_peer
        core.term = self._ha.epoch
        core.become_active(self._wallclock(), self._clock())
        self.healer.apply_here()
        self.monitor.note_role(was.value, core.role.value)
        if was is Role.PASSIVE:
            self.monitor.note_failover()
            # Took over from a peer presumed dead: if it was active meanwhile
            # (a split brain), its first sync from us is its step-down, and its
            # clients' writes race its forwarded ones (clone.server.healing).
            self.healer.took_over()
        self.durability.record_term()
        self.durability.record_following(False)
        batch = self.durability.commit()
        # The writes above block the loop (each waits for the disk): on a
        # slow one, seconds past the rebuild's clock.  Leases count from now,
        # when their holders can first reach us (a loaded CI run lost a
        # 1.5 s lease to a 4.5 s promotion).
        core.calls.leases_usable_from(self._clock())
        if follower is not None:
            follower.close()  # the peer's SUB and sync DEALER
        self.publisher.publish_bulk(batch)
        if not heard:
            log.warning(
                "serving without having heard the peer since we started (%.1f s of"
                " --peer-wait): our state (term %d, sequence %d) may be older than the peer's",
                self.config.effective_peer_wait,
                self.durability.data_term,
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
        self.votes.recheck_soon_if_held()  # not from here: we may be inside accept_vote()

    def on_resync(self) -> None:
        """A gap in what we follow: we lack updates the active confirmed (its
        calls reach only the active, so no client's pending copy covers them),
        so, durable, no vote makes us active until the resync completes; if the
        active is gone meanwhile, the ranks decide when it comes back.  A chaos
        run (seed 1) had a backup resyncing after a gap (it held 231, the
        primary 233) take a vote 0.1 s after the primary stopped at 239: two
        confirmed compare-and-sets were later kept as split-brain conflicts."""
        if self._ha is not None and self.durability.storage is not None and (
                self.core.role is Role.PASSIVE):
            self._ha.set_behind_peer(True)

    def on_synced(self) -> None:
        """A sync from the active peer completed: we hold what it confirmed
        (up to replication lag, which the clients' pending lists cover), so a
        vote may make us active again; then the healer sends any split writes."""
        if self._ha is not None:
            self._ha.set_behind_peer(False)
        self.healer.forward()

    def _take_collector_backlog(self) -> None:
        """Before a promotion, park every client update already received.

        A client's copy of a write the old active confirmed may still sit
        unread in our collector queue (we were busy, say with a sync).  Read
        after the promotion it would be applied only after we had served
        snapshots without it: clients would see the key go back, then forward.
        Parked now, it is applied with the pending list, before any snapshot.
        """
        sock = self._collector
        if sock.closed or self.core.role is Role.ACTIVE:
            return
        take_backlog(sock, self.core.on_kvset, self.shared, "kvset", "a client update")

    def on_passive(self) -> None:
        """Binary Star made us passive: follow the active peer."""
        core = self.core
        was = core.role
        if was is Role.ACTIVE:
            # What we applied as active and gathered behind the commit in
            # flight (clone.server.gathering) is committed and published as
            # active, as it would have been when that commit landed.
            for frames in self.durability.commit():
                self.publisher.publish(frames)
        durable = self.durability.storage is not None
        core.become_passive(wrote_last=durable and not self.durability.data_following)
        if was is not Role.PASSIVE:
            self.monitor.note_role(was.value, core.role.value)
        if was is Role.ACTIVE:
            self.healer.demoted()  # a split brain's loser
        if self._ha is not None:
            core.term = self._ha.peer_epoch
            if self.durability.storage is not None:
                # Until the first sync from the active completes our data is
                # older than what it confirmed: no vote makes us active on it.
                self._ha.set_behind_peer(True)
        self.durability.record_following(True)
        self.streams.abort_all("server became passive")
        dropped = self.publisher.drop()
        if dropped:
            self.counters["outq_dropped"] += dropped
        log.warning(
            "now PASSIVE (was %s): following the active server at %s", was.value, self.config.peer
        )
        if self.follower is not None:
            self.follower.follow()
