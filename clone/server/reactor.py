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
and builds the parts the server owns once its sockets are bound (the caller,
the collector, the follower, a relay's link, the conflicts desk), each with
only what it needs (docs/architecture.md, "Parts").  The duties not yet parts
are mixins of one :class:`CloneServer` over :mod:`.base`'s shared attributes.

Every handler is wrapped: bad input is counted and logged (rate-limited) and
an unexpected exception is logged with its traceback; nothing stops the loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
from tornado.ioloop import IOLoop

from clone.errors import ServerStartError
from clone.release import RELEASE
from clone.security.zap import PUBLISHER_DOMAIN
from clone.server.admin import ConflictsDesk
from clone.server.base import PartSockets, log
from clone.server.budget import collector_hwm
from clone.server.calling import Caller
from clone.server.collecting import Applier, Collector, Judge, Sink
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import Role
from clone.server.door import PublisherDoor
from clone.server.durability import DurabilityMixin
from clone.server.following import Follower
from clone.server.healing import HealingMixin
from clone.server.monitoring import MonitoringMixin
from clone.server.relaying import RelayLink
from clone.server.roles import RoleMixin
from clone.server.serving import ServingMixin
from clone.server.subscribers import (
    PER_TURN,
    SLOW_AFTER,
    SUBSCRIPTION_RCVBUF,
    SUBSCRIPTION_RCVHWM,
    InboundWatch,
    SubscriptionReader,
)
from clone.server.subscriptions import MAX_TOPIC_BYTES, InboundAllowance
from clone.storage.files import dir_bytes
from clone.storage.schema import FORMAT_VERSION
from clone.wire.frames import MAX_FRAME_BYTES
from clone.wire.protocol import COLLECTOR_OFFSET, PUBLISHER_OFFSET, SNAPSHOT_OFFSET

# ServerConfig, ServerMode and ServerStartError are re-exported: this module is
# where callers have always found them.
__all__ = ["CloneServer", "ServerConfig", "ServerMode", "ServerStartError"]

_HOUSEKEEPING = 0.1  # seconds between expiry / sync-timeout / deferred-vote checks


def _tcp(host_port: str) -> str:
    return host_port if "://" in host_port else f"tcp://{host_port}"


class CloneServer(
    ServingMixin,
    RoleMixin,
    HealingMixin,
    DurabilityMixin,
    MonitoringMixin,
):
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

    # -- life cycle ----------------------------------------------------------

    @property
    def loop(self) -> IOLoop | None:
        return self._loop

    def run(self, *, handle_signals: bool = False) -> None:
        """Bind and serve in this thread until :meth:`stop` (or a signal).

        ``handle_signals`` installs SIGINT/SIGTERM (graceful stop) and SIGUSR1
        (log the stats) handlers; only the main thread may do that.
        """
        loop = IOLoop(make_current=False)
        self._loop = loop
        try:
            self._open_storage()
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
        return self._storage_error

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
        out["snapshots_in_flight"] = len(self._snapshots)
        out["votes_deferred_held"] = len(self._deferred)
        out["outq"] = len(self.publisher)
        # After a split brain: writes still to send the winner or apply here.
        out["split_writes_queued"] = len(self._split_queue) + self.core.split_left
        subscribers = self.subscribers
        if subscribers is not None:
            out["subscribers"] = subscribers
        out["mode"] = self.config.mode.value
        out.update(self.http_counters())
        if self.config.data_dir is not None:
            out["data_dir_bytes"] = dir_bytes(Path(self.config.data_dir))
        storage = self._storage
        if storage is not None:
            # Where the durable commit's time goes (docs/benchmarks.md, issue 27).
            timing = storage.timing
            out["commits"] = timing.commits
            out["commit_write_us"] = round(timing.write_s * 1e6)
            out["commit_sync_us"] = round(timing.sync_s * 1e6)
            out["commit_max_us"] = round(timing.max_s * 1e6)
            # A commit that waited for the checkpointer's lock; TRUNCATEs done / given up.
            out["commit_busy_waits"] = storage.busy_waits
            done, busy, longest = storage.wal_truncations()
            out["wal_truncations"], out["wal_truncations_busy"] = done, busy
            out["wal_truncate_max_us"] = round(longest * 1e6)
        out["flood_penalties"] = self.flood_penalty.punished
        out["flood_penalty_refused"] = self.flood_penalty.refused
        gatekeeper = self.security.gatekeeper
        if gatekeeper is not None:
            out["zap_admitted"] = gatekeeper.admitted
            out["zap_refused"] = gatekeeper.refused
        ha = self._ha
        if ha is not None:
            out["ha_state"] = ha.state.name.lower()
            counters = ha.counters
            out["ha_state_messages_received"] = counters.state_messages_received
            out["ha_malformed_messages"] = counters.malformed_peer_messages
            out["ha_out_of_range_messages"] = counters.out_of_range_peer_messages
            out["ha_handler_errors"] = counters.handler_errors
            out["ha_subscriber_disconnects"] = counters.subscriber_disconnects
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

    # -- setup / teardown ----------------------------------------------------

    def _setup(self) -> None:
        cfg = self.config
        loop = self._loop
        assert loop is not None
        base = f"tcp://{cfg.bind}"
        router = self._socket(zmq.ROUTER, bound=True)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, cfg.snapshot_hwm)
        # A requester whose connection has taken nothing for the stall timeout
        # (a zero TCP window: it reads nothing) is dropped by the kernel, and
        # libzmq frees what it held for it (clone.server.snapwindow).
        router.setsockopt(zmq.TCP_MAXRT, int(cfg.snapshot_stall_timeout * 1000))
        router.bind(f"{base}:{cfg.port + SNAPSHOT_OFFSET}")
        self._router = router
        self._bind_publisher()
        collector = self._socket(zmq.SUB, bound=True)
        # Bounded in bytes per writer: --collector-bytes of the largest frame
        # libzmq lets in (MAXMSGSIZE, set by _socket), clone.server.budget.
        collector.setsockopt(
            zmq.RCVHWM, collector_hwm(cfg.collector_bytes, MAX_FRAME_BYTES, cfg.collector_hwm)
        )
        collector.setsockopt(zmq.SUBSCRIBE, b"")
        collector.bind(f"{base}:{cfg.port + COLLECTOR_OFFSET}")
        self._collector = collector
        # Zero-copy frames: only a Frame can tell the requester's ZMTP metadata.
        self._on_router_guarded = self._guard(self._on_router)
        self._stream(router, self._on_router, copy=False)
        self._build_parts(router, collector)
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
                epoch=self._data_term,
                start_wait=cfg.effective_peer_wait,
                rank=self._rank if cfg.data_dir is not None else None,
                secure_socket=self.security.secure_bstar if self._keypair is not None else None,
            )
            ha.on_active(self._on_became_active)
            ha.on_passive(self._on_became_passive)
            ha.on_split_brain(self._on_split_brain)
            self._ha = ha
            ha.start()
        self._next_hugz = self._clock() + cfg.heartbeat
        self._hugz_timer = loop.call_later(cfg.heartbeat, self._on_heartbeat)
        self._house_timer = loop.call_later(_HOUSEKEEPING, self._on_housekeeping)
        if cfg.stats_interval > 0:
            self._stats_timer = loop.call_later(cfg.stats_interval, self._on_stats_timer)
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
            cfg.mode.value,
            base,
            cfg.port,
            base,
            cfg.port + 1,
            base,
            cfg.port + 2,
            cfg.heartbeat,
            peer,
            RELEASE,
            FORMAT_VERSION,
        )
        if cfg.mode is ServerMode.STANDALONE:
            log.info("standalone: active at once")
        self._open_http()

    def _build_parts(self, router: zmq.Socket[Any], collector: zmq.Socket[Any]) -> None:
        """The parts built on the bound sockets: a relay's link (started: it
        follows its first upstream), the caller and the collector."""
        cfg = self.config
        secure = self._keypair is not None
        refuse = self.security.refusal if secure else None
        link: RelayLink | None = None
        follower: Follower | None = None
        if cfg.mode is not ServerMode.STANDALONE:
            follower = self.follower = Follower(
                cfg,
                self.core,
                self.shared,
                PartSockets(self),
                followed=lambda: self._followed,
                term=self._peer_term,
                after_turn=self._commit_and_publish
                if cfg.mode is ServerMode.RELAY
                else self._commit_followed,
                next_turn=self._next_turn,
                fork_known=self._split_fork_known,
                synced=self._forward_split_writes,
                stepped_down=lambda: self._stepped_down_at is not None,
            )
        if follower is not None and cfg.mode is ServerMode.RELAY:
            link = self.relay = RelayLink(
                cfg,
                self.core,
                self.shared,
                self.access,
                PartSockets(self),
                router=router,
                router_backlog=self._take_router_backlog,
                upstream_keypair=self.security.upstream_keypair,
                follow=follower.follow,
                close_follow=follower.close,
                sync_progress=lambda: follower.sync_progress,
                reply=self._send_reply,
                publish=self.publisher.publish,
                refuse=refuse,
                views_replaced=self.security.views_replaced,
            )
            follower.upstream = link
            link.start()
        self.caller = Caller(
            self.core,
            self.shared,
            self.access,
            router,
            commit=self._commit_for_replies,
            router_backlog=self._take_router_backlog,
            next_turn=self._next_turn,
            trusted_relays=cfg.trusted_relays,
            forward=link.forward_call if link is not None else None,
        )
        self.conflicts_desk = ConflictsDesk(
            self.core, self.shared, self.access, router, self._status_limiter
        )
        # One collector, composed: a relay forwards what a server applies,
        # and under CURVE each write is judged by its sender's rights first.
        sink: Sink
        if link is not None:
            assert link.forwarder is not None
            sink = link.forwarder
        else:
            sink = Applier(self.core, self.shared, end_turn=self._commit_and_publish, refuse=refuse)
        judge: Judge | None = None
        if secure:
            # A relay tells every refused writer; a server only while active
            # (a passive one parks writes for the pending list, unjudged).
            judge = self._judge_always if link is not None else self._judge_while_active
        self.collector = part = Collector(
            collector,
            self.shared,
            sink,
            batch=cfg.collector_batch,
            judge=judge,
            turns=None if link is not None else self._turns,
        )
        if part.secure:
            self._stream(collector, part.on_frames, copy=False)
        else:
            self._stream(collector, part.on_message)

    def _judge_while_active(self, first: zmq.Frame, frames: list[bytes]) -> tuple[bool, str | None]:
        return self.security.judge(first, frames, notify=self.core.role is Role.ACTIVE)

    def _judge_always(self, first: zmq.Frame, frames: list[bytes]) -> tuple[bool, str | None]:
        return self.security.judge(first, frames, notify=True)

    def _peer_term(self) -> int | None:
        """The followed server's term: Binary Star's peer epoch (None unpaired)."""
        return self._ha.peer_epoch if self._ha is not None else None

    def _commit_followed(self) -> None:
        self._commit()

    def _commit_for_replies(self) -> bool:
        """Commit and publish this turn; whether its changes may be confirmed."""
        if self._stopping:
            return False
        self._commit_and_publish()
        return self._storage_error is None  # fail-stop: nothing unwritten is confirmed

    def _shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        log.info("stopping (%s, sequence %d)", self.core.role.value, self.core.store.sequence)
        self.log_stats(logging.INFO)
        self._close_all()
        assert self._loop is not None
        self._loop.stop()

    def _close_all(self) -> None:
        loop = self._loop
        if loop is not None:
            timers = (self._hugz_timer, self._house_timer, self._stats_timer, self._deferred_timer)
            for timer in timers:
                if timer is not None:
                    loop.remove_timeout(timer)
        self._hugz_timer = self._house_timer = self._stats_timer = None
        self._deferred_timer = None
        self._deferred.clear()
        self._deferred_streams.clear()
        self._close_http()
        if self._ha is not None:
            self._ha.stop()
        self._close_peer()
        self._close_split()
        if self.relay is not None:
            self.relay.close()
        self._snapshots.clear()
        self._in_flight.clear()
        self._peer_windows.clear()
        self._pump_queue.clear()
        self._waiting.clear()
        self.publisher.drop()
        watch, self._inbound_watch = self._inbound_watch, None
        if watch is not None:
            watch.stop()
        if self._pub_stream is not None:
            self._pub_stream.close()
        for stream in self._streams:
            stream.close(linger=0)
        self._streams.clear()
        for sock in (self._router, self._pub, self._collector):
            if sock is not None and not sock.closed:
                sock.close(linger=0)
        self._pub_stream = None
        door, self._door = self._door, None
        if door is not None:
            door.stop()
        # Only now: a CURVE socket must never outlive its ZAP handler.
        self.security.close()
        self._close_storage()

    # -- timers --------------------------------------------------------------

    def _on_heartbeat(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        # How late the reactor ran this timer: the operator's measure of a
        # blocked loop (and what clients would see as a heartbeat gap).
        late_ms = int((self._clock() - self._next_hugz) * 1000)
        if late_ms > self.counters["heartbeat_max_late_ms"]:
            self.counters["heartbeat_max_late_ms"] = late_ms
            if late_ms > 1000 * self.config.heartbeat:
                log.warning("heartbeat ran %d ms late: the reactor was blocked", late_ms)
        try:
            if self.core.role is Role.ACTIVE:
                # A call's update is applied in the ROUTER's handler but
                # committed and published by a callback after it
                # (clone.server.calling); a timer that runs between the two
                # would announce a sequence nobody was sent, and every client
                # and the passive would resync.  Publish it first.
                if self.core.journal:
                    self._commit_and_publish()
                self._publish_hugz(self.core.hugz(self._heartbeat_ms), stale=False)
            elif self.relay is not None:
                self._publish_hugz(self.relay.hugz(self._heartbeat_ms), stale=self.relay.stale())
            # Subscriptions our sends may have hidden from the XPUB's reader.
            self._take_subscriptions()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in heartbeat")
        # Fixed rate; after a stall skip ahead rather than burst.
        self._next_hugz += self.config.heartbeat
        now = self._clock()
        if self._next_hugz <= now:
            self._next_hugz = now + self.config.heartbeat
        self._hugz_timer = loop.call_later(self._next_hugz - now, self._on_heartbeat)

    def _publish_hugz(self, hugz: list[bytes], *, stale: bool) -> None:
        """Our HUGZ, then each restricted view's (a relay's say ``stale`` too)."""
        self.publisher.publish(hugz)
        self.counters["hugz_sent"] += 1
        security = self.security
        if security.view_counts:
            sequence = self.core.store.sequence
            for frames in security.view_heartbeats(sequence, self._heartbeat_ms, stale=stale):
                self.publisher.publish(frames)

    def _on_housekeeping(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        delay = _HOUSEKEEPING
        try:
            # Keys and leases expire on the monotonic clock: a wall step ends nothing.
            mono = self._clock()
            self.core.tick(self._wallclock(), mono)
            self._commit_and_publish()
            if self.core.expiry_due(mono):
                delay = 0.0  # more due than one batch: continue next turn
            if self.follower is not None:
                self.follower.check_timeout()
            if self.relay is not None:
                self.relay.check()
            self._check_stalled_snapshots()
            self._check_split_writes()
            self._check_hold()
            self._check_stepped_down()
            if self._deferred:
                # The peer's expiry may have moved earlier (Binary Star saw its
                # connection drop); the timer only knows the old one.
                self._recheck_deferred()
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

    # -- the publisher -------------------------------------------------------

    def _bind_publisher(self, *, rebind: bool = False) -> None:
        """Bind the publisher (P+1): an XPUB in manual mode, whose
        subscriptions the subscription gate (clone.server.subscribers) judges
        per connection and clone.server.security maps to what each may read.

        ``rebind`` closes the current one first (SIGHUP took rights away);
        until the port is free again, publications wait in the ordered output
        queue, so none is lost for the subscribers that come back.
        """
        cfg = self.config
        old_stream, self._pub_stream = self._pub_stream, None
        old, self._pub = self._pub, None
        endpoint = f"tcp://{cfg.bind}:{cfg.port + PUBLISHER_OFFSET}"
        if old_stream is not None:
            old_stream.close()
        if old is not None and not old.closed:
            old.close(linger=0)
        pub = self._socket(zmq.XPUB, bound=True)
        # A subscriber's queue: --hwm messages; in bytes, the inbound watch
        # cuts one off that reads nothing past --max-subscriber-bytes.
        pub.setsockopt(zmq.SNDHWM, cfg.pub_hwm)
        # Subscriptions: none applied but by us, none longer than a subtree,
        # and few taken in from one connection ahead of the gate.
        pub.setsockopt(zmq.XPUB_MANUAL, 1)
        pub.setsockopt(zmq.MAXMSGSIZE, 1 + MAX_TOPIC_BYTES)
        pub.setsockopt(zmq.RCVHWM, SUBSCRIPTION_RCVHWM)
        pub.setsockopt(zmq.RCVBUF, SUBSCRIPTION_RCVBUF)
        self._guard_door(pub)
        if not rebind:
            pub.bind(endpoint)
            self._install_publisher(pub)
            return
        self.publisher.hold()  # publications queue until the new socket is bound
        self._retry_bind(pub, endpoint, 0)

    def _guard_door(self, pub: zmq.Socket[Any]) -> None:
        """Refuse penalized hosts at the publisher's handshake (clone.server.penalty):
        its own ZAP domain, asked of the Gatekeeper under CURVE, else of the
        publisher's door, started here once."""
        gatekeeper = self.security.gatekeeper
        if gatekeeper is not None:
            gatekeeper.penalty = self.flood_penalty.admits
        elif self._door is None:
            door = PublisherDoor(self._ctx, self.flood_penalty.admits, self._clock)
            try:
                door.start()
            except zmq.ZMQError as exc:
                log.warning("no flood penalty at the publisher's door: %s", exc)
                return
            self._door = door
        pub.zap_domain = PUBLISHER_DOMAIN

    def _retry_bind(self, pub: zmq.Socket[Any], endpoint: str, attempt: int) -> None:
        try:
            pub.bind(endpoint)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE or attempt >= 200 or self._loop is None:
                pub.close(linger=0)
                log.critical("cannot bind the publisher again at %s: %s; stopping", endpoint, exc)
                self.request_stop()
                return
            # The old socket's port is released by libzmq's I/O thread shortly.
            self._loop.call_later(0.01, self._retry_bind, pub, endpoint, attempt + 1)
            return
        self._install_publisher(pub)
        log.info("publisher bound again at %s: subscribers reconnect under the new rules", endpoint)

    def _install_publisher(self, pub: zmq.Socket[Any]) -> None:
        self.publisher.install(pub)  # what was held goes out from the next turn
        self.subscription_gate.reset()  # a new socket: no connection yet
        assert self._loop is not None
        self._pub_stream = SubscriptionReader(pub, self._loop, self._on_subscription)
        self._start_inbound_watch(self._watch_subscribers(pub))

    def _start_inbound_watch(self, monitor: zmq.Socket[Any]) -> None:
        """The thread that reads ``monitor`` and stops the floods the loop
        cannot see (clone.server.subscribers)."""
        old, self._inbound_watch = self._inbound_watch, None
        if old is not None:
            old.stop()
        loop = self._loop
        assert loop is not None
        watch = InboundWatch(
            monitor,
            InboundAllowance.for_limits(self.subscription_gate.ledger.limits),
            lambda event, value: loop.add_callback(self._on_pub_monitor, event, value),
            lambda peer, received: self._flood_cut(loop, peer, received),
            lambda peer, waiting: loop.add_callback(self._on_slow_subscriber, peer, waiting),
            budget=self.config.max_subscriber_bytes,
            published=lambda: self.publisher.sent_bytes,
            on_cut=lambda peer, queued: loop.add_callback(self._on_subscriber_cut, peer, queued),
        )
        watch.start()
        self._inbound_watch = watch

    def _flood_cut(self, loop: IOLoop, peer: str, received: int) -> None:
        """From the inbound watch's thread: the penalty at once (the loop may be
        inside libzmq), the counting on the loop."""
        self.flood_penalty.punish(peer, self._clock())
        loop.add_callback(self._on_inbound_drop, peer, received)

    def _on_inbound_drop(self, peer: str, received: int) -> None:
        """The inbound watch shut a publisher connection down: it sent more than
        subscribing within the caps takes."""
        self.counters["subscribers_dropped"] += 1
        self.counters["subscribers_flooding"] += 1
        self._throttle.log(
            "subscriber_flood",
            logging.WARNING,
            "subscriber %s sent %d bytes to the publisher, more than subscribing within"
            " --max-subscriptions and --max-subscription-bytes takes: connection dropped",
            peer,
            received,
        )

    def _on_slow_subscriber(self, peer: str, waiting: int) -> None:
        """The inbound watch saw a subscriber read nothing for a while."""
        self.counters["subscribers_slow"] += 1
        self._throttle.log(
            "subscriber_slow",
            logging.WARNING,
            "subscriber %s has read nothing for %.0f s (%d bytes wait in the kernel); it is"
            " cut off once %d more bytes are published (--max-subscriber-bytes)",
            peer,
            SLOW_AFTER,
            waiting,
            self.config.max_subscriber_bytes,
        )

    def _on_subscriber_cut(self, peer: str, queued: int) -> None:
        """The inbound watch cut off a subscriber that read nothing past its budget."""
        self.counters["subscribers_dropped"] += 1
        self.counters["subscribers_over_budget"] += 1
        self._throttle.log(
            "subscriber_over_budget",
            logging.WARNING,
            "subscriber %s read nothing while %d bytes were published for it, past"
            " --max-subscriber-bytes %d: connection dropped (its queue goes with it; it"
            " resyncs when it reads again)",
            peer,
            queued,
            self.config.max_subscriber_bytes,
        )

    def _on_subscription(self) -> bool:
        """The publisher's subscription messages: the gate judges them per
        connection (clone.server.subscribers), a bounded number per turn;
        True if it stopped at its budget."""
        sock = self._pub
        if sock is None or sock.closed:
            return False
        return self.subscription_gate.take(sock) >= PER_TURN

    def _take_subscriptions(self) -> None:
        """Handle subscription messages our own sends on the XPUB may have hidden.

        Every send on a socket may consume the edge of its file descriptor
        that announces an incoming message, so the reader would not wake for
        a subscription that arrived meanwhile, and its client would hear
        nothing, not even HUGZ, until something else stirred the socket (seen
        in CI: 25 snapshots served to a client, 1 subscription handled).  The
        heartbeat calls this after its own sends: a subscription waits at most
        one heartbeat, and the hot path pays nothing.  Bounded like a turn of
        the socket's own reader.
        """
        sock = self._pub
        if self._pub_stream is None or sock is None or sock.closed:
            return
        if not sock.poll(0, zmq.POLLIN):
            return
        self.counters["subscriptions_at_heartbeat"] += self.subscription_gate.take(sock)

    def _reload_security(self) -> None:
        """SIGHUP: if rights shrank, every subscriber reconnects to a new publisher
        and is decided under the new rules."""
        if self.security.reload() and self._pub is not None:
            self.counters["publisher_rebinds"] += 1
            self._bind_publisher(rebind=True)
