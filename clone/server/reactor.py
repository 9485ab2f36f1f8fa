"""The CHP server's sockets and timers: thin I/O around :mod:`clone.server.core`.

How this works: one tornado IOLoop (owned, never the global one) drives

* the SNAPSHOT ROUTER (P): ICANHAZ? -> Binary Star vote -> a
  :class:`~clone.server.snapshot.SnapshotStream` pumped a chunk per loop turn with
  ``ROUTER_MANDATORY`` and non-blocking sends.  EAGAIN pauses that stream and
  retries shortly (no entry is dropped); EHOSTUNREACH aborts it.
  A vote refused only because the peer does not look dead *yet* (we are passive,
  or a primary still starting) is *deferred*: held, bounded in number and age,
  and voted again at the peer's expiry time, every housekeeping tick and when
  we become active; served if accepted then, dropped when it ages out.  A
  client that noticed the active server's crash before we did is then served
  the moment we notice it too, instead of after its own retry.
* the PUBLISHER PUB (P+1): KVPUBs, and HUGZ every heartbeat while active.  Bulk
  output (a promotion's pending list, a mass expiry) goes through an in-order
  queue drained a chunk per turn, and while that queue is non-empty every other
  publication joins its tail so sequence order on the wire is kept.
* the COLLECTOR SUB (P+2): KVSETs, drained in batches per readiness event.
* when passive: a SUB on the peer's publisher and a DEALER on its snapshot port
  (a fresh one per attempt, with a timeout), to follow the active server.
* :class:`bstar.reactor.BinaryStar` on the HA ports, which decides the role.

Every handler is wrapped: bad input is counted and logged (rate-limited) and
an unexpected exception is logged with its traceback; nothing stops the loop.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from clone.errors import ProtocolError, ServerStartError
from clone.ratelimit import Throttle
from clone.server.core import CoreSettings, FollowOutcome, Role, ServerCore, SyncState
from clone.server.snapshot import SnapshotStream
from clone.wire.codec import encode_icanhaz
from clone.wire.frames import (
    MAX_SYNC_FRAME_BYTES,
    NOBLOCK,
    POLLIN,
    cap_message_size,
    recv_frames,
    send_frames,
    send_tracked,
)
from clone.wire.protocol import (
    APPLIED_METADATA,
    APPLIED_PROPERTY,
    APPLIED_VERSION,
    BATCH_METADATA,
    BATCH_PROPERTY,
    BATCH_VERSION,
    COLLECTOR_OFFSET,
    DEFAULT_HEARTBEAT_MS,
    DEFAULT_MISSED_HEARTBEATS,
    MAX_HEARTBEAT_MS,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
)

__all__ = ["CloneServer", "ServerConfig", "ServerMode", "ServerStartError"]

log = logging.getLogger(__name__)

_F = TypeVar("_F", bytes, zmq.Frame)

_STALL_RETRY = 0.005  # seconds before retrying a snapshot send that hit the HWM
# KVBATCHes per batched snapshot that libzmq may hold unsent.  The socket's
# high-water mark counts messages, and snapshot_hwm batches could be a whole
# snapshot; this keeps what a slow requester can pin in our memory to a few MB
# (at most this many times MAX_BATCH_BYTES) while the pipe stays full.
_BATCHES_IN_FLIGHT = 4
_HOUSEKEEPING = 0.1  # seconds between expiry / sync-timeout / deferred-vote checks
# Binary Star states in which a refused vote may be accepted later, once the
# peer expires ("vote if expired" in docs/failover.md).  By name, so that a
# standalone server does not import bstar.
_DEFERRING_STATES = frozenset(("PASSIVE", "PRIMARY"))
# Wall-time budget of one handler call that drains a socket or streams a
# snapshot chunk.  The count limits alone are not enough: on a loaded host a
# batch of 1000 took up to 190 ms of wall time, and timers (HUGZ) waited for it.
_TURN_BUDGET = 0.01
_BUDGET_CHECK = 63  # check the clock every 64 messages (mask)
# Snapshot requests handled after one pump turn at most (see _take_router_backlog).
_ROUTER_BACKLOG_BATCH = 100


class ServerMode(enum.Enum):
    PRIMARY = "primary"
    BACKUP = "backup"
    STANDALONE = "standalone"


@dataclass(frozen=True)
class ServerConfig:
    """Everything a server needs; defaults are documented in docs/operations.md.

    ``peer`` and ``peer_ha`` are ``host:port``; ``bind`` an interface (``*`` for
    all).  Times are seconds.
    """

    port: int
    mode: ServerMode = ServerMode.STANDALONE
    bind: str = "*"
    peer: str | None = None
    ha_port: int | None = None
    peer_ha: str | None = None
    heartbeat: float = DEFAULT_HEARTBEAT_MS / 1000.0
    ha_missed: int = DEFAULT_MISSED_HEARTBEATS
    pub_hwm: int = 100_000
    collector_hwm: int = 100_000
    snapshot_hwm: int = 10_000
    snapshot_chunk: int = 1_000
    snapshot_stall_timeout: float = 30.0
    max_snapshots: int = 64
    collector_batch: int = 1_000
    sync_timeout: float = 0.0  # 0: max(5 heartbeats, 2 s)
    max_deferred_votes: int = 1_000
    deferred_vote_max_age: float = 0.0  # 0: 2 * ha_missed * heartbeat
    stats_interval: float = 60.0
    core: CoreSettings = field(default_factory=CoreSettings)

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535 - 2:
            raise ValueError(f"port {self.port} leaves no room for P+1 and P+2")
        if self.heartbeat <= 0:
            raise ValueError(f"heartbeat must be positive, not {self.heartbeat}")
        for name in ("pub_hwm", "collector_hwm", "snapshot_hwm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit)")
        if self.deferred_vote_max_age < 0:
            raise ValueError("deferred_vote_max_age must be >= 0 (0 = 2 * missed heartbeats)")
        if self.max_deferred_votes < 0:
            raise ValueError("max_deferred_votes must be >= 0 (0 = never defer)")
        for name in ("snapshot_chunk", "collector_batch", "max_snapshots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.mode is not ServerMode.STANDALONE:
            missing = [n for n in ("peer", "ha_port", "peer_ha") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"a {self.mode.value} server needs {', '.join(missing)}")

    @property
    def effective_sync_timeout(self) -> float:
        return self.sync_timeout or max(5 * self.heartbeat, 2.0)

    @property
    def effective_deferred_vote_max_age(self) -> float:
        return self.deferred_vote_max_age or 2 * self.ha_missed * self.heartbeat


def _tcp(host_port: str) -> str:
    return host_port if "://" in host_port else f"tcp://{host_port}"


def _peer_base(host_port: str, offset: int) -> str:
    host, _, port = host_port.rpartition(":")
    return f"tcp://{host}:{int(port) + offset}"


def _who(identity: bytes) -> str:
    return identity.hex() if identity else "?"


def _has_metadata(frame: zmq.Frame, name: str, value: str) -> bool:
    """Whether the requester's connection carries our metadata ``name:value``.

    A peer that did not set it (the Guide's clients, raw tools) makes libzmq
    raise EINVAL: it gets the standard stream.
    """
    try:
        return bool(frame.get(name) == value)
    except zmq.ZMQError:
        return False


def _wants_batches(frame: zmq.Frame) -> bool:
    """KVBATCHes instead of KVSYNCs (:mod:`clone.wire.batch`)."""
    return _has_metadata(frame, BATCH_PROPERTY, BATCH_VERSION)


def _wants_applied(frame: zmq.Frame) -> bool:
    """The applied-update list first: a peer server's sync (:mod:`clone.wire.applied`)."""
    return _has_metadata(frame, APPLIED_PROPERTY, APPLIED_VERSION)


@dataclass(frozen=True, slots=True)
class _DeferredVote:
    """A snapshot request held until Binary Star may accept it (or it ages out)."""

    identity: bytes
    subtree: str
    expires_at: float  # on self._clock
    batch: bool  # the requester negotiated KVBATCH
    applied: bool  # the requester (a peer server) asked for KVAPPLIED


class CloneServer:
    """One member of a Clone server pair (or a standalone server).

    ``run()`` serves in the calling thread until :meth:`stop`; ``start()`` runs
    it in a background thread and returns once the sockets are bound.  The
    context is ours unless one is passed in.  ``clock`` (monotonic) paces
    timers and timeouts; ``wallclock`` (Unix seconds) stamps expiry times.
    """

    def __init__(
        self,
        config: ServerConfig,
        ctx: zmq.Context | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wallclock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        # What every HUGZ tells clients to expect (the codec's range).
        self._heartbeat_ms = min(max(1, round(config.heartbeat * 1000)), MAX_HEARTBEAT_MS)
        self._own_ctx = ctx is None
        self._ctx: zmq.Context = ctx if ctx is not None else zmq.Context()
        self._clock = clock
        self._wallclock = wallclock
        self.core = ServerCore(config.core, standalone=config.mode is ServerMode.STANDALONE)
        self._loop: IOLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._stopping = False
        self._throttle = Throttle(log, clock)
        self._streams: list[ZMQStream] = []
        self._router: zmq.Socket | None = None
        self._pub: zmq.Socket | None = None
        self._collector: zmq.Socket | None = None
        self._ha: Any = None  # bstar.reactor.BinaryStar when paired
        self._snapshots: dict[SnapshotStream, float] = {}  # stream -> last progress
        # Batched streams: a tracker per KVBATCH that libzmq has not yet written
        # to the connection, oldest first (see _BATCHES_IN_FLIGHT).
        self._in_flight: dict[SnapshotStream, deque[zmq.MessageTracker]] = {}
        # Deferred votes by (identity, subtree), oldest first (all have the same
        # maximum age, so insertion order is expiry order).
        self._deferred: dict[tuple[bytes, str], _DeferredVote] = {}
        self._deferred_timer: object | None = None
        self._deferred_streams: set[SnapshotStream] = set()  # served from _deferred
        self._outq: deque[list[bytes]] = deque()
        self._outq_scheduled = False
        self._peer_sub: ZMQStream | None = None
        self._peer_dealer: ZMQStream | None = None
        self._sync_progress = 0.0
        self._sync_started = 0.0
        self._hugz_timer: object | None = None
        self._house_timer: object | None = None
        self._stats_timer: object | None = None
        self._next_hugz = 0.0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "snapshots_served",
                "snapshots_aborted",
                "snapshots_refused",
                "votes_deferred",
                "votes_deferred_served",
                "votes_deferred_expired",
                "votes_deferred_overflow",
                "votes_deferred_gone",
                "snapshot_stalls",
                "snapshot_entries_sent",
                "snapshots_batched",
                "snapshot_batches_sent",
                "hugz_sent",
                "heartbeat_max_late_ms",
                "outq_dropped",
                "sync_timeouts",
                "internal_errors",
            ),
            0,
        )

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
        self._ready.set()
        try:
            loop.start()
        finally:
            if handle_signals:
                for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
                    loop.asyncio_loop.remove_signal_handler(sig)
            self._close_all()
            loop.close(all_fds=False)
            if self._own_ctx:
                self._ctx.term()
            log.info("server stopped")

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
        out["outq"] = len(self._outq)
        out["mode"] = self.config.mode.value
        ha = self._ha
        if ha is not None:
            out["ha_state"] = ha.state.name.lower()
            counters = ha.counters
            out["ha_state_messages_received"] = counters.state_messages_received
            out["ha_malformed_messages"] = counters.malformed_peer_messages
        return out

    def log_stats(self, level: int = logging.DEBUG) -> None:
        """One line an operator can read (SIGUSR1 logs it at INFO)."""
        s = self.stats()
        invalid = sum(int(s[k]) for k in ("kvset_invalid", "snapshot_invalid", "peer_invalid"))
        log.log(
            level,
            "stats: %s seq=%s keys=%s ephemeral=%s pending=%s kvset=%s published=%s "
            "invalid=%s dup=%s snapshots=%s/%s batched=%s aborted=%s refused=%s gaps=%s "
            "syncs=%s/%s "
            "pending_dropped=%s late_ms=%s deferred_votes=%s served=%s expired=%s held=%s "
            "errors=%s",
            s["role"],
            s["sequence"],
            s["keys"],
            s["ephemeral_keys"],
            s["pending"],
            s["kvset_received"],
            s["kvpub_published"],
            invalid,
            s["kvset_duplicate"],
            s["snapshots_served"],
            s["snapshot_requests"],
            s["snapshots_batched"],
            s["snapshots_aborted"],
            s["snapshots_refused"],
            s["peer_gaps"],
            s["syncs_completed"],
            s["syncs_started"],
            s["pending_dropped"],
            s["heartbeat_max_late_ms"],
            s["votes_deferred"],
            s["votes_deferred_served"],
            s["votes_deferred_expired"],
            s["votes_deferred_held"],
            s["internal_errors"],
        )
        log.log(level, "counters: %s", json.dumps(s, sort_keys=True))

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
        router = self._socket(zmq.ROUTER)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, cfg.snapshot_hwm)
        router.bind(f"{base}:{cfg.port + SNAPSHOT_OFFSET}")
        self._router = router
        pub = self._socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.pub_hwm)
        pub.bind(f"{base}:{cfg.port + PUBLISHER_OFFSET}")
        self._pub = pub
        collector = self._socket(zmq.SUB)
        collector.setsockopt(zmq.RCVHWM, cfg.collector_hwm)
        collector.setsockopt(zmq.SUBSCRIBE, b"")
        collector.bind(f"{base}:{cfg.port + COLLECTOR_OFFSET}")
        self._collector = collector
        # Zero-copy frames: only a Frame can tell the requester's ZMTP metadata.
        self._on_router_guarded = self._guard(self._on_router)
        self._stream(router, self._on_router, copy=False)
        self._stream(collector, self._on_collector)
        if cfg.mode is not ServerMode.STANDALONE:
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
            )
            ha.on_active(self._on_became_active)
            ha.on_passive(self._on_became_passive)
            self._ha = ha
            ha.start()
        self._next_hugz = loop.time() + cfg.heartbeat
        self._hugz_timer = loop.call_at(self._next_hugz, self._on_heartbeat)
        self._house_timer = loop.call_later(_HOUSEKEEPING, self._on_housekeeping)
        if cfg.stats_interval > 0:
            self._stats_timer = loop.call_later(cfg.stats_interval, self._on_stats_timer)
        peer = (
            f"; peer {cfg.peer}, binary star {base}:{cfg.ha_port} <-> {_tcp(cfg.peer_ha or '')}"
            if cfg.mode is not ServerMode.STANDALONE
            else ""
        )
        log.info(
            "%s server: snapshots %s:%d, updates %s:%d, collector %s:%d, heartbeat %.3f s%s",
            cfg.mode.value,
            base,
            cfg.port,
            base,
            cfg.port + 1,
            base,
            cfg.port + 2,
            cfg.heartbeat,
            peer,
        )
        if cfg.mode is ServerMode.STANDALONE:
            log.info("standalone: active at once")

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind != zmq.PUB:
            cap_message_size(sock)
        return sock

    def _stream(
        self, sock: zmq.Socket, handler: Callable[[list[_F]], None], *, copy: bool = True
    ) -> ZMQStream:
        """``handler`` gets bytes, or ``zmq.Frame``s with ``copy=False``."""
        assert self._loop is not None
        stream = ZMQStream(sock, self._loop)
        stream.on_recv(self._guard(handler), copy=copy)
        self._streams.append(stream)
        return stream

    def _guard(self, handler: Callable[[list[_F]], None]) -> Callable[[list[_F]], None]:
        """Wrap a socket handler so that a bug is logged, never fatal."""

        def guarded(frames: list[_F]) -> None:
            try:
                handler(frames)
            except Exception:
                self.counters["internal_errors"] += 1
                log.exception("internal error in %s", handler.__name__)

        return guarded

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
        if self._ha is not None:
            self._ha.stop()
        self._close_peer()
        self._snapshots.clear()
        self._in_flight.clear()
        self._outq.clear()
        for stream in self._streams:
            stream.close(linger=0)
        self._streams.clear()
        for sock in (self._router, self._pub, self._collector):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    # -- timers --------------------------------------------------------------

    def _on_heartbeat(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        # How late the reactor ran this timer: the operator's measure of a
        # blocked loop (and what clients would see as a heartbeat gap).
        late_ms = int((loop.time() - self._next_hugz) * 1000)
        if late_ms > self.counters["heartbeat_max_late_ms"]:
            self.counters["heartbeat_max_late_ms"] = late_ms
            if late_ms > 1000 * self.config.heartbeat:
                log.warning("heartbeat ran %d ms late: the reactor was blocked", late_ms)
        try:
            if self.core.role is Role.ACTIVE:
                self._publish(self.core.hugz(self._heartbeat_ms))
                self.counters["hugz_sent"] += 1
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in heartbeat")
        # Fixed rate; after a stall skip ahead rather than burst.
        self._next_hugz += self.config.heartbeat
        now = loop.time()
        if self._next_hugz <= now:
            self._next_hugz = now + self.config.heartbeat
        self._hugz_timer = loop.call_at(self._next_hugz, self._on_heartbeat)

    def _on_housekeeping(self) -> None:
        loop = self._loop
        if loop is None or self._stopping:
            return
        delay = _HOUSEKEEPING
        try:
            now = self._wallclock()
            for frames in self.core.tick(now):
                self._publish(frames)
            if self.core.expiry_due(now):
                delay = 0.0  # more due than one batch: continue next turn
            self._check_sync_timeout()
            self._check_stalled_snapshots()
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

    # -- publishing ----------------------------------------------------------

    def _publish(self, frames: list[bytes]) -> None:
        """Publish in order: behind the bulk queue if it is not empty."""
        if self._outq:
            self._outq.append(frames)
        else:
            assert self._pub is not None
            send_frames(self._pub, frames)

    def _publish_bulk(self, batch: list[list[bytes]]) -> None:
        if not batch:
            return
        self._outq.extend(batch)
        self._schedule_outq()

    def _schedule_outq(self) -> None:
        if not self._outq_scheduled and self._loop is not None:
            self._outq_scheduled = True
            self._loop.add_callback(self._drain_outq)

    def _drain_outq(self) -> None:
        self._outq_scheduled = False
        pub = self._pub
        if pub is None or pub.closed:
            return
        q = self._outq
        for _ in range(self.config.snapshot_chunk):
            if not q:
                return
            send_frames(pub, q.popleft())
        if q:
            self._schedule_outq()

    # -- the collector: client updates ---------------------------------------

    def _on_collector(self, frames: list[bytes]) -> None:
        core = self.core
        sock = self._collector
        assert sock is not None
        wallclock = self._wallclock
        publish = self._publish
        clock = self._clock
        stop_at = clock() + _TURN_BUDGET
        batch = self.config.collector_batch
        while True:
            try:
                out = core.on_kvset(frames, wallclock())
            except ProtocolError as exc:
                self._throttle.log("kvset", logging.WARNING, "dropped a client update: %s", exc)
            else:
                if out is not None:
                    publish(out)
            batch -= 1
            if self._turn_over(batch, stop_at):
                return
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return

    # -- the snapshot port ---------------------------------------------------

    def _on_router(self, parts: list[zmq.Frame]) -> None:
        identity = parts[0].bytes
        batch = len(parts) > 1 and _wants_batches(parts[1])
        applied = len(parts) > 1 and _wants_applied(parts[1])
        frames = [part.bytes for part in parts[1:]]
        try:
            subtree = self.core.snapshot_request(frames)
        except ProtocolError as exc:
            self._throttle.log(
                "icanhaz", logging.WARNING, "dropped a request from %s: %s", _who(identity), exc
            )
            return
        ha = self._ha
        if ha is not None and not ha.accept_vote():
            # Binary Star: a server that may not serve stays silent.  If only
            # the peer's not-yet-expired heartbeat stands in the way, hold the
            # request and vote again when it expires; otherwise the client
            # times out and fails over to the other server.
            if not self._defer_vote(identity, subtree, batch, applied):
                self.counters["snapshots_refused"] += 1
                log.debug("snapshot request from %s not served (%s)", _who(identity), ha.state.name)
            return
        # Served now: a held copy of the same request must not be served again.
        self._deferred.pop((identity, subtree), None)
        self._serve(identity, subtree, batch=batch, applied=applied)

    def _serve(
        self,
        identity: bytes,
        subtree: str,
        *,
        deferred: bool = False,
        batch: bool = False,
        applied: bool = False,
    ) -> None:
        """Stream a snapshot for an accepted vote (in KVBATCHes if ``batch``,
        after the applied-update list if ``applied``)."""
        if self.core.role is not Role.ACTIVE:
            # The vote was accepted; make sure the promotion happened first.
            self._on_became_active()
        if len(self._snapshots) >= self.config.max_snapshots:
            self.counters["snapshots_refused"] += 1
            self._throttle.log(
                "snapshots_full",
                logging.WARNING,
                "%d snapshots already in flight; request from %s not served",
                len(self._snapshots),
                _who(identity),
            )
            return
        stream = self.core.open_snapshot(
            identity, subtree, batch=batch, applied=applied, now=self._wallclock()
        )
        self._snapshots[stream] = self._clock()
        if batch:
            self._in_flight[stream] = deque()
        if deferred:
            self._deferred_streams.add(stream)
        log.debug(
            "snapshot for %s: subtree %r, up to %d keys at sequence %d%s",
            _who(identity),
            subtree,
            stream.total_keys,
            stream.sequence,
            ", batched" if batch else "",
        )
        self._pump(stream)

    def _pump(self, stream: SnapshotStream) -> None:
        """Send one chunk of ``stream``, then yield to the loop."""
        if stream not in self._snapshots or self._loop is None:
            return  # aborted meanwhile
        sock = self._router
        assert sock is not None
        sent_before = stream.sent
        stop_at = self._clock() + _TURN_BUDGET
        # A KVBATCH is thousands of entries: check the clock before each one.
        check = 0 if stream.batch else _BUDGET_CHECK
        in_flight = self._in_flight.get(stream)
        try:
            for n in range(self.config.snapshot_chunk):
                if n & check == check and self._clock() > stop_at:
                    break
                if in_flight is not None:
                    while in_flight and in_flight[0].done:
                        in_flight.popleft()
                    if len(in_flight) >= _BATCHES_IN_FLIGHT:
                        self._stall(stream, sent_before)
                        return
                frames = stream.peek()
                if frames is None:
                    # Done, or a long run of keys outside the subtree was
                    # skipped: either way, give the loop back.
                    break
                try:
                    if in_flight is None:
                        send_frames(sock, frames, NOBLOCK)
                    else:
                        in_flight.append(send_tracked(sock, frames, NOBLOCK))
                except zmq.Again:
                    # The requester's pipe is full: wait for it, drop nothing.
                    self._stall(stream, sent_before)
                    return
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.EHOSTUNREACH:
                        self._abort_snapshot(stream, "requester went away", gone=True)
                        return
                    raise
                stream.advance()
                if stream.done:
                    break
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error while streaming a snapshot")
            self._abort_snapshot(stream, "internal error")
            return
        self._note_progress(stream, sent_before)
        self._take_router_backlog()
        if stream.done:
            del self._snapshots[stream]
            self._in_flight.pop(stream, None)
            self._deferred_streams.discard(stream)
            c = self.counters
            c["snapshots_served"] += 1
            c["snapshot_entries_sent"] += stream.sent
            if stream.batch:
                c["snapshots_batched"] += 1
                c["snapshot_batches_sent"] += stream.batches_sent
            log.debug(
                "snapshot for %s done: %d entries in %d messages, sequence %d",
                _who(stream.identity),
                stream.sent,
                stream.batches_sent if stream.batch else stream.sent,
                stream.sequence,
            )
            return
        self._loop.add_callback(self._pump, stream)

    def _take_router_backlog(self) -> None:
        """Handle snapshot requests that our own sends may have hidden.

        The pump sends on the ROUTER directly, and a send can consume the edge
        of the socket's file descriptor that announces a new request: the
        ZMQStream then never wakes for it, and a request that came in during
        a long snapshot could wait until something else stirred the socket
        (seen: 10 s).  So after sending we ask the socket itself.
        """
        sock = self._router
        if sock is None or sock.closed:
            return
        for _ in range(_ROUTER_BACKLOG_BATCH):
            if not sock.poll(0, POLLIN):
                return
            try:
                parts = sock.recv_multipart(NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._on_router_guarded(parts)

    def _stall(self, stream: SnapshotStream, sent_before: int) -> None:
        """The requester is not keeping up: try again shortly, drop nothing."""
        assert self._loop is not None
        self.counters["snapshot_stalls"] += 1
        self._note_progress(stream, sent_before)
        self._loop.call_later(_STALL_RETRY, self._pump, stream)

    def _note_progress(self, stream: SnapshotStream, sent_before: int) -> None:
        if stream.sent != sent_before and stream in self._snapshots:
            self._snapshots[stream] = self._clock()

    def _abort_snapshot(self, stream: SnapshotStream, why: str, *, gone: bool = False) -> None:
        if self._snapshots.pop(stream, None) is None:
            return
        self._in_flight.pop(stream, None)
        if stream in self._deferred_streams:
            self._deferred_streams.discard(stream)
            if gone and stream.sent == 0:
                # Expected: the client asked again on a fresh DEALER (or moved
                # on) while its request was held; its old socket is closed.
                self.counters["votes_deferred_gone"] += 1
                log.debug(
                    "deferred snapshot request from %s: requester gone", _who(stream.identity)
                )
                return
        self.counters["snapshots_aborted"] += 1
        self._throttle.log(
            "snapshot_abort",
            logging.INFO,
            "snapshot for %s aborted after %d entries: %s",
            _who(stream.identity),
            stream.sent,
            why,
        )

    def _check_stalled_snapshots(self) -> None:
        if not self._snapshots:
            return
        cutoff = self._clock() - self.config.snapshot_stall_timeout
        for stream, last in list(self._snapshots.items()):
            if last < cutoff:
                self._abort_snapshot(stream, "requester stopped reading")

    # -- deferred votes --------------------------------------------------------

    def _defer_vote(self, identity: bytes, subtree: str, batch: bool, applied: bool) -> bool:
        """Hold a refused vote if it may be accepted once the peer expires."""
        ha = self._ha
        limit = self.config.max_deferred_votes
        if ha is None or limit == 0 or ha.state.name not in _DEFERRING_STATES:
            return False
        key = (identity, subtree)
        if key in self._deferred:
            return True  # the same request again (a Guide client re-asks so)
        if len(self._deferred) >= limit:
            oldest = next(iter(self._deferred))
            del self._deferred[oldest]
            self.counters["votes_deferred_overflow"] += 1
            self.counters["snapshots_refused"] += 1
            self._throttle.log(
                "deferred_overflow",
                logging.WARNING,
                "%d snapshot requests held for a vote; dropped the oldest",
                limit,
            )
        now = self._clock()
        age = self.config.effective_deferred_vote_max_age
        self._deferred[key] = _DeferredVote(identity, subtree, now + age, batch, applied)
        self.counters["votes_deferred"] += 1
        log.debug(
            "snapshot request from %s held (%s, peer expires in %.3f s)",
            _who(identity),
            ha.state.name,
            ha.peer_expiry - now,
        )
        self._schedule_deferred_check()
        return True

    def _schedule_deferred_check(self) -> None:
        """A timer at the peer's expiry or the oldest vote's, whichever is first."""
        loop, ha = self._loop, self._ha
        if loop is None or ha is None or self._stopping:
            return
        if self._deferred_timer is not None:
            loop.remove_timeout(self._deferred_timer)
            self._deferred_timer = None
        if not self._deferred:
            return
        oldest = next(iter(self._deferred.values()))
        at = min(ha.peer_expiry, oldest.expires_at)
        delay = max(0.0, at - self._clock())
        self._deferred_timer = loop.call_later(delay, self._on_deferred_timer)

    def _on_deferred_timer(self) -> None:
        self._deferred_timer = None
        self._recheck_deferred_guarded()

    def _recheck_deferred_soon(self) -> None:
        if self._loop is not None:
            self._loop.add_callback(self._recheck_deferred_guarded)

    def _recheck_deferred_guarded(self) -> None:
        try:
            self._recheck_deferred()
        except Exception:
            self.counters["internal_errors"] += 1
            log.exception("internal error in the deferred-vote check")

    def _recheck_deferred(self) -> None:
        """Age out held votes; vote again with the rest if they may be accepted now."""
        if self._stopping or not self._deferred:
            return
        held = self._deferred
        now = self._clock()
        while held:
            key, vote = next(iter(held.items()))
            if vote.expires_at > now:
                break
            del held[key]
            self.counters["votes_deferred_expired"] += 1
            self.counters["snapshots_refused"] += 1
            log.debug("snapshot request from %s aged out unanswered", _who(vote.identity))
        ha = self._ha
        if not held or ha is None or not ha.running:
            self._schedule_deferred_check()
            return
        if ha.state.name != "ACTIVE" and now < ha.peer_expiry:
            # Still alive: voting now would only be refused (and counted).
            self._schedule_deferred_check()
            return
        stop_at = now + _TURN_BUDGET
        while held:
            key, vote = next(iter(held.items()))
            del held[key]
            if not ha.accept_vote():
                # Refused although the peer has expired (not a state that votes
                # can change); it will not get better.
                self.counters["votes_deferred_expired"] += 1
                self.counters["snapshots_refused"] += 1
                continue
            self.counters["votes_deferred_served"] += 1
            log.debug("serving the held snapshot request from %s", _who(vote.identity))
            self._serve(
                vote.identity, vote.subtree, deferred=True, batch=vote.batch, applied=vote.applied
            )
            if held and self._clock() > stop_at:
                # Each serve sends a first chunk; yield to the loop between turns.
                self._recheck_deferred_soon()
                return
        self._schedule_deferred_check()

    # -- roles ---------------------------------------------------------------

    def _on_became_active(self) -> None:
        core = self.core
        if core.role is Role.ACTIVE:
            return
        was = core.role
        taken = self._take_peer_backlog()
        self._take_collector_backlog()
        pending = len(core.pending)
        batch = core.become_active(self._wallclock())
        self._close_peer()
        self._publish_bulk(batch)
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
        self._publish(core.hugz(self._heartbeat_ms))
        if self._deferred:
            self._recheck_deferred_soon()  # not from here: we may be inside accept_vote()

    def _take_peer_backlog(self) -> int:
        """Before a promotion, take every message the old active already sent.

        A busy passive may hold thousands of the old active's KVPUBs unread in
        its SUB queue; clients may have seen them (confirmed writes), and once
        the socket is closed they are gone.  So they are applied first, in
        order, like any followed update (a gap stops that, and the pending list
        covers the rest).  Returns how many messages were taken.
        """
        sub = self._peer_sub
        if sub is None or sub.closed():
            return 0
        return self._take_backlog(
            sub.socket, self.core.on_peer_update, "peer_update", "a message from the peer"
        )

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
        self._take_backlog(sock, self.core.on_kvset, "kvset", "a client update")

    def _take_backlog(
        self,
        sock: zmq.Socket,
        handle: Callable[[list[bytes], float], object],
        kind: str,
        what: str,
    ) -> int:
        """Hand every message queued on ``sock`` to ``handle`` now; how many.

        Bounded by the socket's high-water mark, and done once per promotion;
        bad input is logged (rate-limited by ``kind``) and skipped.
        """
        now = self._wallclock()
        taken = 0
        while True:
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return taken
            taken += 1
            try:
                handle(frames, now)
            except ProtocolError as exc:
                self._throttle.log(kind, logging.WARNING, "dropped %s: %s", what, exc)

    def _on_became_passive(self) -> None:
        core = self.core
        was = core.role
        core.become_passive()
        for stream in list(self._snapshots):
            self._abort_snapshot(stream, "server became passive")
        if self._outq:
            self.counters["outq_dropped"] += len(self._outq)
            self._outq.clear()
        log.warning(
            "now PASSIVE (was %s): following the active server at %s", was.value, self.config.peer
        )
        self._follow()

    # -- following the active peer -------------------------------------------

    def _follow(self) -> None:
        cfg = self.config
        assert cfg.peer is not None
        if self._peer_sub is None:
            sub = self._socket(zmq.SUB)
            sub.setsockopt(zmq.RCVHWM, cfg.collector_hwm)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(_peer_base(cfg.peer, PUBLISHER_OFFSET))
            self._peer_sub = self._stream(sub, self._on_peer_update)
        self._sync_started = self._clock()
        self._request_snapshot()

    def _request_snapshot(self) -> None:
        """(Re)start a sync on a fresh DEALER, so stale replies cannot mix in."""
        cfg = self.config
        assert cfg.peer is not None
        self._close_dealer()
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.RCVHWM, cfg.snapshot_hwm)
        # Ask for KVBATCHes (our peer is one of us): a restart resyncs faster.
        try:
            dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
            # ... and for the ids it applied, to reconcile our pending list.
            dealer.setsockopt(zmq.METADATA, APPLIED_METADATA)
            cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
        except zmq.ZMQError:  # a libzmq older than 4.3: the standard stream
            log.debug("this libzmq cannot send ZMTP metadata; syncing without KVBATCH")
        dealer.connect(_peer_base(cfg.peer, SNAPSHOT_OFFSET))
        self._peer_dealer = self._stream(dealer, self._on_sync_reply)
        self.core.start_sync()
        self._sync_progress = self._clock()
        try:
            dealer.send_multipart(encode_icanhaz(""), zmq.NOBLOCK)
        except zmq.Again:
            pass  # the sync timeout retries
        log.debug("asked %s for a snapshot", cfg.peer)

    def _check_sync_timeout(self) -> None:
        core = self.core
        if core.role is not Role.PASSIVE or core.sync_state is not SyncState.SYNCING:
            return
        now = self._clock()
        if now - self._sync_progress < self.config.effective_sync_timeout:
            return
        self.counters["sync_timeouts"] += 1
        self._throttle.log(
            "sync_timeout",
            logging.WARNING,
            "no snapshot from the active server at %s for %.1f s; asking again",
            self.config.peer,
            now - self._sync_progress,
        )
        self._request_snapshot()

    def _turn_over(self, budget: int, stop_at: float) -> bool:
        """Whether a draining handler should give the loop back now.

        Out of messages for this turn, or (checked every 64 messages, since a
        clock read is not free) out of time.  Handlers ask this before they
        receive the next message, so nothing received is ever left unhandled.
        """
        return budget <= 0 or (budget & _BUDGET_CHECK == 0 and self._clock() > stop_at)

    def _on_peer_update(self, frames: list[bytes]) -> None:
        sub = self._peer_sub
        core = self.core
        stop_at = self._clock() + _TURN_BUDGET
        now = self._wallclock()
        budget = self.config.collector_batch
        while True:
            try:
                outcome = core.on_peer_update(frames, now)
            except ProtocolError as exc:
                self._throttle.log(
                    "peer_update", logging.WARNING, "dropped a message from the peer: %s", exc
                )
            else:
                if outcome is FollowOutcome.RESYNC:
                    self._throttle.log(
                        "gap",
                        logging.INFO,
                        "missed updates from the active server (have %d, it is at %d); resyncing",
                        core.store.sequence,
                        core.highest_seen,
                    )
                    self._request_snapshot()
            # Decide to yield *before* taking the next message, never after:
            # a message received and then abandoned is lost for good.
            budget -= 1
            if self._turn_over(budget, stop_at):
                return
            if sub is None or sub is not self._peer_sub or sub.closed():
                return
            try:
                frames = recv_frames(sub.socket)
            except zmq.Again:
                return

    def _on_sync_reply(self, frames: list[bytes]) -> None:
        dealer = self._peer_dealer
        core = self.core
        self._sync_progress = stop_at = self._clock()
        stop_at += _TURN_BUDGET
        now = self._wallclock()
        budget = self.config.collector_batch
        while True:
            try:
                outcome = core.on_snapshot_reply(frames, now)
            except ProtocolError as exc:
                self._throttle.log(
                    "sync_reply", logging.WARNING, "dropped a snapshot entry from the peer: %s", exc
                )
                outcome = FollowOutcome.OK
            if outcome is FollowOutcome.SYNCED:
                log.info(
                    "synced from %s: %d keys at sequence %d in %.2f s",
                    self.config.peer,
                    len(core.store),
                    core.store.sequence,
                    self._clock() - self._sync_started,
                )
                assert self._loop is not None
                self._loop.add_callback(self._close_dealer_if, dealer)
                return
            if outcome is FollowOutcome.RESYNC:
                self._throttle.log("gap", logging.INFO, "updates missed during the sync; resyncing")
                self._request_snapshot()
                return
            budget -= 1
            if self._turn_over(budget, stop_at):
                return
            if len(frames) > 5 and self._clock() > stop_at:
                return  # a KVBATCH is thousands of entries: check after each one
            if dealer is None or dealer is not self._peer_dealer or dealer.closed():
                return
            try:
                frames = recv_frames(dealer.socket)
            except zmq.Again:
                return

    def _close_dealer_if(self, dealer: ZMQStream | None) -> None:
        if dealer is not None and dealer is self._peer_dealer:
            self._close_dealer()

    def _close_dealer(self) -> None:
        dealer, self._peer_dealer = self._peer_dealer, None
        if dealer is not None:
            self._forget(dealer)

    def _close_peer(self) -> None:
        self._close_dealer()
        sub, self._peer_sub = self._peer_sub, None
        if sub is not None:
            self._forget(sub)

    def _forget(self, stream: ZMQStream) -> None:
        if stream in self._streams:
            self._streams.remove(stream)
        stream.close(linger=0)
