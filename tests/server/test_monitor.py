"""The Monitor part alone (clone.server.monitoring): a real core, a fake clock,
plain callbacks for Binary Star, the stats and whether the server serves; no
sockets and no server object."""

from __future__ import annotations

import logging
from pathlib import Path

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.core import ServerCore
from clone.server.monitoring import RECENT_CHANGES, Monitor
from clone.server.shared import Shared


class _Rig:
    def __init__(self, config: ServerConfig, core: ServerCore) -> None:
        self.now = 10.0
        self.serving = True
        self.counters: dict[str, int] = {"failovers": 0}
        shared = Shared(
            Throttle(logging.getLogger("test.monitor"), lambda: self.now),
            clock=lambda: self.now,
            wallclock=lambda: 1.7e9 + self.now,
            counters=self.counters,
        )
        self.part = Monitor(
            config,
            core,
            shared,
            ha=lambda: None,
            curve=lambda: False,
            stats=lambda: {"sequence": core.store.sequence, "role": core.role.value},
            serving=lambda: self.serving,
        )


def _update(seq: int, key: bytes) -> list[bytes]:
    return [key, seq.to_bytes(8, "big"), bytes(16), b"", b"v"]


def test_health_and_readiness_follow_the_role_and_the_sync() -> None:
    core = ServerCore()
    rig = _Rig(ServerConfig(port=5556), core)
    assert rig.part.health() == (True, "starting", 0)
    assert rig.part.readiness()[0] is False
    core.become_passive()
    ready, why = rig.part.readiness()
    assert not ready and "passive" in why
    core.become_active(0.0)
    assert rig.part.readiness() == (True, "active")
    rig.serving = False  # stopping, or a failed write
    assert rig.part.health()[0] is False
    assert rig.part.readiness() == (False, "stopping")


def test_status_says_the_uptime_the_role_and_the_last_takeover() -> None:
    core = ServerCore(standalone=True)
    core.become_active(0.0)
    rig = _Rig(ServerConfig(port=5556), core)
    rig.now += 5.0
    rig.part.note_failover()
    status = rig.part.status()
    assert status["role"] == "active" and status["uptime"] == 5.0
    assert status["failovers"] == 1 and rig.counters["failovers"] == 1
    assert status["last_failover"] == 1.7e9 + 15.0
    assert status["subscribers"] is None  # counted only with --http-port


def test_the_page_shows_the_last_changes_newest_first_never_values() -> None:
    rig = _Rig(ServerConfig(port=5556), ServerCore(standalone=True))
    rig.part.note_changes([_update(n, b"/k/%d" % n) for n in range(1, RECENT_CHANGES + 11)])
    recent = rig.part.page_fields()["recent"]
    assert len(recent) == RECENT_CHANGES
    assert recent[0] == {"sequence": RECENT_CHANGES + 10, "key": f"/k/{RECENT_CHANGES + 10}"}
    assert all(set(r) == {"sequence", "key"} for r in recent)


def test_role_changes_survive_a_restart_with_a_data_directory(tmp_path: Path) -> None:
    config = ServerConfig(port=5556, data_dir=str(tmp_path))
    rig = _Rig(config, ServerCore())
    rig.part.note_role("starting", "passive")
    rig.part.note_role("passive", "active")
    again = _Rig(config, ServerCore())
    assert [(w, n) for _, w, n in again.part.role_changes] == [
        ("starting", "passive"),
        ("passive", "active"),
    ]
    page = again.part.page_fields()["role_changes"]
    assert page[0]["to"] == "active"  # newest first
