"""partition-split --split-writes: the island's burst, and the loop stalls the
drill reports (pure: hand-made events, log text and stats)."""

from __future__ import annotations

from typing import Any

import pytest

from clone.tools.drill import DrillConfig
from clone.tools.drill.analysis import burst_writes, late_heartbeats
from clone.tools.drill.checks import loop_stalls
from clone.tools.drill.cli import _parser
from clone.tools.drill.client import burst_key, make_value


def test_late_heartbeats_are_read_from_the_servers_warnings() -> None:
    text = (
        "2026-11-26 03:12:11.950 WARNING clone.server.reactor: heartbeat ran 333 ms late:"
        " the reactor was blocked\n"
        "2026-11-26 03:12:12.000 INFO    clone.server.reactor: synced from x\n"
        "2026-11-26 03:12:23.081 WARNING clone.server.reactor: heartbeat ran 1353 ms late:"
        " the reactor was blocked\n"
    )
    assert late_heartbeats(text) == [333, 1353]
    assert late_heartbeats("") == []


def _sent(key: str, uid: str) -> dict[str, Any]:
    return {"ts": 1.0, "event": "write_sent", "key": key, "uuid": uid, "confirmed": False}


def test_burst_writes_counts_what_the_final_state_holds() -> None:
    keys = [burst_key("c2", 0, n) for n in range(3)]
    streams = {
        "c2": [
            {"ts": 0.5, "event": "burst_start", "count": 3},
            *(_sent(k, f"u{n}") for n, k in enumerate(keys)),
            _sent("/drill/c2/g0/0", "other"),  # a regular write: not the burst's
            {"ts": 2.0, "event": "burst_done", "count": 3, "seconds": 1.25},
        ]
    }
    final = {
        keys[0]: make_value("c2", 0, 0, "u0", 64),
        keys[1]: make_value("c2", 0, 1, "stale", 64),
        "/drill/c2/g0/0": make_value("c2", 0, 0, "other", 64),
    }
    assert burst_writes(streams, final) == {"sent": 3, "kept": 1, "seconds": 1.25}
    assert burst_writes(streams, None)["kept"] == 0


def test_loop_stalls_say_the_longest_after_the_cut() -> None:
    summary = {
        "servers": {
            "primary": {"heartbeat_max_late_ms": 900},
            "backup": {"heartbeat_max_late_ms": 140},
            "third": {"heartbeat_max_late_ms": 60},
        }
    }
    part = {
        "max_late_ms_at_cut": {"primary": 20, "backup": 90, "third": 60},
        "late_heartbeats_after_cut_ms": {"primary": [300, 900], "backup": [], "third": []},
    }
    # Logged late beats win; else the running maximum if it grew after the cut;
    # else only a bound: what it was at the cut.
    assert loop_stalls(summary, part) == {
        "primary": "900 ms",
        "backup": "140 ms",
        "third": "<= 60 ms",
    }


def test_split_writes_is_for_partition_split_only_and_lengthens_the_cut() -> None:
    with pytest.raises(ValueError):
        DrillConfig(scenario="partition-pair", split_writes=10)
    with pytest.raises(ValueError):
        DrillConfig(scenario="partition-split", split_writes=-1)
    plain = DrillConfig(scenario="partition-split", duration=20)
    big = DrillConfig(scenario="partition-split", duration=20, split_writes=50_000)
    assert big.partition_seconds > plain.partition_seconds
    assert big.partition_seconds >= 13  # 50,000 writes at about 5,000 a second
    assert big.settle > plain.settle
    assert DrillConfig(
        scenario="partition-split", split_writes=50_000, partition_time=4.0
    ).partition_seconds == 4.0


def test_the_cli_takes_split_writes() -> None:
    args = _parser().parse_args(["--scenario", "partition-split", "--split-writes", "50000"])
    assert args.split_writes == 50_000
