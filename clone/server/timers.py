"""The server's timers: the heartbeat, housekeeping and the stats line.

How this works: three timers on the server's loop, each scheduled on the
server's one clock (``call_later`` with a delay computed from it, so a fake
clock moves every deadline).  The heartbeat runs at a fixed rate, skipping
ahead after a stall rather than bursting, and measures how late the loop ran
it (``heartbeat_max_late_ms``, a warning past a whole heartbeat), and how much
of that the loop's thread spent waiting for a CPU (Linux's schedstat
``run_delay``, ``ThreadCounters.cpu_wait``): on a host with more runnable processes than
cores a heartbeat is late however short the loop's steps are, so the lateness
less that wait (``heartbeat_max_blocked_ms``) is the loop's own.  The warning
also splits the time since the previous heartbeat into what the loop thread
ran, waited for a CPU and spent off CPU (:mod:`.lateness`): while
active it publishes the turn's pending commit and then HUGZ (each restricted
view's too); a relay publishes its link's HUGZ.  Housekeeping, every 100 ms
(at once again while more keys are due than one batch), expires keys and
leases, commits and publishes, and asks each part whether something is due:
the follower's sync timeout, a relay's upstream, stalled snapshots, the
healer, the held votes.

:class:`Timers` is a part built last, with the parts it drives; nothing calls
it but the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tornado.ioloop import IOLoop

from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore
from clone.server.durability import Durability
from clone.server.following import Follower
from clone.server.healing import Healer
from clone.server.lateness import LoopSample, ThreadCounters, split_interval
from clone.server.publisherport import PublisherPort
from clone.server.publishing import Publisher
from clone.server.relaying import RelayLink
from clone.server.security import Security
from clone.server.shared import Shared
from clone.server.streaming import SnapshotStreams
from clone.server.voting import HeldVotes
from clone.wire.codec import encode_hugz

__all__ = ["HOUSEKEEPING", "Timers", "own_lateness"]

log = logging.getLogger("clone.server.reactor")

HOUSEKEEPING = 0.1  # seconds between expiry / sync-timeout / deferred-vote checks


def own_lateness(late_ms: int, armed: float | None, now: float | None) -> tuple[int, int]:
    """``(waited_ms, blocked_ms)``: of a heartbeat ``late_ms`` late, the ms its
    thread waited for a CPU since the timer was armed (``ThreadCounters.cpu_wait`` then and
    now; 0 when unknown), and the rest, the loop's own."""
    waited_ms = 0 if armed is None or now is None else max(0, int((now - armed) * 1000))
    return waited_ms, max(0, late_ms - waited_ms)


class Timers:
    """The heartbeat, housekeeping and stats timers of one server."""

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        loop: IOLoop,
        *,
        heartbeat_ms: int,
        publisher: Publisher,
        publisher_port: PublisherPort,
        security: Security,
        durability: Durability,
        healer: Healer,
        streams: SnapshotStreams,
        votes: HeldVotes,
        follower: Follower | None,
        relay: RelayLink | None,
        log_stats: Callable[[int], None],
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config
        self.core = core
        self.counters = shared.counters
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._loop: IOLoop | None = loop  # None once stopped
        self._heartbeat_ms = heartbeat_ms
        self.publisher = publisher
        self.publisher_port = publisher_port
        self.security = security
        self.durability = durability
        self.healer = healer
        self.streams = streams
        self.votes = votes
        self.follower = follower
        self.relay = relay
        self.log_stats = log_stats
        self._stopping_of = stopping
        self._hugz_timer: object | None = None
        self._house_timer: object | None = None
        self._stats_timer: object | None = None
        self._next_hugz = 0.0
        # The kernel's per-thread counters, through descriptors kept open.
        self._counters = ThreadCounters()
        self._armed_wait: float | None = None  # the CPU-queue wait as the heartbeat was armed
        self._loop_sample: LoopSample | None = None  # at the end of the last heartbeat

    @property
    def _stopping(self) -> bool:
        return self._stopping_of()

    def start(self) -> None:
        """The first heartbeat in one heartbeat, housekeeping and the stats soon."""
        loop = self._loop
        assert loop is not None
        cfg = self.config
        self._next_hugz = self._clock() + cfg.heartbeat
        self._hugz_timer = loop.call_later(cfg.heartbeat, self._on_heartbeat)
        self._sample_as_armed()
        self._house_timer = loop.call_later(HOUSEKEEPING, self._on_housekeeping)
        if cfg.stats_interval > 0:
            self._stats_timer = loop.call_later(cfg.stats_interval, self._on_stats_timer)

    def stop(self) -> None:
        """Remove every timer; none runs again."""
        loop, self._loop = self._loop, None
        if loop is not None:
            timers = (self._hugz_timer, self._house_timer, self._stats_timer)
            for timer in timers:
                if timer is not None:
                    loop.remove_timeout(timer)
        self._hugz_timer = self._house_timer = self._stats_timer = None
        self._counters.close()

    def _on_heartbeat(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        # How late the reactor ran this timer: the operator's measure of a
        # blocked loop (and what clients would see as a heartbeat gap).
        late_ms = int((self._clock() - self._next_hugz) * 1000)
        self._note_lateness(late_ms)
        try:
            if self.core.role is Role.ACTIVE:
                self.send_hugz()
            elif self.relay is not None:
                relay = self.relay
                hugz = relay.hugz(self._heartbeat_ms, self.durability.announced_sequence())
                self._publish_hugz(hugz, stale=relay.stale())
            # Subscriptions our sends may have hidden from the XPUB's reader.
            self.publisher_port.take_subscriptions()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in heartbeat")
        # Fixed rate; after a stall skip ahead rather than burst.
        self._next_hugz += self.config.heartbeat
        now = self._clock()
        if self._next_hugz <= now:
            self._next_hugz = now + self.config.heartbeat
        self._hugz_timer = loop.call_later(self._next_hugz - now, self._on_heartbeat)
        self._sample_as_armed()

    def _sample_as_armed(self) -> None:
        """The loop thread's counters as the heartbeat is armed, read once for
        both their uses: the next late warning's split starts from them, and
        the next lateness's CPU-queue wait is counted from their ``waited``."""
        sample = self._counters.sample(self._clock())
        self._loop_sample = sample
        self._armed_wait = None if sample is None else sample.waited

    def send_hugz(self) -> None:
        """An active server's HUGZ, now: each heartbeat's, and the handover's
        at a stop (clone.server.handover).

        A call's update is applied in the ROUTER's handler but committed and
        published by a callback after it (clone.server.calling); a HUGZ sent
        between the two would announce a sequence nobody was sent, and every
        client and the passive would resync.  So that is published first, and
        the HUGZ carries the sequence published so far: while a commit is in
        flight (clone.server.committing) its updates are applied, not sent."""
        if self.core.journal:
            self.durability.commit_and_publish()
        sequence = self.durability.announced_sequence()
        self._publish_hugz(encode_hugz(sequence, self._heartbeat_ms), stale=False)

    def _note_lateness(self, late_ms: int) -> None:
        """Count a heartbeat's lateness and, less the loop's wait for a CPU
        since it was armed, the loop's own.  Warn of every heartbeat the loop
        itself held back by more than an interval (one per stall: the timer
        skips ahead), and of a lateness past an interval that the host caused
        when it is the worst yet (a starved host would say so 4 times a second)."""
        waited_ms, blocked_ms = own_lateness(late_ms, self._armed_wait, self._counters.cpu_wait())
        worst = late_ms > self.counters["heartbeat_max_late_ms"]
        if worst:
            self.counters["heartbeat_max_late_ms"] = late_ms
        self.counters["heartbeat_max_blocked_ms"] = max(
            blocked_ms, self.counters["heartbeat_max_blocked_ms"]
        )
        interval_ms = 1000 * self.config.heartbeat
        blocked = blocked_ms > interval_ms
        if blocked or (worst and late_ms > interval_ms):
            why = "the reactor was blocked" if blocked else "the host kept the server from running"
            self._warn_late(late_ms, waited_ms, why, worst=worst)

    def _warn_late(self, late_ms: int, waited_ms: int, why: str, *, worst: bool) -> None:
        """Log a late heartbeat, with what the loop thread did since the
        previous one: a stall it spent running is ours, one it spent waiting
        for a CPU is the machine's (clone.server.lateness); the worst's split
        is kept in ``heartbeat_max_late_ran_ms`` / ``_waited_ms``."""
        before, now = self._loop_sample, self._counters.sample(self._clock())
        detail = ""
        if before is not None and now is not None:
            split = split_interval(before, now)
            if worst:
                self.counters["heartbeat_max_late_ran_ms"] = split.ran_ms
                self.counters["heartbeat_max_late_waited_ms"] = split.waited_ms
            detail = f" ({split.describe()})"
        log.warning("heartbeat ran %d ms late, %d ms of it waiting for a CPU: %s%s",
                    late_ms, waited_ms, why, detail)

    def _publish_hugz(self, hugz: list[bytes], *, stale: bool) -> None:
        """Our HUGZ, then each restricted view's (a relay's say ``stale`` too)."""
        self.publisher.publish(hugz)
        self.counters["hugz_sent"] += 1
        security = self.security
        if security.view_counts:
            sequence = self.durability.announced_sequence()
            for frames in security.view_heartbeats(sequence, self._heartbeat_ms, stale=stale):
                self.publisher.publish(frames)

    def _on_housekeeping(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        delay = HOUSEKEEPING
        try:
            # Keys and leases expire on the monotonic clock: a wall step ends nothing.
            mono = self._clock()
            self.core.tick(self._wallclock(), mono)
            self.durability.commit_and_publish()
            if self.core.expiry_due(mono):
                delay = 0.0  # more due than one batch: continue next turn
            if self.follower is not None:
                self.follower.check_timeout()
            if self.relay is not None:
                self.relay.check()
            self.streams.check_stalled()
            self.healer.check()
            self.votes.recheck_if_held()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in housekeeping")
        self._house_timer = loop.call_later(delay, self._on_housekeeping)

    def _on_stats_timer(self) -> None:
        if self._loop is None or self._stopping:
            return
        if log.isEnabledFor(logging.DEBUG):
            self.log_stats(logging.DEBUG)
        self._stats_timer = self._loop.call_later(self.config.stats_interval, self._on_stats_timer)
