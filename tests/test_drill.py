"""Failover drills: the analysis on hand-made events, and small real drills.

The real drills (marked slow) run a server pair and two client processes for a
few seconds with a 200 ms heartbeat, and assert the guarantees -- no confirmed
write lost, convergence, no duplicate, order kept, the scenario's own checks --
and the events.jsonl / summary.json schema.  Never speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clone.tools import drill, report
from clone.tools.drill import DrillConfig, analyse, percentile, run_drill
from clone.tools.drill_client import make_value, parse_value, state_hash, write_key

# --------------------------------------------------------------------------
# The analysis, without processes


def _write(
    client: str, n: int, uid: str, confirmed: bool, ttl: bool = False
) -> list[dict[str, Any]]:
    key = write_key(client, 0, n, ttl=ttl)
    evs = [{"ts": n, "client": client, "event": "write_sent", "key": key, "uuid": uid,
            "confirmed": confirmed}]
    if confirmed:
        evs.append({"ts": n + 0.1, "client": client, "event": "write_confirmed", "key": key,
                    "uuid": uid, "confirmed": True})
    return evs


def _update(observer: str, writer: str, n: int, uid: str | None, seq: int) -> dict[str, Any]:
    return {"ts": seq, "client": observer, "event": "update", "key": write_key(writer, 0, n),
            "seq": seq, "uuid": uid}


def _state(*writes: tuple[str, int, str]) -> dict[str, bytes]:
    return {write_key(c, 0, n): make_value(c, 0, n, uid, 64) for c, n, uid in writes}


def test_value_round_trip() -> None:
    assert parse_value(make_value("c3", 2, 17, "abcd", 64)) == "abcd"
    assert parse_value(None) is None
    assert parse_value(b"not a drill value") is None
    assert write_key("c1", 0, 5) == "/drill/c1/g0/5"
    assert write_key("c1", 2, 5, ttl=True) == "/drill/c1/ttl/g2/5"


def test_state_hash_ignores_order_and_sees_values() -> None:
    a = [("/drill/a", b"1"), ("/drill/b", b"2")]
    assert state_hash(a) == state_hash(list(reversed(a)))
    assert state_hash(a) != state_hash([("/drill/a", b"1"), ("/drill/b", b"3")])
    # No ambiguity between key and value boundaries.
    assert state_hash([("/k", b"ab")]) != state_hash([("/ka", b"b")])


def test_percentile_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2
    assert percentile(list(range(1, 101)), 99) == 99


def test_clean_run_passes() -> None:
    state = _state(("c0", 0, "u0"), ("c0", 1, "u1"))
    h = state_hash(state.items())
    streams = {
        "c0": [*_write("c0", 0, "u0", True), *_write("c0", 1, "u1", False),
               _update("c0", "c0", 0, "u0", 1), _update("c0", "c0", 1, "u1", 2),
               {"ts": 9, "client": "c0", "event": "failover_done", "gap_s": 0.4,
                "from": "primary", "to": "backup"}],
    }
    s = analyse(streams, state, {"c0": h})
    assert s["confirmed_writes"] == 1 and s["confirmed_lost"] == 0
    assert s["unconfirmed_writes"] == 1 and s["unconfirmed_lost"] == 0
    assert s["duplicates"] == 0 and s["out_of_order"] == 0
    assert s["converged"] is True
    assert s["failover_p50_s"] == s["failover_max_s"] == 0.4


def test_lost_writes_are_found() -> None:
    # The final state lacks write 0 (confirmed) and holds another value for write 1.
    state = _state(("c0", 1, "someone-else"))
    streams = {"c0": [*_write("c0", 0, "u0", True), *_write("c0", 1, "u1", False)]}
    s = analyse(streams, state, {"c0": state_hash(state.items())})
    assert s["confirmed_lost"] == 1
    assert s["confirmed_lost_keys"] == [write_key("c0", 0, 0)]
    assert s["unconfirmed_lost"] == 1


def test_duplicates_and_disorder_are_counted_per_client() -> None:
    streams = {
        "c0": [_update("c0", "c1", 0, "u0", 1), _update("c0", "c1", 0, "u0", 2),
               _update("c0", "c1", 2, "u2", 3), _update("c0", "c1", 1, "u1", 4)],
        # Another client seeing the same writes once, in order, is fine.
        "c1": [_update("c1", "c1", 0, "u0", 1), _update("c1", "c1", 1, "u1", 2)],
        # A restarted incarnation sees everything again: not a duplicate.
        "c1.g1": [_update("c1", "c1", 0, "u0", 1)],
        # Deletes (expiry) carry no write id.
        "c2": [_update("c2", "c1", 5, None, 7), _update("c2", "c1", 5, None, 8)],
    }
    s = analyse(streams, {}, {})
    assert s["duplicates"] == 1
    assert s["out_of_order"] == 2  # the repeated 0, and 1 after 2


def test_divergent_clients_do_not_converge() -> None:
    state = _state(("c0", 0, "u0"))
    good = state_hash(state.items())
    assert analyse({}, state, {"c0": good, "c1": good})["converged"] is True
    assert analyse({}, state, {"c0": good, "c1": "other"})["converged"] is False
    assert analyse({}, state, {"c0": good, "c1": None})["converged"] is False
    assert analyse({}, None, {"c0": good})["converged"] is False


def test_ttl_writes_are_not_losses_but_leftovers_count() -> None:
    key = write_key("c0", 0, 0, ttl=True)
    streams = {"c0": _write("c0", 0, "t0", False, ttl=True)}
    s = analyse(streams, {}, {})
    assert s["ttl_writes"] == 1 and s["unconfirmed_lost"] == 0
    s = analyse(streams, {key: make_value("c0", 0, 0, "t0", 64)}, {})
    assert s["ttl_leftover"] == 1


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        DrillConfig(scenario="meteor-strike")
    with pytest.raises(ValueError):
        DrillConfig(scenario="client-restart", clients=1)


# --------------------------------------------------------------------------
# Real drills

_EVENTS = {"write_sent", "write_confirmed", "write_timeout", "update", "failover_detected",
           "failover_done", "fault", "restart", "final_state"}
_SUMMARY_FIELDS = {"scenario", "clients", "failover_p50_s", "failover_p99_s", "failover_max_s",
                   "confirmed_writes", "confirmed_lost", "unconfirmed_lost", "duplicates",
                   "out_of_order", "converged"}


def _check_outputs(out: Path, summary: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    assert _SUMMARY_FIELDS <= set(summary)
    on_disk = json.loads((out / "summary.json").read_text())
    assert on_disk["scenario"] == scenario and on_disk["ok"] == summary["ok"]
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events, "no events"
    assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    for e in events:
        assert isinstance(e["ts"], float) and isinstance(e["client"], str)
        assert e["event"] in _EVENTS, e
        if e["event"] == "update":
            assert {"key", "seq"} <= set(e)
        if e["event"] == "failover_done":
            assert e["gap_s"] >= 0 and {"from", "to"} <= set(e)
        if e["event"] == "fault":
            assert {"kind", "target"} <= set(e) and e["client"] == "drill"
        if e["event"] == "final_state":
            assert len(e["hash"]) == 64 and e["keys"] >= 0
    kinds = {e["event"] for e in events}
    assert {"write_sent", "write_confirmed", "update", "final_state", "fault"} <= kinds
    return events


def _log_tails(out: Path, lines: int = 30) -> str:
    """The end of every process log of a drill, for a failure message."""
    parts = []
    for log in sorted((out / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.name}\n" + "\n".join(tail))
    return "\n".join(parts)


def _assert_guarantees(summary: dict[str, Any]) -> None:
    failed = {k: v for k, v in summary["checks"].items() if not v["ok"]}
    assert not failed, report.drill_text(summary) + "\n" + _log_tails(Path(summary["out"]))
    assert summary["confirmed_lost"] == 0
    assert summary["confirmed_writes"] > 0
    assert summary["converged"] is True
    assert summary["duplicates"] == 0 and summary["out_of_order"] == 0
    assert summary["ok"] is True


def _small(scenario: str, out: Path, **changes: Any) -> DrillConfig:
    return DrillConfig(scenario=scenario, clients=2, duration=5.0, out=out, rate=20.0,
                       heartbeat_ms=200, **changes)


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("scenario", ["kill-active", "freeze-active", "ttl-storm"])
def test_drill_with_failover(scenario: str, tmp_path: Path) -> None:
    summary = run_drill(_small(scenario, tmp_path))
    events = _check_outputs(tmp_path, summary, scenario)
    _assert_guarantees(summary)
    assert summary["failovers_observed"] >= 1
    assert summary["failover_max_s"] is not None
    assert summary["failover_p50_s"] <= summary["failover_p99_s"] <= summary["failover_max_s"]
    assert any(e["event"] == "failover_done" for e in events)
    if scenario == "freeze-active":
        assert summary["split_brain_detected"] is True
    if scenario == "ttl-storm":
        assert summary["ttl_writes"] > 0 and summary["ttl_leftover"] == 0


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_drill_kill_passive_through_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --preload: the restarted passive syncs a snapshot of more than 1000 entries.
    rc = drill.main(["--scenario", "kill-passive", "--clients", "2", "--duration", "4",
                     "--heartbeat", "200", "--preload", "2000", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert rc == 0, out
    assert ("PASS" in out or "FAIL" in out) and "no confirmed write lost" in out
    _check_outputs(tmp_path, summary, "kill-passive")
    _assert_guarantees(summary)
    assert any("restarted backup came back passive" in k or "restarted primary" in k
               for k in summary["checks"])


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_drill_client_restart_late_joiner(tmp_path: Path) -> None:
    summary = run_drill(_small("client-restart", tmp_path))
    events = _check_outputs(tmp_path, summary, "client-restart")
    _assert_guarantees(summary)
    assert any(e["event"] == "restart" and e["target"] == "c1" for e in events)
    # Both incarnations of c1 wrote, and the late joiner ended with everything.
    assert (tmp_path / "clients" / "c1.g1.state.json").exists()
    finals = [e for e in events if e["event"] == "final_state"]
    assert len({e["hash"] for e in finals}) == 1 and len(finals) == 2
