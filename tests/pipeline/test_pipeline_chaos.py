"""drill-report on a chaos run: Spark reads the same history.jsonl the chaos
checker judged and computes the same figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from clone.pipeline.cli import main
from clone.tools.chaos.report import judge_dir
from tests.tools.test_chaos_checker import good

pytestmark = pytest.mark.spark


def _chaos_run(root: Path) -> Path:
    """A chaos run directory: the checker tests' good history plus faults,
    failovers and writes before, in and late in the run's windows."""
    run = root / "chaos-1"
    run.mkdir()
    history = [
        *good(),
        {"proc": "nemesis", "f": "fault", "kind": "kill", "target": "primary", "t0": 4.0,
         "t1": 6.0, "server_fault": True},
        {"proc": "nemesis", "f": "fault", "kind": "pause-client", "target": "w0", "t0": 7.0,
         "t1": 8.0, "server_fault": False},
        {"proc": "nemesis", "f": "active", "t0": 0.1, "server": "primary"},
        {"proc": "nemesis", "f": "active", "t0": 4.2, "server": "none"},
        {"proc": "nemesis", "f": "active", "t0": 4.9, "server": "backup"},
        {"proc": "nemesis", "f": "active", "t0": 9.0, "server": "primary"},
        {"proc": "w0", "f": "write", "key": "/chaos/w0/9", "value": "w0|9", "t0": -0.4,
         "t1": -0.3, "res": "ok", "seq": 2},
        {"proc": "w0", "f": "write", "key": "/chaos/w0/10", "value": "w0|10", "t0": 12.2,
         "t1": 13.9, "res": "ok", "seq": 15},
    ]
    # The final state holds the extra writes, so that the verdict passes.
    for r in history:
        if r["f"] == "final":
            r["state"].update({"/chaos/w0/9": [2, "w0|9"], "/chaos/w0/10": [15, "w0|10"]})
    (run / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    verdict = judge_dir(run, picture=False)
    assert verdict["ok"], verdict
    return run


def test_drill_report_reads_a_chaos_history_and_agrees_with_the_checker(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _chaos_run(tmp_path)
    out = tmp_path / "report"
    assert main(["drill-report", "--input", str(run), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "1 chaos run(s)" in printed and "differs" not in printed, printed
    data = json.loads((out / "chaos-report.json").read_text())[str(run)]
    verdict = json.loads((run / "verdict.json").read_text())
    assert data["differences"] == []
    for name in ("operations", "faults", "fault_count", "unknowns", "failovers",
                 "availability"):
        assert data["figures"][name] == verdict["figures"][name], name
    assert data["figures"]["failovers"] == 2  # primary -> backup -> primary
    assert data["figures"]["faults"] == {"kill": 1, "pause-client": 1}
    assert data["checks"]["lost_writes"] == "PASS"
    assert "| lost_writes | PASS |" in (out / "chaos-report.md").read_text()

    # A verdict whose figures disagree with the history is reported.
    verdict["figures"]["unknowns"] += 1
    (run / "verdict.json").write_text(json.dumps(verdict))
    assert main(["drill-report", "--input", str(run), "--output", str(out)]) == 0
    assert "differs from the checker's figures" in capsys.readouterr().out
