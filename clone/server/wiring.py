"""How a server's parts are built and wired once its sockets are bound.

Why a module of its own: :mod:`.reactor` is the server's life cycle (bind,
run, stop), its timers' owner and its stats; this is its wiring, read on its
own: which part is built with which socket and which callbacks, so the
arrows of docs/architecture.md ("Parts": who calls whom) can be checked in
one place.  Construction only: nothing here runs after the server starts,
and no part keeps a reference to the server, only to the callbacks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from bstar.fsm import NO_RANK
from bstar.fsm import State as BStarState
from clone.server.admin import ConflictsDesk
from clone.server.calling import Caller
from clone.server.collecting import Applier, Collector, Judge, Sink
from clone.server.config import ServerMode
from clone.server.core import Role
from clone.server.diskgate import DiskGate, committed_through
from clone.server.following import Follower
from clone.server.handover import Handover
from clone.server.handovercore import PeerView
from clone.server.relaying import RelayLink
from clone.server.roles import RoleSwitch
from clone.server.serving import SnapshotPort
from clone.server.streaming import SnapshotStreams
from clone.server.timers import Timers
from clone.server.voting import HeldVotes

#: How a snapshot request is handed to the streams (SnapshotStreams.serve).
Serve = Callable[..., None]

if TYPE_CHECKING:
    from clone.server.reactor import CloneServer

__all__ = ["build_handover", "build_parts", "build_roles", "build_serving", "build_timers"]


def build_serving(server: CloneServer, router: zmq.Socket[Any]) -> None:
    """The snapshot port's parts on the bound ROUTER: its streams, its
    held votes and its reader (on the loop, with zero-copy frames: only
    a Frame can tell the requester's ZMTP metadata)."""
    loop = server._loop
    assert loop is not None
    secure = server.security.keypair is not None
    stopping = lambda: server._stopping  # noqa: E731
    streams = server.streams = SnapshotStreams(
        server.config,
        server.core,
        server.shared,
        server.access,
        router,
        loop,
        secure=secure,
        backlog=lambda: port.take_backlog(),
        promote=server._promote,
        peer_sync_opened=server.healer.peer_sync_served,
        peer_sync_done=server.healer.peer_sync_done,
        view_count=lambda vid: server.security.view_counts.get(vid, 0),
        durations=server.monitor.snapshot_seconds,
        stopping=stopping,
    )
    # A snapshot's end, and a catch-up, wait until what they show is on disk.
    gate = DiskGate(
        committed=lambda: committed_through(server.durability, server.core),
        store_sequence=lambda: server.core.store.sequence,
        when_published=server.durability.when_published,
        wake=streams.wake,
        alive=streams.__contains__,
        counters=server.shared.counters,
    )
    streams.held = gate.holds
    votes = server.votes = HeldVotes(
        server.config, server.shared, loop, ha=lambda: server._ha,
        serve=_serve_published(server, streams.serve),
        stopping=stopping,
    )  # fmt: skip
    port = server.snapshot_port = SnapshotPort(
        server.core,
        server.shared,
        server.access,
        router,
        loop,
        secure=secure,
        healer=server.healer,
        votes=votes,
        serve=_serve_published(server, streams.serve),
        on_call=server._on_call,
        on_conflicts=server._answer_conflicts,
        status=server.monitor.status,
        status_limiter=server._status_limiter,
        ha=lambda: server._ha,
    )
    port.set_guarded(server.sockets.guard(port.on_router))
    server.sockets.stream(router, port.on_router, copy=False)

def build_parts(
    server: CloneServer, router: zmq.Socket[Any], collector: zmq.Socket[Any]
) -> None:
    """The parts built on the bound sockets: a relay's link (started: it
    follows its first upstream), the caller and the collector."""
    cfg = server.config
    secure = server.security.keypair is not None
    refuse = server.security.refusal if secure else None
    port = server.snapshot_port
    assert port is not None
    link: RelayLink | None = None
    follower: Follower | None = None
    if cfg.mode is not ServerMode.STANDALONE:
        follower = server.follower = Follower(
            cfg,
            server.core,
            server.shared,
            server.sockets,
            followed=server._followed,
            term=lambda: _peer_term(server),
            # A relay republishes what it followed; a passive only commits it.
            after_turn=server.durability.commit_and_publish
            if cfg.mode is ServerMode.RELAY
            else server.durability.commit_only,
            next_turn=server._next_turn,
            fork_known=server.healer.fork_known,
            # Built before the role switch, which clears "behind the peer" first.
            synced=lambda: _synced(server),
            stepped_down=lambda: server.healer.stepped_down,
            resyncing=lambda: server.roles.on_resync() if server.roles is not None else None,
            heard_hugz=lambda: server._ha.announce() if server._ha is not None else None,
        )
    if follower is not None and cfg.mode is ServerMode.RELAY:
        link = server.relay = RelayLink(
            cfg,
            server.core,
            server.shared,
            server.access,
            server.sockets,
            router=router,
            router_backlog=port.take_backlog,
            upstream_keypair=server.security.upstream_keypair,
            follow=follower.follow,
            close_follow=follower.close,
            sync_progress=lambda: follower.sync_progress,
            reply=server._send_reply,
            publish=server.publisher.publish,
            refuse=refuse,
            views_replaced=server.security.views_replaced,
        )
        follower.upstream = link
        link.start()
    server.caller = Caller(
        server.core,
        server.shared,
        server.access,
        router,
        commit=lambda then: _commit_for_replies(server, then),
        router_backlog=port.take_backlog,
        next_turn=server._next_turn,
        trusted_relays=cfg.trusted_relays,
        forward=link.forward_call if link is not None else None,
        settled=lambda: server.durability.settled,
    )
    server.conflicts_desk = ConflictsDesk(
        server.core, server.shared, server.access, router, server._status_limiter
    )
    # One collector, composed: a relay forwards what a server applies,
    # and under CURVE each write is judged by its sender's rights first.
    sink: Sink
    if link is not None:
        assert link.forwarder is not None
        sink = link.forwarder
    else:
        sink = Applier(
            server.core, server.shared, end_turn=server.durability.commit_and_publish, refuse=refuse
        )
    judge: Judge | None = None
    if secure:
        # A relay tells every refused writer; a server only while active
        # (a passive one parks writes for the pending list, unjudged).
        security = server.security
        if link is not None:
            judge = lambda first, frames: security.judge(first, frames, notify=True)  # noqa: E731
        else:
            judge = lambda first, frames: security.judge(  # noqa: E731
                first, frames, notify=server.core.role is Role.ACTIVE
            )
    server.collector = part = Collector(
        collector,
        server.shared,
        sink,
        batch=cfg.collector_batch,
        judge=judge,
        turns=None if link is not None else server._turns,
    )
    if part.secure:
        server.sockets.stream(collector, part.on_frames, copy=False)
    else:
        server.sockets.stream(collector, part.on_message)

def build_roles(server: CloneServer, collector: zmq.Socket[Any]) -> RoleSwitch:
    """The role switch, last: it reaches every part a role change touches."""
    assert server.streams is not None and server.votes is not None
    return RoleSwitch(
        server.config,
        server.core,
        server.shared,
        ha=server._ha,
        collector=collector,
        follower=server.follower,
        durability=server.durability,
        healer=server.healer,
        monitor=server.monitor,
        publisher=server.publisher,
        streams=server.streams,
        votes=server.votes,
        heartbeat_ms=server._heartbeat_ms,
    )

def _synced(server: CloneServer) -> None:
    """A sync from the active completed: the role switch (built after the
    follower) clears "behind the peer", then the healer forwards split writes."""
    assert server.roles is not None
    server.roles.on_synced()


def _peer_term(server: CloneServer) -> int | None:
    """The followed server's term: Binary Star's peer epoch (None unpaired)."""
    return server._ha.peer_epoch if server._ha is not None else None

def _commit_for_replies(server: CloneServer, then: Callable[[], None]) -> None:
    """Commit and publish this turn; ``then`` once its changes may be confirmed
    (never while stopping, nor after a write error: fail-stop)."""
    if server._stopping:
        return
    server.durability.commit_and_publish()
    server.durability.when_published(then)


def _serve_published(server: CloneServer, serve: Serve) -> Serve:
    """A snapshot request is served once what was applied before it is
    published: a commit in flight (clone.server.committing) lands first, so
    no snapshot holds an update its writer was not confirmed."""

    def serve_when_published(identity: bytes, subtree: str, **how: Any) -> None:
        server.durability.when_published(lambda: serve(identity, subtree, **how))

    return serve_when_published


def build_timers(server: CloneServer) -> Timers:
    """The heartbeat, housekeeping and stats timers, last: they drive the parts
    (and the handover of a graceful stop, which waits on them).
    From here on commits run on the commit writer's thread (clone.server.committing)."""
    loop = server.loop
    assert loop is not None
    sockets = server.sockets
    server.durability.start_writer(loop.add_callback, pause=sockets.pause, resume=sockets.resume)
    server.handover = build_handover(server)
    assert server.streams is not None and server.votes is not None
    assert server.publisher_port is not None
    return Timers(
        server.config,
        server.core,
        server.shared,
        loop,
        heartbeat_ms=server._heartbeat_ms,
        publisher=server.publisher,
        publisher_port=server.publisher_port,
        security=server.security,
        durability=server.durability,
        healer=server.healer,
        streams=server.streams,
        votes=server.votes,
        follower=server.follower,
        relay=server.relay,
        log_stats=server.log_stats,
        stopping=lambda: server._stopping,
    )


def build_handover(server: CloneServer) -> Handover:
    """A graceful stop's handover to the passive (clone.server.handover)."""
    collector = server._collector

    def view() -> PeerView | None:
        ha = server._ha
        if ha is None or server.durability.error is not None:
            return None
        rank = ha.peer_rank
        return PeerView(
            active=server.core.role is Role.ACTIVE and ha.state is BStarState.ACTIVE,
            peer_alive=ha.peer_alive,
            peer_passive=ha.peer_state is BStarState.PASSIVE,
            peer_sequence=None if rank == NO_RANK else rank[1],
        )

    return Handover(
        server.config.handover_timeout,
        server.shared.clock,
        lambda: server.loop,
        view=view,
        sequence=lambda: server.core.store.sequence,
        hold_writes=lambda: server.sockets.stop_reading(collector) if collector else None,
        when_published=server.durability.when_published,
        # Built before the timers, whose HUGZ it sends (Timers.send_hugz).
        announce=lambda: server.timers.send_hugz() if server.timers is not None else None,
        finish=server._shutdown,
    )
