"""What a server tells its HTTP port and its metrics: health, readiness, the page.

How this works: the HTTP port (:class:`~clone.server.http.HttpPort`) is a
part that reads its server only through the narrow
:class:`~clone.server.http.StatusSource`; this mixin is the server's side of
that contract, computed from the core and the other duties' state at each
request, and it owns the port and the count of the publisher's connections.

Why this is still a mixin: the page's fields come from nearly every duty
(the snapshot port's status, the stats, the monitoring rings, Binary Star),
which are mixins this round; the port itself no longer sees any of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import zmq

from clone.server.base import ServerBase
from clone.server.core import Role, SyncState
from clone.server.http import HttpPort, PublisherWatch, publisher_events

__all__ = ["MonitoringMixin"]


class MonitoringMixin(ServerBase):
    """Health, readiness and the status page's fields; the HTTP port."""

    _http: HttpPort | None = None
    _publisher_watch: PublisherWatch | None = None

    if TYPE_CHECKING:

        def _status(self) -> dict[str, Any]: ...

        def stats(self) -> dict[str, int | float | str]: ...

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
        serving = not self._stopping and self.durability.error is None
        return serving, core.role.value, core.store.sequence

    def readiness(self) -> tuple[bool, str]:
        """Whether a failover to (or a read from) this server now loses nothing, and why."""
        core = self.core
        if self._stopping or self.durability.error is not None:
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
        out = dict(self._status())
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

    def _open_http(self) -> None:
        """Bind the HTTP port (if configured); serving starts with the loop."""
        if self.config.http_port is None:
            return
        assert self._loop is not None
        port = HttpPort(self.config, self.shared, self._loop, self)
        self._http = port
        port.open()

    def _close_http(self) -> None:
        port, self._http = self._http, None
        if port is not None:
            port.close()
        if self._publisher_watch is not None:
            self._publisher_watch.close()

    def _watch_subscribers(self, pub: zmq.Socket[Any]) -> zmq.Socket[Any]:
        """``pub``'s monitor socket, for the inbound watch (clone.server.subscribers),
        which hands its events to :meth:`_on_pub_monitor`; with --http-port they
        also count the connections."""
        secure = self.security.keypair is not None
        if self.config.http_port is not None:
            if self._publisher_watch is None:
                self._publisher_watch = PublisherWatch()
            self._publisher_watch.watch(secure)
        monitor = pub.get_monitor_socket(publisher_events(secure))
        monitor.setsockopt(zmq.LINGER, 0)
        return monitor

    def _on_pub_monitor(self, event: int, value: int) -> None:
        self.subscription_gate.on_event(event, value)
        if self._publisher_watch is not None:
            self._publisher_watch.on_event(event)
