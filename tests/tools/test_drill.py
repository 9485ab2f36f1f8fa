"""Failover drills: the analysis on hand-made events, and small real drills.

The real drills (marked slow) run a server pair and two client processes for a
few seconds with a 200 ms heartbeat, and assert the guarantees -- no confirmed
write lost, no overwritten key back at an older value, convergence, no
duplicate, order kept, the scenario's own checks -- and the events.jsonl /
summary.json schema.  Never speed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clone.tools import drill, report
from clone.tools.drill import DrillConfig, analyse, percentile, run_drill
from clone.tools.drill.analysis import highest_sequence_before, lock_fencing, nearest_rank
from clone.tools.drill.client import make_value, parse_value, shared_key, state_hash, write_key

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


def test_nearest_rank_is_the_one_definition() -> None:
    # The benchmark picks its median run with it: the lower median.
    assert [nearest_rank(n, 50) for n in (1, 2, 3, 4)] == [0, 0, 1, 1]
    assert nearest_rank(100, 99) == 98 and nearest_rank(5, 0) == 0
    with pytest.raises(ValueError):
        nearest_rank(0, 50)


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
    # Listed by a server as a split-brain conflict: kept, not lost.
    kept = analyse(streams, state, {"c0": state_hash(state.items())}, conflicted={"u0"})
    assert kept["confirmed_lost"] == 0 and kept["confirmed_conflicts"] == 1


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


# Overwritten keys: every write by hand, with its times.
K = shared_key(0)


def _shared(
    client: str, order: int, uid: str, sent: float, confirmed: float | None = None,
    *, key: str = K, timed_out: bool = False,
) -> list[dict[str, Any]]:
    """One write of ``key`` by ``client``: sent at ``sent``, confirmed at ``confirmed``."""
    evs = [{"ts": sent, "client": client, "event": "write_sent", "key": key, "uuid": uid,
            "confirmed": confirmed is not None or timed_out}]
    if confirmed is not None:
        evs.append({"ts": confirmed, "client": client, "event": "write_confirmed", "key": key,
                    "uuid": uid, "confirmed": True})
    if timed_out:
        evs.append({"ts": sent + 10, "client": client, "event": "write_timeout", "key": key,
                    "uuid": uid, "confirmed": False})
    return evs


def _seen(observer: str, uid: str | None, ts: float, seq: int, key: str = K) -> dict[str, Any]:
    return {"ts": ts, "client": observer, "event": "update", "key": key, "seq": seq, "uuid": uid}


def _ending(streams: dict[str, list[dict[str, Any]]], final: str | None,
            clients: dict[str, str | None] | None = None) -> dict[str, Any]:
    """analyse() with the server ending on write ``final`` of K (None: K is gone)."""
    state = {} if final is None else {K: make_value("x", 0, 0, final, 64)}
    for evs in streams.values():
        evs.sort(key=lambda e: e["ts"])
    items = {c: {K: u} for c, u in (clients or {}).items()}
    return analyse(streams, state, {}, items)


def test_a_key_back_at_an_older_confirmed_value_is_a_revert() -> None:
    # c0's write A was confirmed at 1.1; c1 sent B at 2.0, confirmed at 2.1; the
    # server ends with A: A was applied before B was even sent.
    streams = {"c0": _shared("c0", 0, "A", 1.0, 1.1), "c1": _shared("c1", 0, "B", 2.0, 2.1)}
    s = _ending(streams, "A", clients={"c0": "A", "c1": "B"})
    assert s["reverted_keys"] == 1
    assert s["reverted_by_state"] == {"server": 1, "c0": 1, "c1": 0}
    ex = s["reverted_examples"][0]
    assert (ex["state"], ex["key"], ex["final_uuid"]) == ("server", K, "A")
    assert ex["outlived"]["writer"] == "c1" and ex["outlived"]["uuid"] == "B"
    assert "before a confirmed write was sent" in ex["reason"]
    assert s["shared_writes"] == 2 and s["shared_confirmed_writes"] == 2
    # B at the end is right, and so is a write of A's sent after B was confirmed.
    assert _ending({"c0": _shared("c0", 0, "A", 1.0, 1.1),
                    "c1": _shared("c1", 0, "B", 2.0, 2.1)}, "B")["reverted_keys"] == 0


def test_a_concurrent_write_may_win_over_the_last_confirmed_one() -> None:
    # c1 sent B at 1.0 (confirmed at 1.3); c0 sent A at 1.2, while B was in
    # flight: the server may apply A last, confirmed or not.
    for a_confirmed in (None, 1.4, 1.25):
        streams = {"c0": _shared("c0", 0, "A", 1.2, a_confirmed),
                   "c1": _shared("c1", 0, "B", 1.0, 1.3)}
        s = _ending(streams, "A", clients={"c0": "A", "c1": "A"})
        assert s["reverted_keys"] == 0, a_confirmed
        # ... and B may win over A just as well.
        assert _ending({"c0": _shared("c0", 0, "A", 1.2, a_confirmed),
                        "c1": _shared("c1", 0, "B", 1.0, 1.3)}, "B")["reverted_keys"] == 0


def test_older_writes_of_the_same_writer_are_reverts() -> None:
    # c0 sent A (not confirmed), then B (confirmed): A cannot be applied after B.
    streams = {"c0": [*_shared("c0", 0, "A", 1.0), *_shared("c0", 1, "B", 1.05, 1.1)]}
    s = _ending(streams, "A")
    assert s["reverted_keys"] == 1
    assert s["reverted_examples"][0]["reason"] == "sent before a confirmed write of the same writer"
    # c0's unconfirmed A was followed by its confirmed write C of a unique key
    # (confirmed at 1.2), so A was applied by 1.2; c1's B was sent at 2.0.
    streams = {"c0": [*_shared("c0", 0, "A", 1.0), *_write("c0", 1, "C", True)],
               "c1": _shared("c1", 0, "B", 2.0, 2.1)}
    assert _ending(streams, "A")["reverted_keys"] == 1
    # Without the later confirmation, A may have been in flight all along.
    streams = {"c0": _shared("c0", 0, "A", 1.0), "c1": _shared("c1", 0, "B", 2.0, 2.1)}
    assert _ending(streams, "A")["reverted_keys"] == 0


def test_a_timed_out_write_is_never_judged_older() -> None:
    # The agent may resend a write whose wait timed out: it may land late.
    streams = {"c0": [*_shared("c0", 0, "A", 1.0, timed_out=True),
                      *_shared("c0", 1, "B", 12.0, 12.1)],
               "c1": _shared("c1", 0, "C", 13.0, 13.1)}
    assert _ending(streams, "A")["reverted_keys"] == 0


def test_a_missing_or_unknown_final_value_is_a_revert() -> None:
    streams = {"c0": _shared("c0", 0, "A", 1.0, 1.1)}
    s = _ending(streams, None)
    assert s["reverted_keys"] == 1 and s["reverted_examples"][0]["reason"] == "missing"
    streams = {"c0": _shared("c0", 0, "A", 1.0, 1.1)}
    s = _ending(streams, "stranger")
    assert s["reverted_keys"] == 1 and s["reverted_examples"][0]["final_uuid"] == "stranger"
    # A key with no confirmed write has nothing to go back from.
    assert _ending({"c0": _shared("c0", 0, "A", 1.0)}, None)["reverted_keys"] == 0


def test_clients_seeing_a_key_go_back() -> None:
    writes = [*_shared("c0", 0, "A", 1.0, 1.1), *_shared("c1", 0, "B", 2.0, 2.1)]
    streams = {
        "c0": [e for e in writes if e["client"] == "c0"],
        "c1": [e for e in writes if e["client"] == "c1"],
        # Saw B (after its confirmation), then A again: B went back to A.
        "c2": [_seen("c2", "A", 1.05, 1), _seen("c2", "B", 2.2, 2), _seen("c2", "A", 3.0, 3)],
        # Behind: sees A late, then B.  Not a revert.
        "c3": [_seen("c3", "A", 2.5, 1), _seen("c3", "B", 2.6, 2)],
    }
    s = _ending(streams, "B")
    assert s["reverted_keys"] == 0
    assert s["reverts_seen"] == 1 and s["reverts_seen_by_client"]["c2"] == 1
    assert s["reverts_seen_examples"][0]["state"] == "c2"
    assert s["duplicates"] == 0  # A, B, A again is a revert, not a duplicate


def test_overwritten_keys_keep_the_per_write_checks_honest() -> None:
    # Duplicates of an overwritten key: applying the write the key already holds.
    writes = [*_shared("c0", 0, "A", 1.0, 1.1), *_shared("c0", 1, "B", 1.2),
              *_shared("c1", 0, "C", 1.3, 1.4)]
    streams = {
        "c0": [e for e in writes if e["client"] == "c0"]
        + [_seen("c0", "A", 1.05, 1), _seen("c0", "A", 1.06, 1), _seen("c0", "B", 1.25, 2),
           _seen("c0", "C", 1.35, 3)],
        "c1": [e for e in writes if e["client"] == "c1"]
        # A resync after a failover that lost the unconfirmed B: from B back to A,
        # with a lower sequence.  Neither a duplicate nor disorder.
        + [_seen("c1", "A", 1.05, 1), _seen("c1", "B", 1.25, 2), _seen("c1", None, 1.3, 0),
           _seen("c1", "A", 1.31, 1), _seen("c1", "C", 1.35, 4)],
    }
    s = _ending(streams, "C")
    assert s["duplicates"] == 1 and s["out_of_order"] == 0
    assert s["reverted_keys"] == 0 and s["reverts_seen"] == 0
    # The per-write counts are about unique keys only.
    assert s["writes_sent"] == 0 and s["confirmed_writes"] == 0 and s["confirmed_lost"] == 0


def test_highest_sequence_before_a_moment() -> None:
    streams = {
        "c0": [_update("c0", "c1", 0, "u0", 3), _update("c0", "c1", 1, "u1", 9)],
        "c1": [_update("c1", "c1", 0, "u0", 3), *_write("c1", 2, "u2", True)],
    }
    assert highest_sequence_before(streams, 9.5) == 9
    assert highest_sequence_before(streams, 9) == 3  # strictly before
    assert highest_sequence_before(streams, 1) is None


def _hold(client: str, token: int, acquired: float, released: float | None,
          how: str = "lock_released") -> list[dict[str, Any]]:
    evs = [{"ts": acquired, "client": client, "event": "lock_acquired", "token": token}]
    if released is not None:
        evs.append({"ts": released, "client": client, "event": how, "token": token})
    return evs


def test_lock_fencing_over_recorded_holds() -> None:
    """Tokens must grow with every acquisition, in time order, across clients;
    an overlap is allowed (and counted) only with a higher token."""
    good = {
        "c0": [*_hold("c0", 10, 1.0, 1.1), *_hold("c0", 30, 3.0, 3.1)],
        "c1": [*_hold("c1", 20, 2.0, 2.1), {"ts": 2.5, "client": "c1", "event": "lock_error"}],
        # Cut off past its lease: still holding when c2 takes the lock, then lost.
        "c2": [*_hold("c2", 40, 4.0, 4.9, "lock_lost"), *_hold("c2", 55, 6.0, None)],
        "c2.g1": _hold("c2.g1", 50, 4.5, 4.6),
    }
    summary = analyse(good, _state(), {"c0": "h"})
    assert {k: summary[k] for k in ("lock_holds", "lock_token_violations", "lock_overlaps",
                                    "lock_lost")} == {"lock_holds": 6, "lock_token_violations": 0,
                                                      "lock_overlaps": 1, "lock_lost": 1}
    # The same token twice, and a lower one after a higher: both violations.
    bad = {
        "c0": [*_hold("c0", 10, 1.0, 1.1), *_hold("c0", 30, 3.0, 3.1)],
        "c1": [*_hold("c1", 10, 2.0, 2.1), *_hold("c1", 25, 4.0, 4.1)],
    }
    fenced = lock_fencing(bad)
    assert fenced["lock_token_violations"] == 2
    assert fenced["lock_token_violation_examples"] == [
        "c1 took token 10 after c0 had taken 10", "c1 took token 25 after c0 had taken 30"]
    assert lock_fencing({})["lock_holds"] == 0


def test_lock_fencing_leaves_out_what_the_losing_side_granted_in_a_split_brain() -> None:
    """partition-split: the isolated active (primary) grants the lock to its
    island from its own, higher, sequences while the winner (backup) grants it
    to the others; only the loser's grants during the split are out of the order."""
    def on(server: str, evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**e, "server": server} if e["event"] == "lock_acquired" else e for e in evs]

    streams = {
        "c0": on("primary", _hold("c0", 100, 1.0, 1.1))
        + on("backup", [*_hold("c0", 110, 3.0, 3.1), *_hold("c0", 130, 9.0, 9.1)]),
        "c1": on("primary", [*_hold("c1", 105, 2.0, 2.1), *_hold("c1", 480, 4.0, 4.1)])
        + on("backup", _hold("c1", 140, 10.0, 10.1)),
    }
    assert lock_fencing(streams)["lock_token_violations"] == 2  # 130 and 140 after 480
    fenced = lock_fencing(streams, ("primary", 2.5, 8.0))  # cut at 2.5, stepped down at 8
    assert (fenced["lock_holds"], fenced["lock_holds_split"],
            fenced["lock_token_violations"]) == (6, 1, 0)


def test_a_lock_hold_whose_client_failed_over_meanwhile_may_be_either_sides() -> None:
    """A client that asked the loser and logged its hold once it had failed
    over to the winner names both: the hold is out of the order."""
    streams = {
        "c0": [{**e, "server": "backup"} if e["event"] == "lock_acquired" else e
               for e in _hold("c0", 562, 3.0, 3.1)],
        "c1": [{**e, "server": "backup", "servers": ["backup", "primary"]}
               if e["event"] == "lock_acquired" else e for e in _hold("c1", 551, 4.0, 4.1)],
    }
    assert lock_fencing(streams)["lock_token_violations"] == 1
    fenced = lock_fencing(streams, ("primary", 2.5, float("inf")))
    assert (fenced["lock_holds_split"], fenced["lock_token_violations"]) == (1, 0)


def test_both_crash_timings() -> None:
    cfg = DrillConfig(scenario="both-crash", heartbeat_ms=200)
    assert cfg.crash_sequence == ("primary", "backup")
    assert cfg.crash_interval == pytest.approx(0.6)  # 3 heartbeats
    cfg = DrillConfig(scenario="both-crash", crash_order="backup-first", crash_gap=2.0)
    assert cfg.crash_sequence == ("backup", "primary") and cfg.crash_interval == 2.0
    assert DrillConfig(scenario="both-crash", crash_order="together",
                       crash_gap=2.0).crash_interval == 0.0
    for bad in ({"crash_order": "sideways"}, {"crash_gap": -1.0}, {"down_time": -1.0},
                {"restart_stagger": 10.0}):
        with pytest.raises(ValueError):
            DrillConfig(scenario="both-crash", **bad)


def test_config_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        DrillConfig(scenario="meteor-strike")
    with pytest.raises(ValueError):
        DrillConfig(scenario="client-restart", clients=1)
    with pytest.raises(ValueError):
        DrillConfig(scenario="kill-active", shared_keys=-1)


def test_a_drill_that_fails_before_the_pair_is_up_shows_its_own_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the ``finally`` joined the never-started HUGZ monitor, and CI saw
    "cannot join thread before it is started" instead of why the drill failed."""
    from clone.tools.drill.harness import Drill

    def fail(self: Drill, name: str) -> None:
        raise RuntimeError(f"{name} would not start")

    monkeypatch.setattr(Drill, "start_server", fail)
    with pytest.raises(RuntimeError, match="primary would not start"):
        run_drill(_small("kill-active", tmp_path))


# --------------------------------------------------------------------------
# Real drills

_EVENTS = {"write_sent", "write_confirmed", "write_timeout", "update", "failover_detected",
           "failover_done", "fault", "restart", "final_state", "lock_acquired", "lock_released",
           "lock_lost", "lock_error",
           # --locks (partition-split) and split-brain conflicts told to a client
           "lock_taken", "write_conflict"}
_SUMMARY_FIELDS = {"scenario", "clients", "failover_p50_s", "failover_p99_s", "failover_max_s",
                   "confirmed_writes", "confirmed_lost", "unconfirmed_lost", "duplicates",
                   "out_of_order", "converged", "shared_writes", "shared_confirmed_writes",
                   "reverted_keys", "reverted_examples", "reverts_seen"}


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
    # The clients overwrote the shared keys, confirmed and not, and none went back.
    assert summary["shared_confirmed_writes"] > 0
    assert summary["shared_writes"] > summary["shared_confirmed_writes"]
    assert summary["reverted_keys"] == 0 and summary["reverts_seen"] == 0
    assert summary["checks"]["every key at its last confirmed value or later"]["ok"] is True
    # The lock workload (2 clients contend): holders came one after another, each
    # with a higher fencing token.
    fencing = summary["checks"]["no two lock holders with the same or a lower token"]
    assert fencing["ok"] is True and summary["lock_holds"] > 0, fencing
    assert summary["lock_token_violations"] == 0
    assert summary["ok"] is True


def _small(scenario: str, out: Path, **changes: Any) -> DrillConfig:
    settings: dict[str, Any] = {"clients": 2, "duration": 5.0, "rate": 20.0, "heartbeat_ms": 200}
    return DrillConfig(scenario=scenario, out=out, **{**settings, **changes})


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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_drill_rolling_restart(tmp_path: Path) -> None:
    # Long enough for two rounds under load; the last takeover comes after the writes.
    summary = run_drill(_small("rolling-restart", tmp_path, duration=10.0))
    events = _check_outputs(tmp_path, summary, "rolling-restart")
    _assert_guarantees(summary)
    rounds = summary["rounds"]
    assert len(rounds) >= 2
    assert all(r["takeover_s"] is not None for r in rounds)
    # Each round restarted both servers, and each came back passive.
    restarts = summary["restarts"]
    assert len(restarts) == 2 * len(rounds)
    assert all(r["came_back_passive"] and r["synced_s"] is not None for r in restarts)
    assert summary["checks"]["every restarted server came back passive"]["ok"] is True
    # Both ways of stopping a server were used, on the passive and on the active.
    kinds = {(e["kind"], e["target"]) for e in events if e["event"] == "fault"}
    assert {k for k, _ in kinds} == {"kill-9", "sigterm"}
    assert sum(e["event"] == "restart" for e in events) == len(restarts)
    # Every client follows every takeover; the last one, after the writes, may
    # bring no update to measure the gap by.
    assert summary["failovers_observed"] >= summary["clients"] * (len(rounds) - 1)



def _crash_report(summary: dict[str, Any]) -> dict[str, Any]:
    crash = summary["crash"]
    assert len(crash["kills"]) == 2 and len(crash["restarts"]) == 2
    assert {k["server"] for k in crash["kills"]} == {"primary", "backup"}
    assert crash["seq_seen_before"] is not None
    return crash


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("order, stagger", [("primary-first", 0.0), ("backup-first", 0.5)])
def test_drill_both_crash(order: str, stagger: float, tmp_path: Path) -> None:
    summary = run_drill(_small("both-crash", tmp_path, crash_order=order,
                               restart_stagger=stagger))
    events = _check_outputs(tmp_path, summary, "both-crash")
    _assert_guarantees(summary)
    crash = _crash_report(summary)
    first = order.split("-")[0]
    assert crash["kills"][0]["server"] == first and crash["restarts"][0]["server"] == first
    assert crash["served_seq"] >= crash["seq_seen_before"]
    # Both came back from their data directories.
    assert all(v is not None and v["sequence"] > 0 for v in crash["loaded"].values())
    for name in ("the pair came back after both crashed",
                 "sequence never went backwards across the restart"):
        assert summary["checks"][name]["ok"] is True
    assert sum(e["event"] == "restart" for e in events) == 2


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_drill_both_crash_in_memory_loses_writes(tmp_path: Path) -> None:
    # The drill must be able to fail: servers without a data directory lose
    # everything when both crash, and the verdict says so.
    summary = run_drill(_small("both-crash", tmp_path, in_memory=True))
    _check_outputs(tmp_path, summary, "both-crash")
    crash = _crash_report(summary)
    assert crash["in_memory"] is True
    assert not (tmp_path / "data").exists()
    assert summary["ok"] is False
    assert summary["confirmed_lost"] > 0
    assert summary["checks"]["no confirmed write lost"]["ok"] is False
    assert summary["checks"]["sequence never went backwards across the restart"]["ok"] is False
    assert crash["served_seq"] < crash["seq_seen_before"]


# --------------------------------------------------------------------------
# Partition drills: the judgement without processes, then real runs (root)


def test_stepped_down_writes_lost_only_if_never_confirmed() -> None:
    from clone.tools.drill.analysis import stepped_down_writes

    streams = {
        "c0": [
            *_write("c0", 0, "u0", True), *_write("c0", 1, "u1", False),
            *_write("c0", 2, "u2", True),
            # u0 and u2 confirmed by the primary, u1 unconfirmed; all three applied by it.
            {"ts": 5, "client": "c0", "event": "update", "key": write_key("c0", 0, 0),
             "seq": 1, "uuid": "u0", "server": "primary"},
            {"ts": 6, "client": "c0", "event": "update", "key": write_key("c0", 0, 1),
             "seq": 2, "uuid": "u1", "server": "primary"},
            {"ts": 7, "client": "c0", "event": "update", "key": write_key("c0", 0, 2),
             "seq": 3, "uuid": "u2", "server": "primary"},
        ]
    }
    for ev in streams["c0"]:
        if ev["event"] == "write_confirmed":
            ev["server"] = "primary"
    # The unconfirmed u1 is gone after the primary stepped down: allowed.
    ok = stepped_down_writes(streams, _state(("c0", 0, "u0"), ("c0", 2, "u2")), "primary")
    assert ok["confirmed_by"] == 2 and ok["confirmed_by_lost"] == []
    assert ok["seen_applied"] == 3 and ok["applied_missing"] == 1
    assert ok["applied_missing_confirmed"] == []
    # The confirmed u2 gone: reported by key, both ways.
    bad = stepped_down_writes(streams, _state(("c0", 0, "u0")), "primary")
    assert bad["confirmed_by_lost"] == [write_key("c0", 0, 2)]
    assert bad["applied_missing_confirmed"] == [write_key("c0", 0, 2)]
    assert bad["confirmed_by_lost_count"] == bad["applied_missing_confirmed_count"] == 1
    # Writes another server confirmed are not its business.
    assert stepped_down_writes(streams, {}, "backup")["confirmed_by"] == 0
    # A confirmed write a split brain's heal kept as a listed conflict is not lost.
    kept = stepped_down_writes(streams, _state(("c0", 0, "u0")), "primary", {"u2"})
    assert kept["confirmed_by_lost"] == kept["applied_missing_confirmed"] == []
    assert kept["kept_as_conflicts"] == 1 and kept["applied_missing"] == 2


def test_split_writes_fate_of_each_write_the_loser_confirmed() -> None:
    from clone.tools.drill.analysis import split_writes

    # c1 writes u0..u3; u0 confirmed by the primary before the cut (t=1.5), u1
    # and u2 during the split (cut at 2, step-down at 4.5, heal at 4), u3
    # after the step-down; u1 comes back from the backup (twice for c1).
    streams = {"c1": [*_write("c1", 1, "u0", True), *_write("c1", 2, "u1", True),
                      *_write("c1", 3, "u2", True), *_write("c1", 5, "u3", True)]}
    for ev in streams["c1"]:
        if ev["event"] == "write_confirmed":
            ev["server"] = "primary"
    streams["c1"] += [
        {"ts": 2.05, "client": "c1", "event": "update", "key": write_key("c1", 0, 2),
         "seq": 9, "uuid": "u1", "server": "primary"},
        {"ts": 6.5, "client": "c1", "event": "update", "key": write_key("c1", 0, 2),
         "seq": 20, "uuid": "u1", "server": "backup"},
    ]
    streams["c0"] = [{"ts": 6.0, "client": "c0", "event": "update",
                      "key": write_key("c1", 0, 2), "seq": 20, "uuid": "u1", "server": "backup"}]
    out = split_writes(streams, _state(("c1", 2, "u1")), "primary", "backup", 2.0, 4.5, 4.0)
    assert out["confirmed"] == 2 and out["by_client"] == {"c1": 2}
    assert (out["kept"], out["lost"], out["overwritten"]) == (1, 1, 0)
    kept, lost = out["writes"]
    assert kept["uuid"] == "u1" and kept["fate"] == "kept" and kept["at_winner_s"] == 2.0
    assert kept["confirmed_s"] == 0.1 and kept["reapplied_by"] == ["c1"]
    assert lost["uuid"] == "u2" and lost["fate"] == "lost" and lost["at_winner_s"] is None
    assert out["reached_winner"] == 1 and out["reapplied"] == 1
    # Confirmed by the other server: not the loser's.
    assert split_writes(streams, {}, "backup", "primary", 2.0, 4.5, 4.0)["confirmed"] == 0


def test_split_writes_a_write_only_the_winners_history_holds_was_applied() -> None:
    """A loser write of a shared key that the winner applied at the heal and
    that a later loser write replaced before any client synced from the
    winner: no client saw it come from the winner, but the winner's history
    holds it, so it was applied and overwritten, not lost (two loaded runs
    counted 8 and 11 such writes lost, each in the winner's log of its term)."""
    from clone.tools.drill.analysis import split_writes

    key = shared_key(3)
    streams: dict[str, list[dict[str, Any]]] = {"c4": []}
    for n, uid in ((1, "s1"), (2, "s2")):
        streams["c4"] += [
            {"ts": 2 + n / 10, "client": "c4", "event": "write_sent", "key": key, "uuid": uid,
             "confirmed": True},
            {"ts": 2.05 + n / 10, "client": "c4", "event": "write_confirmed", "key": key,
             "uuid": uid, "confirmed": True, "server": "primary"},
        ]
    # The key ends at a later winner-side write by c0; the clients synced from
    # the winner only after both loser writes had been applied and replaced.
    final = {key: make_value("c0", 0, 9, "w9", 64)}
    blind = split_writes(streams, final, "primary", "backup", 2.0, 4.5, 4.0)
    assert [w["fate"] for w in blind["writes"]] == ["lost", "lost"]
    assert blind["in_winner_history"] is None
    seen = split_writes(streams, final, "primary", "backup", 2.0, 4.5, 4.0, (),
                        {"s1", "s2", "w9"})
    assert [w["fate"] for w in seen["writes"]] == ["overwritten", "overwritten"]
    assert (seen["lost"], seen["overwritten"], seen["in_winner_history"]) == (0, 2, 2)
    # Only what the history holds: s2 missing from it is still lost.
    half = split_writes(streams, final, "primary", "backup", 2.0, 4.5, 4.0, (), {"s1"})
    assert [w["fate"] for w in half["writes"]] == ["overwritten", "lost"]
    # A client's own key is never overwritten by others: in the history but
    # not in the final state is still lost.
    own = {"c4": [*_write("c4", 3, "o3", True)]}
    for ev in own["c4"]:
        ev["ts"] = 2.5
        if ev["event"] == "write_confirmed":
            ev["server"] = "primary"
    assert split_writes(own, {}, "primary", "backup", 2.0, 4.5, 4.0, (), {"o3"})["lost"] == 1


def test_winner_promotion_sequence_and_write_ids_for_its_history() -> None:
    from clone.tools.drill.applied import promotion_sequence, write_ids

    log = ("2026-11-26 11:10:54.123 INFO bstar.reactor: PASSIVE -> ACTIVE on CLIENT_REQUEST\n"
           "2026-11-26 11:10:54.148 WARNING clone.server.reactor: now ACTIVE (was passive): "
           "serving at sequence 52034, 50732 keys; published 8 of 8 pending updates\n")
    # Before the 8 it published from its pending list: a loser's write, sent to
    # both servers by its client, can be one of them.
    assert promotion_sequence(log) == 52026
    assert promotion_sequence(log + log.replace("52034", "52100")) == 52092  # the last one
    assert promotion_sequence("now PASSIVE (was active): following\n") is None
    assert write_ids([make_value("c4", 0, 1, "a1", 64), b"", None, b"not ours",
                      make_value("c0", 0, 2, "b2", 64)]) == {"a1", "b2"}


def test_split_brain_lines() -> None:
    from clone.tools.drill.analysis import split_brain_lines

    log = ("x INFO peer heard\n"
           "x WARNING bstar.reactor: split brain: peer at tcp://a is active too "
           "(our epoch 1, its epoch 2); we step down: ...\n")
    assert len(split_brain_lines(log)) == 1 and "we step down" in split_brain_lines(log)[0]
    assert split_brain_lines("nothing\n") == []


def test_log_line_time_reads_the_servers_stamp() -> None:
    from datetime import datetime

    from clone.tools.drill.analysis import log_line_time

    t = log_line_time("2026-11-24 07:14:08.771 WARNING bstar.reactor: split brain")
    assert t == datetime(2026, 11, 24, 7, 14, 8, 771000).timestamp()
    assert log_line_time("=== 07:11:00 start #1") is None


def test_a_thawed_active_gets_the_heals_hold_in_its_settle() -> None:
    # The thawed active steps down as a split brain's loser: the winner may
    # hold client updates for HOLD_FIRST_CALL, and the clients' final state
    # must come after that.
    from clone.server.healing import HOLD_FIRST_CALL

    cfg = DrillConfig(scenario="freeze-active", duration=5.0, heartbeat_ms=200)
    plain = DrillConfig(scenario="client-restart", duration=5.0, heartbeat_ms=200)
    assert cfg.settle >= plain.settle + HOLD_FIRST_CALL


def test_partition_config_and_names() -> None:
    from clone.tools.drill.netns import Topology

    cfg = DrillConfig(scenario="partition-active", duration=5.0, heartbeat_ms=200)
    assert cfg.partition_seconds == cfg.failover_budget  # 3.1 s > 25% of 5 s
    assert DrillConfig(scenario="partition-pair", partition_time=2.0).partition_seconds == 2.0
    assert cfg.settle > DrillConfig(scenario="kill-active", duration=5.0,
                                    heartbeat_ms=200).settle
    with pytest.raises(ValueError):
        DrillConfig(scenario="partition-pair", partition_time=0)
    topo = Topology(pid=4194304, subnet="10.213.7")
    assert topo.namespace("backup") == "clonedrill-4194304-backup"
    assert topo.address("primary") == "10.213.7.2" and topo.host_address == "10.213.7.1"
    assert topo.prefix("primary") == ["ip", "netns", "exec", "clonedrill-4194304-primary"]
    # Link names fit Linux's 15 characters, with the largest pid.
    assert all(len(n) <= 15 for n in (topo.bridge, topo._veth("primary") + "x"))
    # partition-split: the last client lives in an island namespace at .4.
    split = DrillConfig(scenario="partition-split", clients=3)
    assert split.island_client == "c2" and cfg.island_client is None
    with pytest.raises(ValueError):
        DrillConfig(scenario="partition-split", clients=1)
    with pytest.raises(ValueError):
        DrillConfig(scenario="partition-active", island_reset=True)
    island = Topology(pid=4194304, subnet="10.213.7", island=True)
    assert island.spaces == ("primary", "backup", "island")
    assert island.address("island") == "10.213.7.4" and topo.spaces == ("primary", "backup")
    assert island.namespace("island") == "clonedrill-4194304-island"
    assert len(island._veth("island") + "x") <= 15
    with pytest.raises(ValueError):
        topo.split("primary", "backup")


@pytest.mark.parametrize("scenario", ["partition-pair", "partition-split"])
def test_partition_drill_without_root_exits_2(
    scenario: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    import os

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    rc = drill.main(["--scenario", scenario, "--partition-time", "2", "--out", str(tmp_path)])
    assert rc == 2
    assert f"drill: {scenario} cannot run here: the partition drills need root" in (
        capsys.readouterr().err)


def _netns_or_skip() -> None:
    from clone.tools.drill.netns import NetnsUnavailable, preflight

    try:
        preflight()
    except NetnsUnavailable as exc:
        pytest.skip(f"partition drills need network namespaces and iptables: {exc}")


def _our_netns() -> list[str]:
    import os
    import subprocess

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line for line in listed.splitlines() if f"clonedrill-{os.getpid()}-" in line]


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("scenario", ["partition-pair", "partition-active"])
def test_drill_partition(scenario: str, tmp_path: Path) -> None:
    _netns_or_skip()
    summary = run_drill(_small(scenario, tmp_path))
    _check_outputs(tmp_path, summary, scenario)
    _assert_guarantees(summary)
    part = summary["partition"]
    assert part["rules"] and part["heal_ts"] > part["ts"]
    assert all(part["presumed_dead"].values())  # the cut was real: each lost the other
    assert not _our_netns()  # torn down
    if scenario == "partition-pair":
        # Nobody voted for the passive: no takeover, no split brain.
        assert summary["checks"]["no takeover without a client vote"]["ok"] is True
        assert summary["failovers_observed"] == 0
        assert summary["active_at_end"] == [part["active"]]
        assert part["stepped_down"] == []
    else:
        assert summary["checks"]["split brain detected and resolved"]["ok"] is True
        assert summary["failovers_observed"] >= 1
        assert part["stepped_down"] == [part["active"]]
        assert summary["active_at_end"] == [part["passive"]]
        (written,) = part["writes_of_stepped_down"]
        assert written["confirmed_by"] > 0 and written["confirmed_by_lost"] == []


#: What a split brain's merge may still break (docs/failover.md, "Writes of a
#: split brain", what remains): an island client's own copy that reaches the
#: winner before the loser's forwarded writes, and before the winner holds
#: client updates, is applied as a plain write.  The rule keeps the winner's
#: values against every forwarded write; this race is the client's to close.
_SPLIT_MERGE_CHECKS = {
    "no duplicate applied",
    "per-writer order kept",
    "every key at its last confirmed value or later",
    "no client saw a key go back",
    # The island client stops queueing for the winner while it has lost it, so
    # a fire-and-forget write it makes just after the heal may reach only the
    # stepped-down server, which parks it until --pending-max-age (docs/drills.md).
    "passive in step with active",
}


def _last_stats(log: Path) -> dict[str, Any]:
    """The last ``stats: {json}`` line a server logged (at its stop)."""
    lines = [line for line in log.read_text().splitlines() if " stats: {" in line]
    assert lines, f"no stats line in {log}"
    stats: dict[str, Any] = json.loads(lines[-1].split(" stats: ", 1)[1])
    return stats


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("island_reset", [False, True], ids=["silent-cut", "island-reset"])
def test_drill_partition_split(tmp_path: Path, island_reset: bool) -> None:
    """With island_reset the island client's own copies to the winner are
    discarded by a reset (no late TCP delivery): only the loser's forwarding
    of its split writes (clone.server.healing) can keep them."""
    _netns_or_skip()
    summary = run_drill(
        _small(
            "partition-split", tmp_path, duration=6.0, partition_time=3.0,
            island_reset=island_reset,
        )
    )
    _check_outputs(tmp_path, summary, "partition-split")
    assert not _our_netns()  # torn down, the island too
    checks, part = summary["checks"], summary["partition"]
    failed = {k for k, v in checks.items() if not v["ok"]}
    # The guarantees the issue asks for hold; only the merge's ordering ones may not.
    assert failed <= _SPLIT_MERGE_CHECKS, report.drill_text(summary)
    for name in ("no confirmed write lost", "clients converged", "one active server at the end",
                 "split brain detected and resolved", "clients failed over during the cut",
                 "both sides confirmed writes during the split",
                 "writes the isolated server confirmed during the split: "
                 "applied or a listed conflict",
                 "no lock has two holders after the heal",
                 "every conflict of a confirmed write was told to its client",
                 "writes of a server that stepped down: applied everywhere or never confirmed"):
        assert checks[name]["ok"] is True, name
    assert summary["confirmed_lost"] == 0 and summary["converged"] is True
    assert part["stepped_down"] == [part["active"]]
    assert summary["active_at_end"] == [part["passive"]]
    # Not vacuous: the island client (c1) had writes confirmed by the isolated
    # server during the split, and every one of them is in the final state, was
    # overwritten after it reached the winner, or is a conflict the winner lists.
    split = part["split_writes"]
    assert split["server"] == part["active"] and split["by_client"].get("c1", 0) > 0
    assert split["confirmed"] > 0 and split["lost"] == 0
    assert split["kept"] + split["overwritten"] + split["conflicts"] == split["confirmed"]
    assert part["winner_confirmed_during_split"] > 0
    # The loser sent the winner its writes after the fork, and every one was
    # answered: applied (or already there), or kept as a conflict; the winner
    # lists exactly those conflicts.
    loser = _last_stats(tmp_path / "logs" / f"{part['active']}.log")
    assert loser["split_writes_found"] >= split["confirmed"] > 0
    found, conflicts = loser["split_writes_found"], loser["split_writes_conflicts"]
    assert loser["split_writes_applied"] + conflicts == found
    assert loser["split_writes_refused"] == loser["split_writes_abandoned"] == 0
    assert len(summary["conflicts"]) == conflicts
    # The lock: both sides granted it during the split brain; every other hold
    # came with a token above all earlier ones.
    assert checks["no two lock holders with the same or a lower token"]["ok"] is True
    assert part["lock_fencing"]["lock_holds_split"] > 0


def test_concurrent_drills_claim_different_subnets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two drills at once (two test workers) each hold their /24 by a lock, so
    the second never picks the first's before the first has added its
    addresses; a used subnet is skipped, one taken between the two reads too,
    and a released one can be claimed again."""
    import os

    from clone.tools.drill import netns

    # Two reads a claim that gets a lock: before it, and again once it holds it.
    seen = iter(["", "", "", "", "", "inet 10.213.9.1/24 brd", ""] + [""] * 10)
    monkeypatch.setattr(netns, "_used_subnets", lambda: next(seen))
    first, fd1 = netns._claim_subnet(7, tmp_path)
    second, fd2 = netns._claim_subnet(7, tmp_path)  # the same pid: the lock alone decides
    assert (first, second) == ("10.213.7", "10.213.8")
    # 10.213.9 was free at the first read and in use at the second: skipped.
    third, fd3 = netns._claim_subnet(7, tmp_path)
    assert third == "10.213.10"
    monkeypatch.setattr(netns, "_used_subnets", lambda: "10.213.11.1/24 dev cd1br\n")
    os.close(fd1)
    again, fd4 = netns._claim_subnet(7, tmp_path)
    assert again == "10.213.7"
    assert netns._claim_subnet(10, tmp_path)[0] == "10.213.12"  # 10 held, 11 in use
    for fd in (fd2, fd3, fd4):
        os.close(fd)
