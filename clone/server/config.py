"""What a server is told at start: :class:`ServerConfig` and :class:`ServerMode`.

Plain data checked once in ``__post_init__``, so that the command line, the
tests and the tools build the same validated object and the reactor never
re-checks a limit on its hot paths.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from clone.server.core import CoreSettings
from clone.server.subscriptions import (
    DEFAULT_MAX_SUBSCRIBER_BYTES,
    DEFAULT_MAX_SUBSCRIPTION_BYTES,
    DEFAULT_MAX_SUBSCRIPTIONS,
)
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS, DEFAULT_MISSED_HEARTBEATS

__all__ = ["FSYNC_POLICIES", "PEER_WAIT_DEFAULT", "ServerConfig", "ServerMode"]

#: The ``--fsync`` choices, as clone.storage.FsyncPolicy values.
FSYNC_POLICIES = ("always", "batch", "off")
#: Seconds a durable server that has never heard its peer waits before it may
#: serve its own state (docs/operations.md, "Cold start").
PEER_WAIT_DEFAULT = 10.0


class ServerMode(enum.Enum):
    """Which member of a pair this server is (or none: standalone, or a relay
    of a pair: docs/operations.md, "Relays")."""

    PRIMARY = "primary"
    BACKUP = "backup"
    STANDALONE = "standalone"
    RELAY = "relay"


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
    #: Seconds a snapshot requester may read nothing before its stream is
    #: aborted and its slot freed (docs/operations.md, "Limits").
    snapshot_stall_timeout: float = 10.0
    #: Seconds an active stopping with a live passive waits until the passive
    #: holds everything it applied (clone.server.handover); 0: no handover.
    handover_timeout: float = 0.5
    #: Seconds a snapshot requester may read nothing, with every slot taken,
    #: before a new request takes its slot (docs/operations.md, "Limits").
    snapshot_slot_idle: float = 0.25
    #: Seconds a connection to one of our bound sockets may take over its
    #: ZMTP handshake (libzmq's HANDSHAKE_IVL, 30 s by default): a connection
    #: the door refused (status 300) is held open that long otherwise.
    handshake_timeout: float = 10.0
    max_snapshots: int = 64
    #: Bytes of all snapshot streams together that libzmq may hold unwritten
    #: (clone.server.snapwindow); each stream gets 1/max_snapshots of it.
    snapshot_bytes: int = 128 * 1024 * 1024
    #: Bytes one writer's connection may queue in the collector (P+2): its
    #: RCVHWM is this over the largest message (clone.server.budget).
    collector_bytes: int = 32 * 1024 * 1024
    collector_batch: int = 1_000
    sync_timeout: float = 0.0  # 0: max(5 heartbeats, 2 s)
    max_deferred_votes: int = 1_000
    deferred_vote_max_age: float = 0.0  # 0: 2 * ha_missed * heartbeat
    stats_interval: float = 60.0
    core: CoreSettings = field(default_factory=CoreSettings)
    #: Where the state is kept (docs/operations.md, "Durability"); None: in memory only.
    data_dir: str | None = None
    #: ``always`` (a commit per update), ``batch`` (one per loop turn) or ``off`` (no fsync).
    fsync: str = "batch"
    #: How long a paired server that has never heard its peer waits before it
    #: may serve its own, possibly older, state.  None: PEER_WAIT_DEFAULT with
    #: a data directory, 0 (the heartbeat expiry only) without.
    peer_wait: float | None = None
    #: A backup file (``clone backup``) to start from; it replaces the data directory's state.
    restore: str | None = None
    #: CURVE (docs/operations.md, "Securing a pair"): the pair's secret
    #: certificate, the directory of admitted clients' public certificates,
    #: and the ACL (None: every admitted client reads and writes everything).
    curve_secret: str | None = None
    clients_dir: str | None = None
    acl: str | None = None
    #: A relay's CURVE towards its upstream (docs/operations.md, "Relays"): its
    #: own client secret certificate, and the upstream's public certificate
    #: (the pair's, or an upstream relay's server certificate).  Independent
    #: of ``curve_secret``, which is what the relay serves its own clients with.
    upstream_curve_secret: str | None = None
    upstream_server_key: str | None = None
    #: Certificate names of relays whose ``caller=`` the pair believes
    #: (docs/operations.md, "Lease ownership through a relay").
    trusted_relays: frozenset[str] = frozenset()
    #: The HTTP port (docs/operations.md, "Monitoring"): /metrics, /healthz,
    #: /readyz and the status page, bound to ``bind``; None: off.
    http_port: int | None = None
    #: Seconds an HTTP connection may be idle or send one request's headers or
    #: body, and a status viewer may leave a ping unanswered (docs/operations.md, "Limits").
    http_idle_timeout: float = 30.0
    #: HTTP connections at once; 0: a quarter of the descriptor limit, at most 1024.
    http_max_connections: int = 0
    #: Status-page WebSocket viewers at once.
    http_viewers: int = 32
    #: Topics and bytes of topics one publisher connection may subscribe to;
    #: beyond them a subscription is refused, and a connection that keeps
    #: asking is dropped (docs/operations.md, "Limits"); 0: no limit.
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS
    max_subscription_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    #: Bytes published while a subscriber acknowledges nothing before the
    #: inbound watch cuts it off (clone.server.subscribers); 0: ``pub_hwm`` only.
    max_subscriber_bytes: int = DEFAULT_MAX_SUBSCRIBER_BYTES
    #: A relay's upstream: the CHP base ports (``host:port``) of the servers
    #: it relays, in the order it tries them (a pair's two, or another relay).
    upstream: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port <= 65535 - 2:
            raise ValueError(f"port {self.port} leaves no room for P+1 and P+2")
        if self.http_port is not None and not 0 < self.http_port <= 65535:
            raise ValueError(f"http_port must be in 1..65535, not {self.http_port}")
        if self.http_idle_timeout <= 0:
            raise ValueError(f"http_idle_timeout must be positive, not {self.http_idle_timeout}")
        if self.http_max_connections < 0 or self.http_viewers < 1:
            raise ValueError("http_max_connections must be >= 0 and http_viewers >= 1")
        if self.heartbeat <= 0:
            raise ValueError(f"heartbeat must be positive, not {self.heartbeat}")
        for name in (
            "pub_hwm",
            "collector_hwm",
            "snapshot_hwm",
            "max_subscriptions",
            "max_subscription_bytes",
            "max_subscriber_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit)")
        if self.deferred_vote_max_age < 0:
            raise ValueError("deferred_vote_max_age must be >= 0 (0 = 2 * missed heartbeats)")
        if self.max_deferred_votes < 0:
            raise ValueError("max_deferred_votes must be >= 0 (0 = never defer)")
        if self.handshake_timeout <= 0:
            raise ValueError(f"handshake_timeout must be positive, not {self.handshake_timeout}")
        if self.snapshot_slot_idle <= 0:
            raise ValueError(f"snapshot_slot_idle must be positive, not {self.snapshot_slot_idle}")
        if self.handover_timeout < 0:
            raise ValueError(f"handover_timeout must be >= 0, not {self.handover_timeout}")
        if self.snapshot_stall_timeout <= 0:
            raise ValueError(
                f"snapshot_stall_timeout must be positive, not {self.snapshot_stall_timeout}"
            )
        for name in ("snapshot_chunk", "collector_batch", "max_snapshots", "snapshot_bytes",
                     "collector_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.fsync not in FSYNC_POLICIES:
            choices = ", ".join(FSYNC_POLICIES)
            raise ValueError(f"fsync must be one of {choices}, not {self.fsync!r}")
        if self.peer_wait is not None and self.peer_wait < 0:
            raise ValueError(f"peer_wait must be >= 0, not {self.peer_wait}")
        if (self.curve_secret is None) != (self.clients_dir is None):
            raise ValueError(
                "--curve-secret and --clients go together: the pair's certificate and the"
                " directory of the clients it admits"
            )
        if self.trusted_relays and self.curve_secret is None:
            raise ValueError(
                "--trusted-relay needs --curve-secret and --clients: without CURVE no"
                " relay has a name to trust"
            )
        if self.acl is not None and self.curve_secret is None:
            raise ValueError(
                "--acl needs --curve-secret and --clients: without CURVE no client has a"
                " name to look up, so an ACL would protect nothing"
            )
        if self.restore is not None and self.data_dir is None:
            raise ValueError("restore needs a data directory (it replaces that directory's state)")
        if self.mode is ServerMode.RELAY:
            self._check_relay()
        elif self.upstream:
            raise ValueError("--upstream is for a relay (--relay) only")
        elif self.upstream_curve_secret is not None or self.upstream_server_key is not None:
            raise ValueError(
                "--upstream-curve-secret and --upstream-server-key are for a relay (--relay)"
                " only: a server of the pair connects to its peer with --curve-secret"
            )
        elif self.mode is not ServerMode.STANDALONE:
            missing = [n for n in ("peer", "ha_port", "peer_ha") if getattr(self, n) is None]
            if missing:
                raise ValueError(f"a {self.mode.value} server needs {', '.join(missing)}")

    def _check_relay(self) -> None:
        if not self.upstream:
            raise ValueError("a relay needs --upstream: the pair's CHP base ports, HOST:PORT,...")
        for host_port in self.upstream:
            host, _, port = host_port.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535 - 2:
                raise ValueError(f"upstream {host_port!r} is not HOST:PORT with room for P+2")
        if self.data_dir is not None or self.restore is not None:
            raise ValueError(
                "a relay keeps its copy in memory (it resyncs from the pair at start):"
                " no --data-dir or --restore"
            )
        if (self.upstream_curve_secret is None) != (self.upstream_server_key is None):
            raise ValueError(
                "--upstream-curve-secret and --upstream-server-key go together: the relay's"
                " own client certificate and its upstream's public certificate"
                " (docs/operations.md, \"Relays\")"
            )
        if self.peer is not None or self.ha_port is not None or self.peer_ha is not None:
            raise ValueError("a relay has no Binary Star peer: no --peer, --ha-port or --peer-ha")

    @property
    def effective_peer_wait(self) -> float:
        if self.peer_wait is not None:
            return self.peer_wait
        return PEER_WAIT_DEFAULT if self.data_dir is not None else 0.0

    @property
    def effective_sync_timeout(self) -> float:
        return self.sync_timeout or max(5 * self.heartbeat, 2.0)

    @property
    def effective_deferred_vote_max_age(self) -> float:
        return self.deferred_vote_max_age or 2 * self.ha_missed * self.heartbeat
