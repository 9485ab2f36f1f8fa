"""After a split brain: send the active peer the writes we confirmed that it lacks.

How this works: :mod:`clone.server.split` decides, at the end of the resync
that follows a demotion, which of our writes the winner cannot hold; this part
sends them as ``set`` calls on a DEALER to the winner's snapshot port (the
port that answers calls), takes each REPLY, resends the unanswered ones every
second (a call is deduplicated by its uuid, so a resend is harmless) and gives
up after a minute without an answer, loudly: those writes are then lost unless
their clients resend them.  A ``not-active`` answer is kept for the next
resend.  If we are elected again before the last answer, we apply what is left
ourselves.

A split can leave 100,000 writes.  None of this handles them at once: the
writes become calls, are sent (at most :data:`~clone.server.pacing.SPLIT_IN_FLIGHT`
unanswered) or applied here in slices, one slice per loop turn
(:meth:`Healer._split_turn`, the one place that does it), each bounded
in count and in time (``TURN_BUDGET``); the next turn is scheduled with
``add_callback``, so heartbeats, signals and clients run in between.  What to
touch next is decided by :mod:`clone.server.pacing` (pure).

Everything here is counted (``split_writes_*``) and logged at WARNING: a split
brain is an incident an operator wants to read about.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.errors import ProtocolError
from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore, SyncState
from clone.server.pacing import (
    SPLIT_APPLY_SLICE,
    SPLIT_CONVERT_SLICE,
    SPLIT_CONVERT_STEP,
    SPLIT_GIVE_UP,
    SPLIT_IN_FLIGHT,
    SPLIT_SEND_STEP,
    SplitQueue,
    send_allowance,
)
from clone.server.requesters import from_options, replaced
from clone.server.sending import send_via_stream
from clone.server.shared import TURN_BUDGET, Shared, Sockets, peer_endpoint
from clone.wire.calls import Reply, decode_call, decode_reply
from clone.wire.control import encode_refusal
from clone.wire.protocol import SNAPSHOT_OFFSET

__all__ = ["ANY_WRITER", "HEAL_REQUESTS", "Healer", "Serve"]

log = logging.getLogger("clone.server.reactor")

#: Client snapshot requests a server healing a split brain holds at most.
HEAL_REQUESTS = 8

#: Serve a held snapshot request: the requester, its subtree, the options of
#: the snapshot port's ``serve``.
Serve = Callable[[bytes, str, dict[str, Any]], None]

#: Winning a split brain, client updates are held until the peer's sync has
#: streamed and no forwarded write came for HOLD_GRACE seconds (HOLD_FIRST_CALL
#: while none came yet: a peer with nothing to forward sends none), and never
#: longer than HOLD_MAX (a peer that never resyncs, or one too old to forward).
HOLD_GRACE = 1.0
HOLD_FIRST_CALL = 3.0
HOLD_MAX = 10.0

#: Losing a split brain, client updates parked after the step-down are kept
#: this many times the peer's presumed-dead time (``--missed`` heartbeats, the
#: silence after which our clients fail over too), at least until our sync
#: from the winner is done; then those the winner did not publish are dropped.
STEPPED_DOWN_QUIET = 2

#: The topic of notices for whichever client wrote the uuid (docs/protocol.md:
#: a loser cannot name the writer of a split write, so every client hears it
#: and acts only on a uuid of its own).
ANY_WRITER = "*"


class Healer:
    """Forward a demoted active's split-brain writes to the winner, in slices;
    as the winner, hold client updates (and client snapshots) while it heals.

    A part of the server: it owns the split writes' queue and DEALER, the
    hold's times and the snapshot requests it holds.  Built with the core,
    its sockets and the callbacks it needs: ``next_turn`` (the loop's
    ``add_callback``; False without a loop), ``followed`` (the winner's
    address), ``commit_and_publish`` (the durability part's), ``publish``
    (the publisher's), ``won_split`` (Binary Star is active: a split brain
    seen by us is one we win), ``serve`` (the snapshot port's, for the
    requests held) and ``stopping``.
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        sockets: Sockets,
        *,
        next_turn: Callable[[Callable[[], None]], bool],
        followed: Callable[[], str | None],
        commit_and_publish: Callable[[], None],
        publish: Callable[[list[bytes]], None],
        won_split: Callable[[], bool],
        serve: Serve,
        stopping: Callable[[], bool],
    ) -> None:
        self.config = config
        self.core = core
        self.counters = shared.counters
        self._throttle = shared.throttle
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._sockets = sockets
        self._next_turn = next_turn
        self._followed_of = followed
        self._commit_and_publish = commit_and_publish
        self._publish = publish
        self._won_split = won_split
        self._serve = serve
        self._stopping_of = stopping
        # Our writes the winner has not answered yet, paced
        # (clone.server.pacing), the DEALER they go on, and whether a slice of
        # them is already scheduled for the next turn.
        self._split_queue = SplitQueue()
        self._split_dealer: ZMQStream | None = None
        self._split_scheduled = False
        # Of this heal's writes, how many the winner kept as conflicts (logged once).
        self._split_conflicts_this_heal = 0
        # Winning a split brain: since when client updates are held (wall
        # clock), and when the peer's sync finished streaming.
        self._hold_started: float | None = None
        self._hold_sync_done: float | None = None
        # Binary Star showed us the split brain this hold is for.
        self._hold_split_seen = False
        # The peer's sync said it stepped down from active (a split brain's
        # loser, STEPPED_DOWN_PROPERTY): this hold is a heal's.
        self._peer_stepped_down = False
        # Client snapshot requests held while we heal one (identity, subtree,
        # the serve options), answered when the hold ends; the newest
        # HEAL_REQUESTS: a client asks again on a fresh socket every quarter
        # heartbeat, and only its last request can still be routed.
        self._heal_requests: deque[tuple[bytes, str, dict[str, Any]]] = deque(
            maxlen=HEAL_REQUESTS
        )
        # Losing one: when we stepped down (wall clock), until the client
        # updates parked since are dropped (_check_stepped_down).
        self._stepped_down_at: float | None = None
        # Took over by a failover, and the peer has not synced from us since.
        self._await_peer_sync = False

    @property
    def _followed(self) -> str | None:
        return self._followed_of()

    @property
    def _stopping(self) -> bool:
        return self._stopping_of()

    # -- what the server and the other parts tell it ---------------------------

    @property
    def queued(self) -> int:
        """Split writes converted to calls and not yet answered or applied."""
        return len(self._split_queue)

    @property
    def stepped_down(self) -> bool:
        """We stepped down from active (a split brain's loser) and still
        keep the client updates parked since."""
        return self._stepped_down_at is not None

    def demoted(self) -> None:
        """We were active and are passive now: a split brain's loser."""
        self._stepped_down_at = self._wallclock()

    def took_over(self) -> None:
        """A failover made us active: the peer's first sync from us may be
        a split brain's loser stepping down (its clients' writes race its
        forwarded ones)."""
        self._await_peer_sync = True

    def peer_sync_started(self, *, stepped_down: bool) -> None:
        """The peer asked us for a sync; ``stepped_down``: it says it lost a
        split brain (the heal defers client snapshots)."""
        if stepped_down:
            self._peer_stepped_down = True

    def peer_sync_served(self, caught_up_from: int | None = None) -> None:
        """The peer's sync stream is open: if it is its first since we took
        over, hold client updates until what it forwards is in.  Not for a
        catch-up from at or before our takeover (``caught_up_from``): the peer
        holds a prefix of our state, as the old active does after a handover
        (:mod:`.handover`); the hold only delayed clients 3-5 s per failback
        (docs/failover.md, "Stopping the active")."""
        core, fork = self.core, self.core.promoted_at
        if not self._await_peer_sync or core.role is not Role.ACTIVE:
            return
        self._await_peer_sync = False
        if caught_up_from is not None and fork is not None and caught_up_from <= fork:
            log.info("the peer's first sync since we took over catches up from %d, at or"
                     " before our takeover at %d: nothing to hold", caught_up_from, fork)
            return
        self._start_hold("the peer's first sync since we took over")

    def hold_request(self, identity: bytes, subtree: str, options: dict[str, Any]) -> None:
        """Hold a client's snapshot request until the heal's hold ends; it
        replaces those its requester made on an older socket (one per
        subtree may come on this one: clone.server.requesters)."""
        asker = from_options(identity, options, subtree)
        moot = set(replaced([(n, from_options(i, o, t)) for n, (i, t, o)
                             in enumerate(self._heal_requests) if i != identity], asker))
        if moot:
            kept = [r for n, r in enumerate(self._heal_requests) if n not in moot]
            self._heal_requests.clear()
            self._heal_requests.extend(kept)
        self._heal_requests.append((identity, subtree, options))

    def check(self) -> None:
        """Housekeeping: resends and give-up, the hold's end, the parked
        updates of a step-down."""
        self._check_split_writes()
        self._check_hold()
        self._check_stepped_down()

    def close(self) -> None:
        """The server stops: the DEALER closed at once."""
        self._close_split()

    # -- the loser's side: its split writes, to the winner ----------------------

    def fork_known(self) -> None:
        """The follower learnt the winner's fork: send the split writes now,
        unless it has begun already."""
        if not self._split_queue and not self._split_scheduled:
            self.forward()

    def forward(self) -> None:
        """Synced after a demotion: start sending what the core kept."""
        core = self.core
        if core.split_unverified:
            log.warning(
                "stepped down after a split brain, but the active at %s did not say"
                " where it was elected (a peer without KVAPPLIED fork=): %d updates of"
                " our term may be missing there and were not resent",
                self._followed,
                core.split_unverified,
            )
            core.split_unverified = 0
        left = core.split_left
        if not left and not self._split_queue:
            return
        if self._split_queue or self._split_scheduled:
            # Already on its way (sent as soon as the fork came), or a resync
            # while still sending (a gap in what we follow): more kept writes
            # join the queue; the first said it already.
            self._schedule_split_turn()
            return
        log.warning(
            "stepped down after a split brain: sending the active at %s the writes"
            " we confirmed that it does not hold (up to %d, %d at a time)",
            self._followed,
            left + len(self._split_queue),
            SPLIT_IN_FLIGHT,
        )
        self._schedule_split_turn()

    def apply_here(self) -> None:
        """Elected again before the winner answered them all: ours to apply,
        a slice per turn from the next one on."""
        self._close_split_soon()
        if self._split_queue or self.core.split_left:
            log.warning(
                "elected again with %d writes of the split brain unanswered: applying them here",
                len(self._split_queue) + self.core.split_left,
            )
            self._schedule_split_turn()

    def _schedule_split_turn(self) -> None:
        if self._split_scheduled or self._stopping:
            return
        self._split_scheduled = self._next_turn(self._split_turn_guarded)

    def _split_turn_guarded(self) -> None:
        self._split_scheduled = False
        try:
            self._split_turn()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error while healing a split brain")

    def _split_turn(self) -> None:
        """One loop turn's slice: convert some kept writes to calls, then send
        them (passive) or apply them (active); schedule the next turn if more
        is ready to go."""
        if self._stopping:
            return
        core, queue = self.core, self._split_queue
        # Steps of conversion until the queue has enough or the turn's time is
        # up (a fixed count is not a bound on a machine short of CPU).
        stop_at = self._clock() + TURN_BUDGET
        while core.split_left and queue.unsent < SPLIT_CONVERT_SLICE:
            queue.add(core.take_split_calls(SPLIT_CONVERT_STEP), self._clock())
            if self._clock() > stop_at:
                break
        if core.role is Role.ACTIVE:
            more = self._apply_split_slice()
        elif core.role is Role.PASSIVE:
            more = self._send_split_slice()
        else:
            return
        if more:
            self._schedule_split_turn()
        elif not queue and not core.split_left:
            self._close_split_soon()

    def _send_split_slice(self) -> bool:
        """Send what the queue allows now; whether to come back next turn
        (more kept writes to convert while the queue has room)."""
        followed = self._followed
        core = self.core
        if followed is None or core.sync_state is not SyncState.SYNCED:
            return False  # the sync's completion starts a turn again
        queue = self._split_queue
        if not queue:
            return bool(core.split_left)
        if self._split_dealer is None:
            dealer = self._sockets.socket(zmq.DEALER)
            dealer.connect(peer_endpoint(followed, SNAPSHOT_OFFSET))
            self._split_dealer = self._sockets.stream(dealer, self._on_split_reply)
            queue.restart(self._clock())
        resent = queue.resent
        allowed = send_allowance(queue.answered_up_to, core.store.sequence)
        # Through the stream, not the raw socket: the stream looks at the
        # socket's events after it sends, so a REPLY that arrives during a
        # send is still read (a raw send can consume the edge announcing it,
        # and an unread message stops libzmq signalling the ones after it).
        # A send through the stream is not free (seen: 256 of them took 0.3 s
        # on a starved machine): steps, until the turn's time is up.
        stream = self._split_dealer
        stop_at = self._clock() + TURN_BUDGET
        out_of_time = False
        while allowed > 0 and not out_of_time:
            sends = queue.sends(self._clock(), min(SPLIT_SEND_STEP, allowed))
            if not sends:
                break
            for frames in sends:
                send_via_stream(stream, frames)
            allowed -= len(sends)
            out_of_time = self._clock() > stop_at
        self.counters["split_writes_resent"] += queue.resent - resent
        if out_of_time and allowed > 0:
            return True  # more may go now: the next turn sends them
        return bool(core.split_left) and queue.unsent < SPLIT_CONVERT_SLICE

    def _apply_split_slice(self) -> bool:
        """Apply queued calls here until the turn's time budget; commit and
        publish them; whether more are left."""
        queue, core = self._split_queue, self.core
        stop_at = self._clock() + TURN_BUDGET
        now = self._wallclock()
        while self._clock() <= stop_at:
            calls = queue.take(SPLIT_APPLY_SLICE)
            if not calls:
                break
            for frames in calls:
                reply = core.apply_own_split_call(frames, now, self._clock())
                if reply is not None:
                    self._tally_split_write(reply, frames)
        self._commit_and_publish()
        return bool(queue) or bool(core.split_left)

    def _check_split_writes(self) -> None:
        """Housekeeping: resend what is unanswered (a turn does it), or give
        it up after a minute without an answer."""
        queue = self._split_queue
        if not queue or self.core.role is not Role.PASSIVE or self._split_dealer is None:
            return  # nothing sent, or applied here (turns schedule themselves)
        if not queue.stalled(self._clock()):
            self._schedule_split_turn()
            return
        left = queue.clear()
        dropped = self.core.drop_split_calls()
        keys = [decode_call(f).key for f in left[:5]]
        self.counters["split_writes_abandoned"] += len(left) + dropped
        log.error(
            "gave up sending %d writes of the split brain to the active at %s after"
            " %.0f s without an answer: they are lost unless their clients write them"
            " again (first keys: %s)",
            len(left) + dropped,
            self._followed,
            SPLIT_GIVE_UP,
            ", ".join(keys),
        )
        self._close_split_soon()

    def _on_split_reply(self, frames: list[bytes]) -> None:
        try:
            reply = decode_reply(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "split_reply", logging.WARNING, "dropped a reply from the active peer: %s", exc
            )
            return
        if not reply.ok and reply.reason == "not-active":
            return  # to be resent
        sent = self._split_queue.answered(reply.uuid, self._clock(), reply.sequence)
        if sent is None:
            return  # answered already
        self._tally_split_write(reply, sent)
        # A slot is free: the next turn sends more (one turn for many replies).
        self._schedule_split_turn()

    def _tally_split_write(self, reply: Reply, frames: Sequence[bytes]) -> None:
        if reply.ok:
            self.counters["split_writes_applied"] += 1
            return
        if reply.status == "conflict" and reply.reason == "split":
            # Kept by the active as a conflict (clone.server.splitrule): its
            # writer was told it was applied, so tell it now (best effort; the
            # heal's count is logged once, when it ends).
            self.counters["split_writes_conflicts"] += 1
            self._split_conflicts_this_heal += 1
            self._publish(encode_refusal(ANY_WRITER, reply.uuid, "conflict"))
            return
        self.counters["split_writes_refused"] += 1
        self._throttle.log(
            "split_refused",
            logging.WARNING,
            "the active refused a write of ours from the split brain (%s: %s): key %r",
            reply.reason,
            reply.detail,
            decode_call(frames).key[:80],
        )

    # -- the winner's side: hold client updates until the loser's are in -------

    def on_split_brain(self) -> None:
        """Binary Star saw the peer active too.  If we keep serving, the peer
        steps down, resyncs and forwards its writes; until then its clients'
        updates may still reach us directly, late, and must not go ahead of
        those (core.hold_writes)."""
        if self.core.role is not Role.ACTIVE or not self._won_split():
            return  # we are the one stepping down
        self._start_hold("won a split brain")
        self._hold_split_seen = True

    def _start_hold(self, why: str) -> None:
        """Hold client updates until the peer's sync has streamed and what it
        forwards is in.  Also at the peer's first sync after we took over: the
        peer that lost a split brain often hears us first and steps down before
        Binary Star shows us the split brain at all, and its clients' direct
        writes then arrive with its sync request (a restarted peer costs one
        held sync, once per takeover)."""
        if self.core.holding:
            return
        self.core.hold_writes()
        self._hold_started = self._wallclock()
        self._hold_sync_done = None
        log.warning(
            "%s: holding client updates until the peer has synced and forwarded what"
            " it wrote meanwhile (at most %.0f s)",
            why,
            HOLD_MAX,
        )

    def peer_sync_done(self) -> None:
        """The peer's sync has streamed."""
        if self._hold_started is not None:
            self._hold_sync_done = self._wallclock()

    def _check_hold(self) -> None:
        """Housekeeping: end the hold once the peer's sync has streamed and no
        forwarded write came for HOLD_GRACE, or after HOLD_MAX in any case."""
        started = self._hold_started
        if started is None:
            return
        core = self.core
        now = self._wallclock()
        done = self._hold_sync_done
        # The peer's forwarded writes may queue behind its own snapshot on our
        # snapshot port: until one came, wait longer for them.
        came = core.split_call_at >= started
        grace = HOLD_GRACE if came else HOLD_FIRST_CALL
        quiet = done is not None and now >= max(done, core.split_call_at) + grace
        if not (quiet or now >= started + HOLD_MAX or not core.holding):
            return
        self._hold_started = self._hold_sync_done = None
        self._hold_split_seen = self._peer_stepped_down = False
        held = len(core.pending)
        core.release_held(now)
        self._commit_and_publish()
        self._answer_heal_requests()
        log.info(
            "released %d client updates held through the split brain's heal after %.2f s",
            held,
            now - started,
        )

    def defers_clients(self) -> bool:
        """Whether a client's snapshot request waits for the hold to end: we
        hold because a split brain heals.  Binary Star showed it to us; or
        the peer's sync said it stepped down from active in this run (it lost
        the split brain, often before we saw both active:
        ``STEPPED_DOWN_PROPERTY``); or its forwarded writes have begun to
        come (they only start once its sync from us is done).  A hold at the
        peer's first sync alone is a restarted peer's, with nothing of this
        run to forward: its clients are not held (once the epoch it announced
        decided it, and a restarted peer announces the epoch it saved: every
        client of the pair waited out the hold after a failover and a
        restart).  A snapshot taken while a loser's writes are still to come
        lacks them; the island client that confirmed them on the loser,
        failing over to us, would see them vanish from its view and come back
        as they are applied.  The peer's own sync is never held."""
        started = self._hold_started
        core = self.core
        if started is None or not core.holding:
            return False
        return (
            self._hold_split_seen or self._peer_stepped_down or core.split_call_at >= started
        )

    def _answer_heal_requests(self) -> None:
        """The hold is over: serve the client snapshot requests it held
        (still active: a server that stepped down meanwhile drops them, and
        their clients ask elsewhere)."""
        requests = list(self._heal_requests)
        self._heal_requests.clear()
        if self.core.role is not Role.ACTIVE:
            return
        for identity, subtree, options in requests:
            self._serve(identity, subtree, options)

    # -- the loser's side: updates that reached us after we stepped down ------

    def _check_stepped_down(self) -> None:
        """Housekeeping: once our clients have had time to leave us after a
        split brain's step-down (STEPPED_DOWN_QUIET times the peer's
        presumed-dead time) and our sync from the winner is done, drop the
        client updates parked since that the winner has not published
        (core.drop_pending_since).  Elected again before that, we apply them
        at the promotion as any passive does."""
        at = self._stepped_down_at
        if at is None:
            return
        core = self.core
        if core.role is not Role.PASSIVE:
            self._stepped_down_at = None
            return
        cfg = self.config
        quiet = STEPPED_DOWN_QUIET * cfg.ha_missed * cfg.heartbeat
        if self._wallclock() < at + quiet or core.sync_state is not SyncState.SYNCED:
            return
        self._stepped_down_at = None
        gone = core.drop_pending_since(at)
        if gone:
            log.warning(
                "dropped %d client updates that reached us after we stepped down and that"
                " the active at %s never applied: their writers still followed us (a"
                " confirmed one is resent to the active by its client)",
                gone,
                self._followed,
            )

    def _close_split_soon(self) -> None:
        """Done with the DEALER: no more sends on it now, and closed from a
        callback of its own, after the stream's pending event callbacks (one
        per send) have run on an open socket."""
        self._log_heal_conflicts()
        dealer, self._split_dealer = self._split_dealer, None
        if dealer is None:
            return
        forget = self._sockets.forget
        if not self._next_turn(lambda: forget(dealer)):
            forget(dealer)

    def _log_heal_conflicts(self) -> None:
        """Once per heal: how many of our writes the active kept as conflicts."""
        if self._split_conflicts_this_heal:
            log.warning(
                "%d of our split-brain writes were kept as conflicts, not applied (the"
                " active had changed their keys since it was elected); their writers"
                " were told, and `clone conflicts` on the active lists them",
                self._split_conflicts_this_heal,
            )
            self._split_conflicts_this_heal = 0

    def _close_split(self) -> None:
        self._log_heal_conflicts()
        dealer, self._split_dealer = self._split_dealer, None
        if dealer is not None:
            self._sockets.forget(dealer)
