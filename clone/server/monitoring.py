"""What a server tells its HTTP port and its metrics: health, readiness, the page.

How this works: the HTTP port (:class:`~clone.server.http.HttpPort`) is a
part that reads its server only through the narrow
:class:`~clone.server.http.StatusSource`; :class:`Monitor` is the server's
side of that contract, a part of its own.  It owns what the counters do not
hold (the snapshot durations, the last changed keys, the role changes, the
last takeover), the port and the count of the publisher's connections, and
computes health, readiness, STATUS (:mod:`.status`) and the page's fields
from the core, Binary Star and the server's stats at each request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
from tornado.ioloop import IOLoop

from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore, SyncState
from clone.server.counting import DurationHistogram, PublisherWatch, publisher_events
from clone.server.rolelog import load_role_changes, save_role_changes
from clone.server.shared import Shared
from clone.server.status import PeerView, clone_version, server_status
from clone.storage.files import dir_bytes

if TYPE_CHECKING:
    from bstar.reactor import BinaryStar
    from clone.server.http import HttpPort

__all__ = ["RECENT_CHANGES", "ROLE_CHANGES", "Monitor"]

# The monitoring rings: the last changed keys (never values) and the last
# role changes, for the status page.
RECENT_CHANGES = 50
ROLE_CHANGES = 20


class Monitor:
    """Health, readiness, STATUS and the status page's fields; the HTTP port.

    A part of the server, and the :class:`~clone.server.http.StatusSource`
    its HTTP port reads.  Built with the config, the core, the shared clocks
    and counters, and four callbacks: ``ha`` (Binary Star, None unpaired or
    before the sockets are bound), ``curve`` (whether CURVE is on),
    ``stats`` (the server's counters and gauges) and ``serving`` (not
    stopping, no failed write).
    ``tests/server/test_monitor.py`` drives it alone.
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        *,
        ha: Callable[[], BinaryStar | None],
        curve: Callable[[], bool],
        stats: Callable[[], dict[str, int | float | str]],
        serving: Callable[[], bool],
    ) -> None:
        self.config = config
        self.core = core
        self.counters = shared.counters
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._shared = shared
        self._ha_of = ha
        self._curve = curve
        self.stats = stats
        self._serving = serving
        self._http: HttpPort | None = None
        self._publisher_watch: PublisherWatch | None = None
        #: How long each snapshot took to stream (the metrics' histogram).
        self.snapshot_seconds = DurationHistogram()
        #: (sequence, key) of the last updates committed, oldest first.
        self.recent_changes: deque[tuple[int, bytes]] = deque(maxlen=RECENT_CHANGES)
        #: (Unix time, from role, to role), oldest first.  A durable server
        #: keeps them across restarts (clone.server.rolelog).
        self.role_changes: deque[tuple[float, str, str]] = deque(
            load_role_changes(config.data_dir, ROLE_CHANGES) if config.data_dir else (),
            maxlen=ROLE_CHANGES,
        )
        # For STATUS? (clone.server.status): uptime, the last takeover (Unix
        # time; counted in counters["failovers"]) and our version.
        self._started_at = shared.clock()
        self.last_failover: float | None = None
        self._version = clone_version()

    @property
    def _ha(self) -> BinaryStar | None:
        return self._ha_of()

    # -- what the server tells it ----------------------------------------------

    def note_changes(self, updates: list[list[bytes]]) -> None:
        """Remember the keys (never the values) of the last updates of a commit."""
        if not updates:
            return
        ring = self.recent_changes
        for frames in updates[-RECENT_CHANGES:]:
            seq = frames[1]
            ring.append((int.from_bytes(seq, "big") if len(seq) == 8 else 0, frames[0]))

    def note_role(self, was: str, now: str) -> None:
        """A promotion or demotion, for the failover history."""
        self.role_changes.append((self._wallclock(), was, now))
        if self.config.data_dir is not None:
            save_role_changes(self.config.data_dir, self.role_changes)

    def note_failover(self) -> None:
        """We took over from a peer presumed dead."""
        self.counters["failovers"] += 1
        self.last_failover = self._wallclock()

    def status(self) -> dict[str, Any]:
        """This server's status (:mod:`clone.server.status`): gathered here, built there."""
        core = self.core
        cfg = self.config
        now = self._clock()
        peer: PeerView | None = None
        ha = self._ha
        if ha is not None:
            contact = ha.last_peer_contact
            peer_state = ha.peer_state
            peer = PeerView(
                endpoint=cfg.peer,
                ha_state=ha.state.name.lower(),
                epoch=ha.epoch,
                peer_state=None if peer_state is None else peer_state.name.lower(),
                peer_alive=ha.peer_alive,
                last_contact_age=None if contact is None else now - contact,
            )
        return server_status(
            role=core.role.value,
            mode=cfg.mode.value,
            sequence=core.store.sequence,
            keys=len(core.store),
            store_bytes=core.store.nbytes,
            pending=len(core.pending),
            sync_state=core.sync_state.value,
            term=core.term,
            uptime=now - self._started_at,
            version=self._version,
            data_dir=cfg.data_dir,
            data_dir_bytes=None if cfg.data_dir is None else dir_bytes(Path(cfg.data_dir)),
            curve=self._curve(),
            failovers=self.counters["failovers"],
            last_failover=self.last_failover,
            peer=peer,
            # Counted by the HTTP part (clone.server.http) when it watches the publisher.
            subscribers=self.subscribers,
            conflicts=core.conflicts.unresolved,
        )

    # -- the StatusSource the HTTP port reads ---------------------------------

    @property
    def subscribers(self) -> int | None:
        """Connections to the publisher, when counted (with --http-port)."""
        watch = self._publisher_watch
        count = watch.count if watch is not None else None
        return None if count is None else count.value

    @property
    def peer_alive(self) -> bool:
        ha = self._ha
        return ha is not None and ha.peer_alive

    def health(self) -> tuple[bool, str, int]:
        """Whether we serve (not stopping, no failed write), our role and sequence."""
        core = self.core
        return self._serving(), core.role.value, core.store.sequence

    def readiness(self) -> tuple[bool, str]:
        """Whether a failover to (or a read from) this server now loses nothing, and why."""
        core = self.core
        if not self._serving():
            return False, "stopping"
        role = core.role
        if role is Role.ACTIVE:
            return True, "active"
        if role is Role.STARTING:
            return False, "starting: Binary Star has not decided the role yet"
        if core.sync_state is not SyncState.SYNCED:
            return False, f"passive and {core.sync_state.value}: not in step with the active"
        pending = len(core.pending)
        if pending:
            return False, f"passive with {pending} client updates pending"
        return True, "passive, in step with the active"

    def page_fields(self) -> dict[str, Any]:
        """What the status page shows, but the update rate (the HTTP port's)."""
        out = dict(self.status())
        out["subscribers"] = self.subscribers
        ready, reason = self.readiness()
        cfg = self.config
        core = cfg.core
        stats = self.stats()
        hist = self.snapshot_seconds
        out.update(
            time=self._wallclock(),
            ready=ready,
            ready_reason=reason,
            heartbeat=cfg.heartbeat,
            recent=[
                {"sequence": seq, "key": key.decode("utf-8", "replace")}
                for seq, key in reversed(self.recent_changes)
            ],
            role_changes=[
                {"time": t, "from": was, "to": now} for t, was, now in reversed(self.role_changes)
            ],
            limits={
                "max_keys": core.max_keys,
                "max_bytes": core.max_bytes,
                "max_snapshots": cfg.max_snapshots,
                "pending_max": core.pending_max,
                "pending_max_age": core.pending_max_age,
                "dedup_window": core.dedup_window,
                "history_max": core.history_max,
                "pub_hwm": cfg.pub_hwm,
            },
            snapshots={"count": hist.count, "seconds_total": round(hist.total, 6)},
            counters={k: v for k, v in sorted(stats.items()) if isinstance(v, int | float)},
        )
        return out

    def page_status(self) -> dict[str, Any]:
        """What the status page shows (with the rate, once the port is open)."""
        port = self._http
        return port.page_status() if port is not None else self.page_fields()

    def http_counters(self) -> dict[str, int]:
        """The HTTP port's bounds at work, for :meth:`stats` (empty without --http-port)."""
        port = self._http
        return port.counters() if port is not None else {}

    # -- life cycle -----------------------------------------------------------

    def open_http(self, loop: IOLoop) -> None:
        """Bind the HTTP port (if configured); serving starts with the loop."""
        if self.config.http_port is None:
            return
        # Imported here: tornado.web, its HTTP server and prometheus_client are
        # a quarter of a server's start-up imports, and most servers have no
        # HTTP port (docs/testing.md, "Ninth pass").
        from clone.server.http import HttpPort

        port = HttpPort(self.config, self._shared, loop, self)
        self._http = port
        port.open()

    def close_http(self) -> None:
        port, self._http = self._http, None
        if port is not None:
            port.close()
        if self._publisher_watch is not None:
            self._publisher_watch.close()

    def watch_subscribers(self, pub: zmq.Socket[Any], secure: bool) -> zmq.Socket[Any]:
        """``pub``'s monitor socket, for the inbound watch (clone.server.subscribers),
        whose events the server hands to :meth:`on_pub_event`; with --http-port they
        also count the connections."""
        if self.config.http_port is not None:
            if self._publisher_watch is None:
                self._publisher_watch = PublisherWatch()
            self._publisher_watch.watch(secure)
        monitor = pub.get_monitor_socket(publisher_events(secure))
        monitor.setsockopt(zmq.LINGER, 0)
        return monitor

    def on_pub_event(self, event: int) -> None:
        """An event of the publisher's monitor: a connection counted."""
        if self._publisher_watch is not None:
            self._publisher_watch.on_event(event)
