"""drill-report on generated drill logs: percentiles, counts, markdown, PNG."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from clone.pipeline.cli import main

pytestmark = pytest.mark.spark


def _percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _write_run(
    root: Path,
    name: str,
    scenario: str,
    gaps: list[float],
    *,
    lose: bool = False,
    duplicate: bool = False,
    reorder: bool = False,
    diverge: bool = False,
    summary: dict[str, Any] | None = None,
) -> Path:
    """A drill run: c0 writes 20 keys (all confirmed); c0 and c1 apply every
    update, except for the faults asked for, which c1 suffers."""
    run = root / name
    run.mkdir()
    t = 1_700_000_000.0
    events: list[dict[str, Any]] = []
    seq = 0
    for i in range(20):
        seq += 1
        uuid = f"{i:032x}"
        key = f"/drill/k{i}"
        events.append({"ts": t, "client": "c0", "event": "write_sent", "key": key, "uuid": uuid})
        for client in ("c0", "c1"):
            if client == "c1" and lose and i == 7:
                continue
            events.append(
                {
                    "ts": t + 0.01,
                    "client": client,
                    "event": "update",
                    "key": key,
                    "seq": seq,
                    "uuid": uuid,
                }
            )
        if duplicate and i == 3:
            events.append(
                {
                    "ts": t + 0.02,
                    "client": "c1",
                    "event": "update",
                    "key": key,
                    "seq": seq,
                    "uuid": uuid,
                }
            )
        events.append(
            {
                "ts": t + 0.015,
                "client": "c0",
                "event": "write_confirmed",
                "key": key,
                "uuid": uuid,
                "seq": seq,
                "confirmed": True,
            }
        )
        if i == 10:
            events.append(
                {
                    "ts": t + 0.03,
                    "client": "drill",
                    "event": "fault",
                    "kind": "kill",
                    "target": "primary",
                }
            )
            for j, gap in enumerate(gaps):
                client = "c0" if j % 2 == 0 else "c1"
                events.append(
                    {
                        "ts": t + 0.04 + j * 0.001,
                        "client": client,
                        "event": "failover_done",
                        "gap_s": gap,
                        "from": "tcp://127.0.0.1:5556",
                        "to": "tcp://127.0.0.1:5566",
                    }
                )
        t += 0.1
    if reorder:
        # An update older than what c1 already applied, with no failover in between.
        events.append(
            {
                "ts": t,
                "client": "c1",
                "event": "update",
                "key": "/drill/k2",
                "seq": 2,
                "uuid": "ff" * 16,
            }
        )
    events.append({"ts": t + 1, "client": "c0", "event": "final_state", "hash": "aaa", "keys": 20})
    events.append(
        {
            "ts": t + 1,
            "client": "c1",
            "event": "final_state",
            "hash": "bbb" if diverge else "aaa",
            "keys": 19 if diverge else 20,
        }
    )
    with open(run / "events.jsonl", "w", encoding="utf-8") as fh:
        for e in events:
            fh.write(json.dumps(e) + "\n")
        fh.write("this line is not json\n")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps({"scenario": scenario, **summary}))
    return run


@pytest.fixture(scope="module")
def drill_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[list[Path], dict[str, list[float]]]:
    root = tmp_path_factory.mktemp("drills")
    gaps = {
        "kill-primary": [0.8, 1.1, 1.3, 2.0, 0.9, 1.7],
        "partition": [3.0, 2.5, 4.1, 2.2],
    }
    runs = [
        _write_run(
            root,
            "run1",
            "kill-primary",
            gaps["kill-primary"][:3],
            summary={
                "clients": 2,
                "confirmed_writes": 20,
                "confirmed_lost": 0,
                "duplicates": 0,
                "out_of_order": 0,
                "converged": True,
                "failover_max_s": 1.3,
            },
        ),
        _write_run(
            root,
            "run2",
            "kill-primary",
            gaps["kill-primary"][3:],
            lose=True,
            duplicate=True,
            summary={"clients": 2, "confirmed_lost": 0, "duplicates": 1},
        ),
        _write_run(
            root, "run3", "partition", gaps["partition"], reorder=True, diverge=True, summary={}
        ),
    ]
    return runs, gaps


@pytest.mark.timeout(120)
def test_drill_report_numbers_markdown_and_plot(
    spark: Any,
    drill_runs: tuple[list[Path], dict[str, list[float]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs, gaps = drill_runs
    out = tmp_path / "report"
    code = main(["drill-report", "--input", *map(str, runs), "--output", str(out)])
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "3 run(s) analysed" in printed

    data = json.loads((out / "report.json").read_text())
    scenarios = {s["scenario"]: s for s in data["scenarios"]}
    for name, values in gaps.items():
        row = scenarios[name]
        assert row["failovers"] == len(values)
        for q in (0.5, 0.9, 0.99):
            assert row[f"p{round(q * 100)}_s"] == pytest.approx(_percentile(values, q))
        assert row["max_s"] == pytest.approx(max(values))
    assert scenarios["kill-primary"]["runs"] == 2

    by_run = {os.path.basename(r["run"]): r for r in data["runs"]}
    assert by_run["run1"]["confirmed_writes"] == 20
    assert (by_run["run1"]["confirmed_lost"], by_run["run1"]["duplicates"]) == (0, 0)
    assert by_run["run1"]["converged"] is True
    assert (by_run["run2"]["confirmed_lost"], by_run["run2"]["duplicates"]) == (1, 1)
    assert by_run["run3"]["out_of_order"] == 1
    assert by_run["run2"]["out_of_order"] == 0
    assert by_run["run3"]["converged"] is False
    assert by_run["run3"]["faults"] == 1

    clients = {(os.path.basename(c["run"]), c["client"]): c for c in data["clients"]}
    assert clients[("run2", "c1")]["confirmed_lost"] == 1
    assert clients[("run2", "c0")]["confirmed_lost"] == 0
    assert clients[("run2", "c1")]["duplicates"] == 1
    assert clients[("run3", "c1")]["out_of_order"] == 1
    assert clients[("run3", "c0")]["out_of_order"] == 0
    assert ("run1", "drill") not in clients

    # run2's summary.json claims no loss: the report must say it disagrees.
    mismatches = {(os.path.basename(m["run"]), m["field"]) for m in data["mismatches"]}
    assert mismatches == {("run2", "confirmed_lost")}

    md = (out / "report.md").read_text()
    assert "# Failover drill report" in md
    assert "| kill-primary | 2 | 6 |" in md
    assert "![failover times and write rate](report.png)" in md
    assert "did not converge" in md and "run3" in md
    assert "confirmed_lost" in md  # the cross-check table

    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_drill_report_missing_input_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["drill-report", "--input", str(tmp_path / "nope"), "--output", str(tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert (
        err
        == f"clone-pipeline drill-report: error: drill directory {tmp_path / 'nope'} does not exist"
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_drill_report_on_a_real_drill(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The report reads what scripts/drill really writes, and agrees with it."""
    from clone.tools.drill import DrillConfig, run_drill

    run = tmp_path / "kill-active"
    summary = run_drill(
        DrillConfig(
            scenario="kill-active", clients=2, duration=5.0, out=run, rate=20.0, heartbeat_ms=200
        )
    )
    assert summary["ok"] is True
    out = tmp_path / "report"
    code = main(["drill-report", "--input", str(run), "--output", str(out)])
    assert code == 0, capsys.readouterr().err

    data = json.loads((out / "report.json").read_text())
    (scenario,) = data["scenarios"]
    assert scenario["scenario"] == "kill-active"
    assert scenario["failovers"] == summary["failovers_observed"] >= 1
    assert scenario["max_s"] == pytest.approx(summary["failover_max_s"], abs=1e-3)
    (row,) = data["runs"]
    assert row["confirmed_writes"] == summary["confirmed_writes"] > 0
    assert (row["confirmed_lost"], row["duplicates"], row["out_of_order"]) == (0, 0, 0)
    assert row["converged"] is True
    assert {c["client"] for c in data["clients"]} == {"c0", "c1"}
    assert not [m for m in data["mismatches"] if m["field"] == "confirmed_lost"]
    assert "kill-active" in (out / "report.md").read_text()
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("restarted", "duplicates"), [(True, 0), (False, 1)])
def test_a_restarted_client_starts_a_new_stream(
    spark: Any, tmp_path: Path, restarted: bool, duplicates: int
) -> None:
    """A restarted client gets the snapshot again: not a duplicate, unless the
    same process applied the same update twice."""
    from clone.pipeline.sources import read_drill_events, read_drill_summaries
    from clone.pipeline.transforms import client_delivery_stats

    run = tmp_path / "run"
    run.mkdir()
    t = 1_700_000_000.0
    update = {"client": "c1", "event": "update", "key": "/k", "seq": 1, "uuid": "ab" * 16}
    events: list[dict[str, Any]] = [
        {"ts": t, "client": "c0", "event": "write_sent", "key": "/k", "uuid": "ab" * 16},
        {"ts": t + 0.1, **update},
        {"ts": t + 0.2, "client": "drill", "event": "restart", "target": "c1"}
        if restarted
        else {"ts": t + 0.2, "client": "drill", "event": "fault", "kind": "none"},
        {"ts": t + 0.3, **update},
        # Found gone by a resync: a delete with no sequence of its own, not disorder.
        {"ts": t + 0.4, "client": "c1", "event": "update", "key": "/k", "seq": 0},
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "summary.json").write_text(json.dumps({"scenario": "client-restart", "clients": 2}))
    stats = client_delivery_stats(read_drill_events(spark, read_drill_summaries([str(run)])))
    row = stats.filter("client = 'c1'").collect()[0]
    assert (row["duplicates"], row["out_of_order"]) == (duplicates, 0)


def test_overwritten_drill_keys_are_left_out_of_the_per_write_counts(
    spark: Any, tmp_path: Path
) -> None:
    """Keys every drill client overwrites (/drill/shared/) cannot be judged write
    by write: c1 rightly misses a value overwritten while it resynced, and sees
    an older sequence after a failover that lost an unconfirmed write.  The
    counts leave them out (the drill judges them itself) and still count the
    keys written once."""
    from clone.pipeline.sources import read_drill_events, read_drill_summaries
    from clone.pipeline.transforms import client_delivery_stats, run_overview

    run = tmp_path / "run"
    run.mkdir()
    t = 1_700_000_000.0
    shared, own = "/drill/shared/0", "/drill/c0/g0/0"

    def sent(i: float, key: str, uuid: str, confirmed: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [
            {"ts": t + i, "client": "c0", "event": "write_sent", "key": key, "uuid": uuid}
        ]
        if confirmed:
            out.append({"ts": t + i + 0.01, "client": "c0", "event": "write_confirmed",
                        "key": key, "uuid": uuid, "confirmed": True})
        return out

    def seen(i: float, client: str, key: str, seq: int, uuid: str) -> dict[str, Any]:
        return {"ts": t + i, "client": client, "event": "update", "key": key, "seq": seq,
                "uuid": uuid}

    events = [
        *sent(0, own, "aa" * 16, True), seen(0.005, "c0", own, 1, "aa" * 16),
        seen(0.006, "c1", own, 1, "aa" * 16),
        *sent(1, shared, "a1" * 16, True), *sent(2, shared, "a2" * 16, True),
        *sent(3, shared, "a3" * 16, False),
        seen(1.005, "c0", shared, 2, "a1" * 16), seen(2.005, "c0", shared, 3, "a2" * 16),
        seen(3.005, "c0", shared, 4, "a3" * 16),
        # c1 resynced after a1 and a2, and then lost the unconfirmed a3 in a failover.
        seen(3.006, "c1", shared, 4, "a3" * 16), seen(4.0, "c1", shared, 3, "a2" * 16),
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "summary.json").write_text(json.dumps({"scenario": "kill-active", "clients": 2}))
    drill_events = read_drill_events(spark, read_drill_summaries([str(run)]))
    stats = {r["client"]: r for r in client_delivery_stats(drill_events).collect()}
    for client in ("c0", "c1"):
        row = stats[client]
        assert (row["confirmed_lost"], row["unconfirmed_lost"]) == (0, 0), row
        assert (row["duplicates"], row["out_of_order"]) == (0, 0), row
    assert (stats["c0"]["writes_sent"], stats["c0"]["writes_confirmed"]) == (1, 1)
    (overview,) = run_overview(drill_events).collect()
    assert overview["confirmed_writes"] == 1
    assert (overview["confirmed_lost"], overview["out_of_order"]) == (0, 0)
