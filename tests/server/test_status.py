"""The status object and the STATUS? rate limit: pure, explicit values."""

from __future__ import annotations

import json

import pytest

from clone.release import RELEASE
from clone.server.status import (
    STATUS_FORMAT,
    PeerView,
    StatusLimiter,
    clone_version,
    server_status,
)
from clone.storage import FORMAT_VERSION

FIELDS = {
    "format", "role", "mode", "sequence", "keys", "store_bytes", "pending", "sync_state",
    "in_step", "peer", "peer_state", "ha_state", "epoch", "term", "uptime", "version",
    "data_dir", "data_dir_bytes", "durable", "curve", "last_failover", "failovers", "subscribers",
    "data_format",
    "conflicts",
}  # fmt: skip


def _status(**overrides: object) -> dict[str, object]:
    args: dict[str, object] = dict(
        role="active",
        mode="standalone",
        sequence=7,
        keys=3,
        store_bytes=120,
        pending=0,
        sync_state="idle",
        term=0,
        uptime=12.34567,
        version="1.2.3",
        data_dir=None,
        curve=False,
        failovers=1,
        last_failover=1_700_000_000.5,
    )
    args.update(overrides)
    return server_status(**args)  # type: ignore[arg-type]


def test_every_field_is_documented_and_present() -> None:
    import clone.server.status as module

    status = _status()
    assert set(status) == FIELDS
    for field in FIELDS:
        assert f"``{field}``" in (module.__doc__ or ""), field
    json.dumps(status, allow_nan=False)  # JSON as it stands


def test_standalone() -> None:
    s = _status()
    assert s["format"] == STATUS_FORMAT
    assert (s["role"], s["mode"], s["sequence"], s["keys"]) == ("active", "standalone", 7, 3)
    assert s["peer"] is s["peer_state"] is s["ha_state"] is s["epoch"] is None
    assert s["uptime"] == 12.346
    assert s["durable"] is False and s["data_dir"] is None
    assert s["in_step"] is None  # only a passive is in step or not
    assert s["subscribers"] is None


def test_durable_and_curve() -> None:
    s = _status(data_dir="/var/lib/clone", curve=True, subscribers=4)
    assert s["durable"] is True and s["data_dir"] == "/var/lib/clone"
    assert s["curve"] is True and s["subscribers"] == 4


@pytest.mark.parametrize(
    ("role", "sync_state", "pending", "in_step"),
    [
        ("passive", "synced", 0, True),
        ("passive", "synced", 2, False),
        ("passive", "syncing", 0, False),
        ("passive", "idle", 0, False),
        ("active", "idle", 0, None),
        ("starting", "idle", 5, None),
    ],
)
def test_in_step(role: str, sync_state: str, pending: int, in_step: bool | None) -> None:
    assert _status(role=role, sync_state=sync_state, pending=pending)["in_step"] is in_step


def test_peer_view() -> None:
    peer = PeerView(
        endpoint="10.0.0.2:5566",
        ha_state="active",
        epoch=3,
        peer_state="passive",
        peer_alive=True,
        last_contact_age=0.12345,
    )
    s = _status(mode="primary", peer=peer)
    assert s["peer"] == "10.0.0.2:5566"
    assert s["ha_state"] == "active" and s["epoch"] == 3
    assert s["peer_state"] == {"state": "passive", "alive": True, "last_contact": 0.123}


def test_a_peer_never_heard() -> None:
    peer = PeerView("h:1", "backup", 0, None, False, None)
    s = _status(role="starting", mode="backup", peer=peer)
    assert s["peer_state"] == {"state": None, "alive": False, "last_contact": None}


def test_negative_ages_are_clamped() -> None:
    peer = PeerView("h:1", "active", 1, "passive", True, -0.5)
    s = _status(uptime=-1.0, peer=peer)
    assert s["uptime"] == 0.0
    assert s["peer_state"]["last_contact"] == 0.0  # type: ignore[index]


def test_version_is_the_package_s() -> None:
    # The code's own release, not the installed distribution's (a checkout run
    # first on the path reports what it is).
    assert clone_version() == RELEASE
    assert _status()["data_format"] == FORMAT_VERSION


def test_limiter_allows_a_burst_then_the_rate() -> None:
    bucket = StatusLimiter(rate=4.0, burst=3, now=100.0)
    assert [bucket.allow(100.0) for _ in range(4)] == [True, True, True, False]
    assert not bucket.allow(100.125)  # half a token
    assert bucket.allow(100.25)  # one token
    assert not bucket.allow(100.25)
    assert [bucket.allow(200.0) for _ in range(4)] == [True, True, True, False]  # capped


def test_limiter_ignores_a_clock_going_back() -> None:
    bucket = StatusLimiter(rate=1.0, burst=1, now=10.0)
    assert bucket.allow(10.0)
    assert not bucket.allow(5.0)
    assert not bucket.allow(10.5)
    assert bucket.allow(11.0)


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1), (-1.0, 1), (1.0, 0)])
def test_limiter_refuses_nonsense(rate: float, burst: int) -> None:
    with pytest.raises(ValueError):
        StatusLimiter(rate, burst, 0.0)
