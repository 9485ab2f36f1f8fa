"""The hostile scenario's harness: the verdict as a pure function, and
two cheap attacks run for real against a pair."""

from __future__ import annotations

from pathlib import Path

import pytest

from clone.tools.drill.cli import main as drill_main
from clone.tools.hostile.cli import format_line
from clone.tools.hostile.harness import AttackResult, final_stats, judge, longest_gap, run_attack
from clone.tools.hostile.watcher import parse_hugz_lines

HEARTBEAT = 1.0


def _good() -> AttackResult:
    return AttackResult(
        "x", rss_before={"primary": 40 << 20}, rss_peak={"primary": 200 << 20},
        longest_hugz_gap=1.1, baseline_sync=0.05, sync_under_attack=0.2,
        writes_confirmed=100, write_p99=0.02, sigterm_seconds=0.3,
    )  # fmt: skip


def test_judge_passes_within_every_bound() -> None:
    assert judge(_good(), HEARTBEAT) == []


@pytest.mark.parametrize(
    ("change", "text"),
    [
        ({"rss_peak": {"primary": 241 << 20}}, "primary RSS 40 -> 241 MB"),
        ({"longest_hugz_gap": 2.5}, "HUGZ gap 2.50 s > 2 heartbeats"),
        ({"failover": True}, "failover"),
        ({"sigterm_seconds": 1.5}, "SIGTERM not obeyed within 1 s"),
        ({"sigterm_seconds": None}, "SIGTERM not obeyed within 1 s"),
        ({"confirmed_lost": 3}, "3 confirmed writes lost"),
        ({"sync_under_attack": 0.3}, "healthy sync 0.30 s > 0.25 s"),
        ({"sync_under_attack": None}, "healthy sync none > 0.25 s"),
        ({"exited": {"primary": -9}}, "primary exited with -9 under attack"),
    ],
)
def test_judge_names_each_broken_bound(change: dict[str, object], text: str) -> None:
    r = _good()
    for name, value in change.items():
        setattr(r, name, value)
    assert judge(r, HEARTBEAT) == [text]
    assert text in format_line(AttackResult("y", failures=[text]))


def test_the_data_an_attack_stored_is_allowed_on_top_of_the_allowance() -> None:
    r = _good()
    r.rss_peak = {"primary": 400 << 20}  # 40 MB before: 360 MB more
    assert judge(r, HEARTBEAT) == ["primary RSS 40 -> 400 MB"]
    r.store_bytes = {"primary": 175 << 20}  # its --max-bytes share in a 700 MB cgroup
    assert judge(r, HEARTBEAT) == []


def test_a_failed_restart_fails_the_attack() -> None:
    r = _good()
    r.restart = {"primary": None, "backup": "exited -9 after the restart"}
    assert judge(r, HEARTBEAT) == ["backup restart: exited -9 after the restart"]


def test_final_stats_reads_the_last_stats_line() -> None:
    log = ("x INFO stats: {\"store_bytes\": 1}\n"
           "y INFO stats: {\"store_bytes\": 7, \"kvset_refused_full\": 3}\n"
           "z INFO server stopped\n")  # fmt: skip
    assert final_stats(log) == {"store_bytes": 7, "kvset_refused_full": 3}
    assert final_stats("nothing\n") == {}


def test_the_line_shows_both_watchers_the_hosts_lateness_and_a_storing_attacks_baselines() -> None:
    r = _good()
    r.hugz_gap_at, r.hugz_gap_in_harness = 4.5, 1.4
    r.host_wake_late_in_gap, r.host_wake_late = 0.12, 0.3
    line = format_line(r)
    assert "hugz-gap 1.100 s (at 4.500, harness 1.400, host late 0.120 in it, 0.300 max)" in line
    assert "sync 0.050->0.200 s" in line
    r.empty_store_sync = 0.004  # a storing attack: the empty store's, then the data's
    assert "sync 0.004/0.050->0.200 s" in format_line(r)


def test_the_longest_gap_and_where_it_began() -> None:
    # HUGZ before the start count as at the start; the end closes the last gap.
    assert longest_gap([9.0, 10.2, 10.45, 11.3, 11.5], 10.0, 12.0) == pytest.approx((0.85, 10.45))
    assert longest_gap([10.1, 10.3], 10.0, 11.0) == pytest.approx((0.7, 10.3))
    assert longest_gap([], 10.0, 11.5) == pytest.approx((1.5, 10.0))  # none: all of it


def test_the_watchers_lines_are_read_back() -> None:
    text = ("=== 15:00:00 start #1: python -m clone.tools.hostile.watcher primary=tcp://x\n"
            "HUGZ 1700000000.250000 primary\n"
            "HUGZ 1700000000.500000 backup\n"
            "WAKE 1700000000.600000 350\n"
            "HUGZ nonsense primary\n"
            "HUGZ 1700000000.75")  # a torn last line
    assert parse_hugz_lines(text) == [(1700000000.25, "primary"), (1700000000.5, "backup")]
    assert parse_hugz_lines(text, "WAKE ") == [(1700000000.6, "350")]


def test_unknown_attack_is_refused() -> None:
    assert drill_main(["--scenario", "hostile", "--attacks", "nope"]) == 2


@pytest.mark.slow
def test_two_cheap_attacks_against_a_real_pair(tmp_path: Path) -> None:
    lock = run_attack("delete-lock", tmp_path / "lock", hold=2, scale=0.01, rate=10)
    assert lock.failures == [], format_line(lock)
    assert "refusing: database in use" in lock.note
    assert lock.writes_confirmed > 0 and lock.confirmed_lost == 0
    assert lock.sigterm_seconds is not None and set(lock.sigterm) == {"primary", "backup"}
    idle = run_attack("idle-http", tmp_path / "idle", hold=2, scale=0.01, rate=10)
    assert idle.rss_peak["primary"] > 0 and idle.baseline_sync is not None
    assert idle.sync_under_attack is not None
    assert idle.failures == [], format_line(idle)
    # Both watchers heard the primary throughout: the process's gaps are real ones.
    assert 0 < idle.longest_hugz_gap <= 0.5 and 0 < idle.hugz_gap_in_harness
    assert idle.hugz_gap_at is not None and idle.hugz_gap_at >= 0
