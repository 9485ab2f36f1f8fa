"""The CHP server's life cycle, sockets and timers: thin I/O around :mod:`clone.server.core`.

How this works: one tornado IOLoop (owned, never the global one) drives

* the SNAPSHOT ROUTER (P): requests, Binary Star votes (some held for later)
  and snapshot streams, in :mod:`.serving`;
* the PUBLISHER PUB (P+1): KVPUBs, bulk output in order, in :mod:`.publishing`,
  and HUGZ every heartbeat while active, from the timer here;
* the COLLECTOR SUB (P+2): KVSETs, drained in batches per readiness event, by
  the :class:`~.collecting.Collector` part;
* when passive: a SUB on the peer's publisher and a DEALER on its snapshot port
  (a fresh one per attempt, with a timeout), to follow the active server, by
  the :class:`~.following.Follower` part (promotion and demotion: :mod:`.roles`);
* :class:`bstar.reactor.BinaryStar` on the HA ports, which decides the role.

This module holds the life cycle (bind, run, stop), the timers and the stats,
and builds the parts the server owns, each with only what it needs and
talking to the others only through the callbacks it was built with
(docs/architecture.md, "Parts"): those that need no socket at once (the
durability, the monitor, the healer, the security), the others once their
sockets are bound (the snapshot port's reader, streams and held votes, the
publisher's port, the caller, the collector, the follower, a relay's link,
the conflicts desk, and last the role switch that Binary Star calls).

Every handler is wrapped: bad input is counted and logged (rate-limited) and
an unexpected exception is logged with its traceback; nothing stops the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from tornado.ioloop import IOLoop

from bstar.fsm import State as BStarState
from clone.errors import ServerStartError
from clone.ratelimit import Throttle
from clone.release import RELEASE
from clone.server.access import Access
from clone.server.admin import ConflictsDesk
from clone.server.budget import collector_hwm
from clone.server.calling import Caller
from clone.server.collecting import Collector
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import Role, ServerCore
from clone.server.durability import STOP_WAIT, Durability
from clone.server.following import Follower
from clone.server.handover import Handover
from clone.server.healing import Healer
from clone.server.monitoring import Monitor
from clone.server.penalty import FloodPenalty
from clone.server.publisherport import PublisherPort
from clone.server.publishing import Publisher
from clone.server.relaying import RelayLink
from clone.server.roles import RoleSwitch
from clone.server.security import Security
from clone.server.serving import SnapshotPort
from clone.server.shared import IO_COUNTERS, TURN_BUDGET, Shared
from clone.server.sockets import ServerSockets
from clone.server.statsparts import access_stats, ha_stats, storage_stats
from clone.server.status import StatusLimiter
from clone.server.streaming import SnapshotStreams
from clone.server.subscribers import SubscriptionGate, drop_connection_from
from clone.server.subscriptions import SubscriptionLedger, SubscriptionLimits
from clone.server.timers import Timers
from clone.server.turns import TurnBudget
from clone.server.voting import HeldVotes
from clone.server.wiring import build_parts, build_roles, build_serving, build_timers
from clone.storage.files import dir_bytes
from clone.storage.schema import FORMAT_VERSION
from clone.wire.frames import MAX_FRAME_BYTES
from clone.wire.protocol import COLLECTOR_OFFSET, MAX_HEARTBEAT_MS, SNAPSHOT_OFFSET

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar
    from clone.wire.calls import Reply

# ServerConfig, ServerMode and ServerStartError are re-exported: this module is
# where callers have always found them.
__all__ = ["CloneServer", "ServerConfig", "ServerMode", "ServerStartError"]

# STATUS? answers per second, and at once: enough for every monitor of a pair,
# too few for a flood to take the loop from clients and the peer.
_STATUS_RATE = 20.0
_STATUS_BURST = 40

# One logger for the whole reactor, whichever module a line comes from: operators
# filter on it, and the tests read its lines.
log = logging.getLogger("clone.server.reactor")


def _tcp(host_port: str) -> str:
    return host_port if "://" in host_port else f"tcp://{host_port}"


class CloneServer:
    """One member of a Clone server pair (or a standalone server).

    ``run()`` serves in the calling thread until :meth:`stop`; ``start()`` runs
    it in a background thread and returns once the sockets are bound.  The
    context is ours unless one is passed in.  ``wallclock`` (Unix seconds)
    stamps what is shown or stored as a date (``expires``, the update log)
    and ages the pending list and the uuid window; no key or lease expires by it.

    ``clock`` (monotonic seconds) is the one clock of the server: every
    deadline (the next HUGZ, sync timeouts, stalled snapshots, held votes,
    ephemeral keys and leases) and
    Binary Star's peer expiry are read from it.  The loop is only asked to wake
    us after a delay computed on that clock (``call_later``, never ``call_at``
    with the loop's own time), so a fake clock in a test moves every deadline
    and two clocks can never disagree about whether something is due.
    """

    def __init__(
        self,
        config: ServerConfig,
        ctx: zmq.Context[Any] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # What every HUGZ tells clients to expect (the codec's range).
        self._heartbeat_ms = min(max(1, round(config.heartbeat * 1000)), MAX_HEARTBEAT_MS)
        self._own_ctx = ctx is None
        self._ctx: zmq.Context[Any] = ctx if ctx is not None else zmq.Context[Any]()
        self._clock = clock
        self._wallclock = wallclock
        self.core = ServerCore(
            config.core,
            standalone=config.mode is ServerMode.STANDALONE,
            durable=config.data_dir is not None,
            relay=config.mode is ServerMode.RELAY,
        )
        # How long a collector turn drains, leaving room for its commit (clone.server.turns).
        self._turns = TurnBudget(TURN_BUDGET)
        # Who is admitted and their rights (clone.server.access): what the
        # parts read; the security part installs them.
        self.access = Access()
        self._loop: IOLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self._throttle = Throttle(log, clock)
        self._router: zmq.Socket[Any] | None = None
        self._collector: zmq.Socket[Any] | None = None
        self._ha: BinaryStar | None = None  # when paired
        # STATUS? and CONFLICTS? answers, one rate limit (clone.server.status).
        self._status_limiter = StatusLimiter(_STATUS_RATE, _STATUS_BURST, clock())
        #: The I/O layer's counters (clone.server.shared.IO_COUNTERS).
        self.counters: dict[str, int] = dict.fromkeys(IO_COUNTERS, 0)
        #: What every part is handed: the clocks, these counters, the throttle.
        self.shared = Shared(self._throttle, clock, wallclock, self.counters)
        #: The PUB socket's output, in order (a part of its own: clone.server.publishing).
        self.publisher = Publisher(self._next_turn, config.snapshot_chunk)
        #: Keys, the ZAP handler, the ACL and the views (clone.server.security):
        #: all None / empty without --curve-secret.
        self.security = Security(
            config, self._ctx, self.shared, self.access, publish=self.publisher.publish
        )
        self.sockets = ServerSockets(  # how every part opens its sockets
            self._ctx, self.security, self.counters, config.handshake_timeout)
        #: The data directory (a part: clone.server.durability), open while serving.
        self.durability = Durability(
            config,
            self.core,
            self.shared,
            publish=self.publisher.publish,
            ha_term=self._ha_term,
            committed=self._committed,
            stop=self.request_stop,
        )
        #: Health, readiness, STATUS, the status page; the HTTP port (a part:
        #: clone.server.monitoring).
        self.monitor = Monitor(
            config,
            self.core,
            self.shared,
            ha=lambda: self._ha,
            curve=lambda: self.security.keypair is not None,
            stats=self.stats,
            serving=lambda: not self._stopping and self.durability.error is None,
        )
        #: After a split brain (a part: clone.server.healing): the loser's
        #: writes to the winner; the winner's hold while it heals.
        self.healer = Healer(
            config,
            self.core,
            self.shared,
            self.sockets,
            next_turn=self._next_turn,
            followed=self._followed,
            commit_and_publish=self.durability.commit_and_publish,
            publish=self.publisher.publish,
            won_split=self._bstar_active,
            serve=self._serve_held,
            stopping=lambda: self._stopping,
        )
        # The publisher's subscriptions, judged per connection (a part of its
        # own: clone.server.subscribers); the topics come from security.
        self.subscription_gate = SubscriptionGate(
            SubscriptionLedger(
                SubscriptionLimits(config.max_subscriptions, config.max_subscription_bytes)
            ),
            self.security.subscription_topics,
            self.counters,
            self._throttle,
            clock,
            TURN_BUDGET,
            self._drop_flooder,
        )
        #: Hosts cut off for flooding the publisher, refused at its handshake
        #: for a while (clone.server.penalty); asked by the publisher port's
        #: door (plain mode, its own thread) or the Gatekeeper (CURVE).
        self.flood_penalty = FloodPenalty()
        # The parts built once the sockets are bound (_setup).
        # The snapshot port (P): its reader, its streams, its held votes.
        self.snapshot_port: SnapshotPort | None = None
        self.streams: SnapshotStreams | None = None
        self.votes: HeldVotes | None = None
        self.publisher_port: PublisherPort | None = None  # the XPUB (P+1)
        self.caller: Caller | None = None
        self.collector: Collector | None = None
        self.follower: Follower | None = None  # a pair member's or a relay's
        self.conflicts_desk: ConflictsDesk | None = None
        # A relay's link to its upstream (clone.server.relaying).
        self.relay: RelayLink | None = None
        # Binary Star's on_active / on_passive (clone.server.roles).
        self.roles: RoleSwitch | None = None
        # The heartbeat, housekeeping and stats timers (clone.server.timers).
        self.timers: Timers | None = None
        self.handover: Handover | None = None  # a graceful stop's (clone.server.handover)

    # -- life cycle ------------------------------------------------------------

    @property
    def loop(self) -> IOLoop | None:
        return self._loop

    def run(self, *, handle_signals: bool = False) -> None:
        """Bind and serve in this thread until :meth:`stop` (or a signal).

        ``handle_signals`` installs SIGINT/SIGTERM (graceful stop) and SIGUSR1
        (log the stats) handlers; only the main thread may do that.
        """
        loop = IOLoop(make_current=False)
        self._loop = self.sockets.loop = loop
        try:
            self.durability.open()
            self.security.open()
            self._setup()
        except BaseException as exc:
            self._start_error = exc
            self._close_all()
            loop.close(all_fds=False)
            self._ready.set()
            if isinstance(exc, zmq.ZMQError):
                raise ServerStartError(f"cannot start: {exc}") from exc
            raise
        if handle_signals:
            aio: asyncio.AbstractEventLoop = loop.asyncio_loop
            aio.add_signal_handler(signal.SIGINT, self._on_signal, "SIGINT")
            aio.add_signal_handler(signal.SIGTERM, self._on_signal, "SIGTERM")
            aio.add_signal_handler(signal.SIGUSR1, self.log_stats, logging.INFO)
            aio.add_signal_handler(signal.SIGHUP, self._guard_call, self._reload_security)
        self._ready.set()
        try:
            loop.start()
        finally:
            if handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
                    loop.asyncio_loop.remove_signal_handler(sig)
            self._close_all()
            loop.close(all_fds=False)
            if self._own_ctx:
                self._ctx.term()
            log.info("server stopped")

    @property
    def failed(self) -> BaseException | None:
        """Why the server stopped on its own (a write to the data directory
        failed), or None."""
        return self.durability.error

    def start(self, timeout: float = 10.0) -> None:
        """Run in a background thread; return once bound (or raise why not)."""
        if self._thread is not None:
            raise RuntimeError("server already started")
        self._thread = threading.Thread(target=self._thread_main, name="clone-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise ServerStartError(f"server did not start within {timeout} s")
        if self._start_error is not None:
            self._thread.join(timeout)
            raise ServerStartError(f"cannot start: {self._start_error}") from self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and close every socket.  Safe from any thread, twice."""
        self.request_stop()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("server thread did not stop within %.1f s", timeout)

    def request_stop(self) -> None:
        """Schedule a graceful stop on the loop and return at once."""
        loop = self._loop
        if loop is not None and not self._stopping:
            try:
                loop.add_callback(self._shutdown)
            except RuntimeError:  # loop already closed
                pass

    def stats(self) -> dict[str, int | float | str]:
        """Counters and gauges: the core's, the I/O layer's and Binary Star's."""
        out: dict[str, int | float | str] = dict(self.core.stats())
        out.update(self.counters)
        out["snapshots_in_flight"] = len(self.streams) if self.streams is not None else 0
        out["votes_deferred_held"] = len(self.votes) if self.votes is not None else 0
        out["outq"] = len(self.publisher)
        # After a split brain: writes still to send the winner or apply here.
        out["split_writes_queued"] = self.healer.queued + self.core.split_left
        subscribers = self.monitor.subscribers
        if subscribers is not None:
            out["subscribers"] = subscribers
        out["mode"] = self.config.mode.value
        out.update(self.monitor.http_counters())
        if self.config.data_dir is not None:
            out["data_dir_bytes"] = dir_bytes(Path(self.config.data_dir))
        storage = self.durability.storage
        if storage is not None:
            out.update(storage_stats(storage, self.durability, self.core))
        out.update(access_stats(self.flood_penalty, self.security.gatekeeper))
        if self._ha is not None:
            out.update(ha_stats(self._ha))
        return out

    def log_stats(self, level: int = logging.DEBUG) -> None:
        """Log :meth:`stats` as one line, ``stats: {json}`` (SIGUSR1 logs it at INFO).

        Every counter and gauge, as JSON on one line: tools and tests parse it
        with ``json.loads`` instead of a regex over a summary that left keys out.
        """
        log.log(level, "stats: %s", json.dumps(self.stats(), sort_keys=True))

    def _thread_main(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # reported to start() through _start_error
            if self._start_error is None:
                log.exception("server thread failed")
                self._start_error = exc
            self._ready.set()

    # -- setup / teardown ------------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        loop = self._loop
        assert loop is not None
        base = f"tcp://{cfg.bind}"
        router = self.sockets.socket(zmq.ROUTER, bound=True)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, cfg.snapshot_hwm)
        # A requester whose connection has taken nothing for the stall timeout
        # (a zero TCP window: it reads nothing) is dropped by the kernel, and
        # libzmq frees what it held for it (clone.server.snapwindow).
        router.setsockopt(zmq.TCP_MAXRT, int(cfg.snapshot_stall_timeout * 1000))
        router.bind(f"{base}:{cfg.port + SNAPSHOT_OFFSET}")
        self._router = router
        self.publisher_port = PublisherPort(
            cfg,
            self.shared,
            self.publisher,
            self.subscription_gate,
            self.sockets,
            loop,
            watch_subscribers=lambda pub: self.monitor.watch_subscribers(
                pub, self.security.keypair is not None
            ),
            on_pub_event=self.monitor.on_pub_event,
            stop=self.request_stop,
            penalty=self.flood_penalty,
            gatekeeper=lambda: self.security.gatekeeper,
            ctx=self._ctx,
            clock=self._clock,
        )
        self.publisher_port.bind()
        collector = self.sockets.socket(zmq.SUB, bound=True)
        # Bounded in bytes per writer: --collector-bytes of the largest frame
        # libzmq lets in (MAXMSGSIZE, set by _socket), clone.server.budget.
        collector.setsockopt(
            zmq.RCVHWM, collector_hwm(cfg.collector_bytes, MAX_FRAME_BYTES, cfg.collector_hwm)
        )
        collector.setsockopt(zmq.SUBSCRIBE, b"")
        collector.bind(f"{base}:{cfg.port + COLLECTOR_OFFSET}")
        self._collector = collector
        build_serving(self, router)
        build_parts(self, router, collector)
        if cfg.mode is not ServerMode.STANDALONE and cfg.mode is not ServerMode.RELAY:
            from bstar.reactor import BinaryStar  # only paired servers need it

            assert cfg.ha_port is not None and cfg.peer_ha is not None
            ha = BinaryStar(
                self._ctx,
                loop,
                cfg.mode is ServerMode.PRIMARY,
                f"{base}:{cfg.ha_port}",
                _tcp(cfg.peer_ha),
                heartbeat=cfg.heartbeat,
                missed=cfg.ha_missed,
                clock=self._clock,
                epoch=self.durability.data_term,
                start_wait=cfg.effective_peer_wait,
                rank=self.durability.rank if cfg.data_dir is not None else None,
                behind_peer=self.durability.data_following,
                secure_socket=self.security.secure_bstar
                if self.security.keypair is not None
                else None,
            )
            self._ha = ha
        elif cfg.mode is ServerMode.STANDALONE and self.durability.data_following:
            # The way to serve alone the data of a pair's passive whose peer is
            # gone for good: from now on this server writes, its data is the newest.
            log.warning("serving alone data last written as a pair's passive")
            self.durability.record_following(False)
        roles = self.roles = build_roles(self, collector)
        paired = self._ha
        if paired is not None:
            paired.on_active(roles.on_active)
            paired.on_passive(roles.on_passive)
            paired.on_split_brain(self.healer.on_split_brain)
            paired.start()
        self.timers = build_timers(self)
        self.timers.start()
        peer = (
            f"; peer {cfg.peer}, binary star {base}:{cfg.ha_port} <-> {_tcp(cfg.peer_ha or '')}"
            if cfg.mode not in (ServerMode.STANDALONE, ServerMode.RELAY)
            else f"; relaying {', '.join(cfg.upstream)}"
            if cfg.mode is ServerMode.RELAY
            else ""
        )
        log.info(
            "%s server: snapshots %s:%d, updates %s:%d, collector %s:%d, heartbeat %.3f s%s; "
            "release %s, data format %d",
            cfg.mode.value, base, cfg.port, base, cfg.port + 1, base, cfg.port + 2,
            cfg.heartbeat, peer, RELEASE, FORMAT_VERSION,
        )  # fmt: skip
        if cfg.mode is ServerMode.STANDALONE:
            log.info("standalone: active at once")
        self.monitor.open_http(loop)

    def _shutdown(self) -> None:
        # An active with a live passive hands over first, then calls us again.
        if self._stopping or (self.handover is not None and self.handover.begin()):
            return
        self._stopping = True
        log.info("stopping (%s, sequence %d)", self.core.role.value, self.core.store.sequence)
        self.log_stats(logging.INFO)
        self._close_all()
        assert self._loop is not None
        self._loop.stop()

    def _close_all(self) -> None:
        if self.timers is not None:
            self.timers.stop()
        if self.votes is not None:
            self.votes.close()
        self.monitor.close_http()
        if self._ha is not None:
            self._ha.stop()
        if self.follower is not None:
            self.follower.close()
        self.healer.close()
        if self.relay is not None:
            self.relay.close()
        if self.streams is not None:
            self.streams.close()
        if self.snapshot_port is not None:
            self.snapshot_port.close()
        self.publisher.drop()
        if self.publisher_port is not None:
            self.publisher_port.close()
        self.sockets.close()
        for sock in (self._router, self._collector):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        # Only now: a CURVE socket must never outlive its ZAP handler.
        self.security.close()
        spent = self.handover.spent if self.handover is not None else 0.0
        self.durability.close(STOP_WAIT - spent)  # one budget for the whole stop

    def _drop_flooder(self, fd: int, ino: int) -> bool:
        """Cut a publisher connection that kept subscribing past its caps, and
        put its address under a flood penalty; whether it was cut."""
        peer = drop_connection_from(fd, ino)
        if peer is None:
            return False
        self.flood_penalty.punish(peer, self._clock())
        return True

    # -- signals ---------------------------------------------------------------

    def _on_signal(self, name: str) -> None:
        log.info("%s received", name)
        self.request_stop()

    def _guard_call(self, fn: Callable[[], object]) -> None:
        """Run a signal's handler on the loop; a bug is logged, never fatal."""
        try:
            fn()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in %s", getattr(fn, "__name__", fn))

    def _reload_security(self) -> None:
        """SIGHUP: if rights shrank, every subscriber reconnects to a new publisher
        and is decided under the new rules."""
        port = self.publisher_port
        if self.security.reload() and port is not None and self.publisher.socket is not None:
            self.counters["publisher_rebinds"] += 1
            port.bind(rebind=True)

    # -- how the parts reach each other -----------------------------------------

    def _followed(self) -> str | None:
        """The server we follow: the peer while passive; a relay's current
        upstream (its link's), which changes at a failover."""
        if self.relay is not None:
            return self.relay.followed
        return self.config.upstream[0] if self.config.upstream else self.config.peer

    def _ha_term(self) -> int | None:
        """The term new writes are recorded under while paired: our epoch
        while active, the active peer's while we follow it (None unpaired)."""
        ha = self._ha
        if ha is None:
            return None
        return ha.epoch if self.core.role is Role.ACTIVE else ha.peer_epoch

    def _bstar_active(self) -> bool:
        """Binary Star says we are active (a split brain we see is one we win)."""
        ha = self._ha
        return ha is not None and ha.state is BStarState.ACTIVE

    def _committed(self, updates: list[list[bytes]]) -> None:
        """A commit's updates: counted per view, their keys remembered."""
        security = self.security
        if security.view_prefixes:
            security.count_views(updates)
        self.monitor.note_changes(updates)

    def _serve_held(self, identity: bytes, subtree: str, options: dict[str, Any]) -> None:
        """A snapshot request the healer held: served once what was applied is published."""
        streams = self.streams
        if streams is not None:
            self.durability.when_published(lambda: streams.serve(identity, subtree, **options))

    def _promote(self) -> None:
        """A vote we won while starting or passive: the promotion first."""
        if self.roles is not None:
            self.roles.on_active()

    def _on_call(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CALL? from the ROUTER's reader: the caller part's."""
        if self.caller is not None:
            self.caller.on_call(identity, parts)

    def _send_reply(self, identity: bytes, reply: Reply) -> None:
        """A relay's REPLY from upstream, back on the ROUTER: the caller's."""
        if self.caller is not None:
            self.caller.send_reply(identity, reply, backlog=None)

    def _answer_conflicts(self, identity: bytes, parts: list[zmq.Frame]) -> None:
        """A CONFLICTS? from the ROUTER's reader: the conflicts desk's."""
        if self.conflicts_desk is not None:
            self.conflicts_desk.on_request(identity, parts)

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        """Run ``callback`` on the loop's next turn; False without a loop."""
        if self._loop is None:
            return False
        self._loop.add_callback(callback)
        return True
