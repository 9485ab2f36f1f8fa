"""A short real chaos run: a server pair, recording clients, seeded
faults; every check passes, the output files exist, and the checker run again
on the saved history gives the same verdict.

Slow: a minute of faults, about 80 s in all on a busy machine.  Without root
the partition and disk faults are left out (the run says so); the faults it
can do still run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clone.tools.chaos import check
from clone.tools.chaos.checker import CHECKS
from clone.tools.chaos.faults import FakeClock, find_libfaketime, sweep_faketime_segments
from clone.tools.drill import cli

SEED = 1  # as root: kill-both, a clock step, partition-all (plan.json)
DURATION = 60  # seconds of faults and traffic, as docs/drills.md asks


@pytest.mark.slow
@pytest.mark.timeout(600)  # a minute of faults, then the settling and the judging, on a busy host
def test_a_short_chaos_run_passes_and_its_history_judges_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "chaos"
    rc = cli.main(["--scenario", "chaos", "--duration", str(DURATION), "--seed", str(SEED),
                   "--out", str(out), "--gap", "2", "4", "--length", "1", "3"])
    printed = capsys.readouterr().out
    verdict = json.loads((out / "verdict.json").read_text())
    assert rc == 0, printed
    assert verdict["ok"] is True and verdict["seed"] == SEED
    assert set(verdict["checks"]) == set(CHECKS)
    # Every check passes, the counters' too: an increment in a split brain is
    # judged by the heal's rule (docs/drills.md, "Split brains"), not skipped.
    statuses = {n: c["status"] for n, c in verdict["checks"].items()}
    assert all(s == "PASS" for s in statuses.values()), verdict["checks"]
    assert verdict["checks"]["cas_counters"]["checked"] >= 1, verdict["checks"]["cas_counters"]
    # Real traffic was judged: confirmed writes, increments, lock holds, leases.
    checked = {n: c["checked"] for n, c in verdict["checks"].items()}
    assert checked["lost_writes"] > 20 and checked["linearizable_cas"] > 10, checked
    assert checked["fencing"] > 0 and checked["watchers"] > 0, checked
    assert verdict["figures"]["fault_count"] >= 1, verdict["figures"]
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["faults"]) == verdict["figures"]["fault_count"]
    # libfaketime only on the servers whose clock the plan steps.
    stepped = {f["target"] for f in plan["faults"] if f["kind"] == "clock-step"}
    assert plan["faketime"] == sorted(stepped), plan
    for name in ("history.jsonl", "verdict.json", "verdict.md", "timeline.png", "plan.json"):
        assert (out / name).stat().st_size > 0, name
    lines = (out / "history.jsonl").read_text().splitlines()
    kinds = {json.loads(line)["f"] for line in lines}
    assert {"write", "cas", "acquire", "fence", "lease", "died", "update", "fault",
            "final"} <= kinds
    assert "| lost_writes | PASS |" in (out / "verdict.md").read_text()
    # The checker alone, on the saved history: the same verdict.
    (out / "verdict.json").unlink()
    assert check.main([str(out), "--no-picture"]) == 0
    again = json.loads((out / "verdict.json").read_text())
    assert {n: c["status"] for n, c in again["checks"].items()} == {
        n: c["status"] for n, c in verdict["checks"].items()}


def test_without_root_the_kinds_that_need_it_are_left_out_with_a_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clone.tools.chaos import runner
    from clone.tools.chaos.schedule import FAULT_KINDS, NEEDS_ROOT
    from clone.tools.drill.netns import NetnsUnavailable

    def no_netns() -> None:
        raise NetnsUnavailable("the partition drills need root")

    monkeypatch.setattr(runner, "preflight", no_netns)
    monkeypatch.setattr(runner.os, "geteuid", lambda: 1000)
    # Whether this machine has Debian's faketime is not the question here.
    monkeypatch.setattr(runner, "find_libfaketime", lambda: "/usr/lib/libfaketimeMT.so.1")
    said: list[str] = []
    kinds, skipped = runner.usable_kinds(FAULT_KINDS, said.append)
    assert not set(kinds) & set(NEEDS_ROOT)
    assert {"kill", "pause-client", "restart-storm"} <= set(kinds)
    assert said == skipped and len(said) == 2
    assert said[0].startswith("partition faults skipped: the partition drills need root")
    assert said[1] == "disk-full skipped: mounting a small tmpfs needs root"


def test_without_libfaketime_the_clock_step_is_left_out_with_the_package_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from clone.tools.chaos import runner

    monkeypatch.setattr(runner, "find_libfaketime", lambda: None)
    said: list[str] = []
    kinds, skipped = runner.usable_kinds(("kill", "clock-step"), said.append)
    assert kinds == ("kill",)
    assert said == skipped == [
        "clock-step skipped: libfaketime is not installed (Debian: apt-get install faketime)"]


def test_the_settle_reads_a_pair_alone_active_from_the_monitors_record() -> None:
    import time

    from clone.tools.chaos.runner import _alone_throughout
    from clone.tools.drill.watch import HugzMonitor

    def record(*beats: tuple[float, str]) -> HugzMonitor:
        monitor = HugzMonitor({}, 0.25)  # not started: its record is ours
        now = time.time()
        monitor.history = sorted((now - ago, name) for ago, name in beats)
        return monitor

    steady = [(i * 0.25, "primary") for i in range(16)]  # the last 4 s
    assert _alone_throughout(record(*steady), 2.0) == "primary"
    # Both sent HUGZ within the 2 s (a split brain): not settled.
    assert _alone_throughout(record(*steady, (1.0, "backup")), 2.0) is None
    # Silent for the last 1.5 s (no one active at the end): not settled.
    assert _alone_throughout(record(*[(a, n) for a, n in steady if a > 1.5]), 2.0) is None
    # Active for only the last second of the 2: not yet.
    assert _alone_throughout(record(*[(a, n) for a, n in steady if a < 1.0]), 2.0) is None


def test_the_sweep_removes_the_segments_of_ended_processes_only(tmp_path: Path) -> None:
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    dead, alive = int(ended.stdout), os.getpid()
    names = [f"faketime_shm_{dead}", f"sem.faketime_sem_{dead}", f"faketime_shm_{alive}",
             f"sem.faketime_sem_{alive}", "other_shm_1", "faketime_shm_x"]  # fmt: skip
    for name in names:
        (tmp_path / name).write_bytes(b"")
    assert sweep_faketime_segments(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    assert sweep_faketime_segments(tmp_path / "missing") == 0


def test_a_faketime_process_that_exits_without_its_destructor_is_swept(tmp_path: Path) -> None:
    # What a server does: os._exit under libfaketime leaves its pair in /dev/shm.
    lib = find_libfaketime()
    if lib is None:
        pytest.skip("libfaketime is not installed (Debian: apt-get install faketime)")
    clock = FakeClock(lib, tmp_path / "clock")
    exits = "import os; print(os.getpid()); os._exit(0)"
    done = subprocess.run([sys.executable, "-c", exits], env=clock.env,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    pid = int(done.stdout)
    left = {f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"}
    shm = Path("/dev/shm")
    assert left <= {p.name for p in shm.iterdir()}, "libfaketime no longer leaves them"
    assert sweep_faketime_segments() >= 2
    assert not left & {p.name for p in shm.iterdir()}
