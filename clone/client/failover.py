"""How the agent leaves a server: silence, a lost connection, another active.

How this works: every way of leaving ends in :meth:`Failover._failover`, which
starts a fresh sync round on the next server (round robin) or on the one that
showed itself active, and remembers when we were last served, for the
``last_failover_gap_ms`` gauge.  Re-asking an unanswered request stays on the
same server.  A mixin over :class:`~clone.client.state.AgentState`; sans-IO.
"""

from __future__ import annotations

import logging
from typing import Any

from clone.client.actions import (
    Action,
)
from clone.client.state import (
    AgentState,
)
from clone.wire.codec import Hugz, KVMsg
from clone.wire.control import ViewHeartbeat

__all__ = ["Failover"]

log = logging.getLogger(__name__)


class Failover(AgentState):
    """The SILENCE, REASK, SERVER_DISCONNECTED and ACTIVE_ELSEWHERE handlers."""

    def _switch_to_active(
        self, server: int, msg: KVMsg | Hugz | ViewHeartbeat, now: float
    ) -> list[Action]:
        """Syncing: ``server`` showed itself active; ask it if the current one
        has not answered and has not shown itself active too (no flapping)."""
        if server == self.current or self._answered or self._shown_active:
            return []
        if server == self._unserving:
            # It said it was active for a whole round and served nothing: the
            # server we left it for gets its own round first, or a server
            # that only heartbeats could hold us forever.
            self.counters.unserving_hints += 1
            return []
        assert self.current is not None
        log.info(
            "%s is active (%s) and %s has not answered; asking %s",
            self.servers[server],
            type(msg).__name__,
            self.servers[self.current],
            self.servers[server],
        )
        self.counters.hint_failovers += 1
        actions = self._failover(now, server)
        # It has shown itself: no other server takes us from it this round.
        self._shown_active = True
        self._heard_at = now
        if isinstance(msg, Hugz | ViewHeartbeat):
            self._note_heartbeat(server, msg)
        else:  # published before our request: in the snapshot, and harmless here
            self._buffer.append(msg)
        return actions

    def _reask(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        self.counters.retries += 1
        log.debug(
            "no snapshot from %s yet; asking again (%d of %d)",
            self.servers[self.current],
            self._requests + 1,
            self.config.requests_per_server,
        )
        return self._request(now)

    def _silent_while_syncing(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.info(
            "no snapshot from %s within %.3g s (%d requests); trying the next server",
            self.servers[self.current],
            self._silence_allowed(),
            self._requests,
        )
        # The next rounds wait longer and ask less often (clone.client.backoff).
        self._unanswered_rounds += 1
        unserving = self._shown_active and not self._answered
        left = self.current
        actions = self._failover(now)  # a new round: resets what it showed
        if unserving:
            self._unserving = left
        return actions

    def _lost_server(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.warning(
            "lost the connection to server %s (%s); failing over",
            self.servers[self.current],
            self.state.value,
        )
        self.counters.disconnect_failovers += 1
        return self._failover(now)

    def _silent_active(self, server: int, payload: Any, now: float) -> list[Action]:
        assert self.current is not None
        log.warning(
            "server %s silent for %.3g s; failing over",
            self.servers[self.current],
            self._silence_allowed(),
        )
        return self._failover(now)

    def _failover(self, now: float, to: int | None = None) -> list[Action]:
        """Start a round on ``to``, by default the next server (round robin)."""
        assert self.current is not None
        nxt = (self.current + 1) % len(self.servers) if to is None else to
        self.counters.failovers += 1
        if self._left_at is None and self._heard_at is not None:
            # Measured from the server we were last served by, across any
            # number of further failovers until a snapshot completes.
            self._left_at = self._heard_at
        self._heard_at = None
        log.info("failing over from %s to %s", self.servers[self.current], self.servers[nxt])
        return self._start_sync(nxt, now)
