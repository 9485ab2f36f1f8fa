"""The store's memory budget: the default --max-bytes, and a data directory too big for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from clone.errors import DataDirTooBig
from clone.server.budget import (
    STORE_FRACTION,
    MemoryLimit,
    _cgroup_dirs,
    check_fits,
    collector_hwm,
    default_max_bytes,
    memory_limit,
)
from clone.server.cli import build_parser, config_from_args
from clone.storage import Storage, write_state_file
from clone.storage.schema import DATA_FILE
from tests.support.ports import free_base_port
from tests.support.servers import Servers

MEMINFO = "MemTotal:        2048000 kB\nMemFree:          100000 kB\n"


def test_memtotal_without_a_cgroup_limit() -> None:
    assert memory_limit([], MEMINFO) == MemoryLimit(2048000 * 1024, "MemTotal")


def test_cgroup_v2_max_means_no_limit() -> None:
    assert memory_limit(["max\n"], MEMINFO) == MemoryLimit(2048000 * 1024, "MemTotal")


def test_cgroup_v1_unlimited_is_no_limit() -> None:
    assert memory_limit(["9223372036854771712\n"], MEMINFO).source == "MemTotal"  # type: ignore[union-attr]


def test_the_smallest_cgroup_limit_wins() -> None:
    limits = ["max\n", "734003200\n", "1073741824\n"]
    assert memory_limit(limits, MEMINFO) == MemoryLimit(734003200, "cgroup")


def test_a_cgroup_limit_above_the_machine_is_the_machine() -> None:
    assert memory_limit([str(10 * 1024**4)], MEMINFO) == MemoryLimit(2048000 * 1024, "MemTotal")


def test_garbage_is_ignored_and_nothing_known_is_none() -> None:
    assert memory_limit(["lots\n", ""], "") is None
    assert default_max_bytes(None) == 4 * 1024**3


def test_default_is_the_fraction_of_the_limit() -> None:
    assert default_max_bytes(MemoryLimit(700 * 1024**2, "cgroup")) == int(
        700 * 1024**2 * STORE_FRACTION
    )


def test_cgroup_dirs_of_a_v1_container(tmp_path: Path) -> None:
    """The mount's root is the container's cgroup: the path is matched by its tail."""
    leaf = tmp_path / "memory" / "testgrp"
    leaf.mkdir(parents=True)
    dirs = _cgroup_dirs("4:memory:/outer/container/testgrp\n1:cpu:/\n", tmp_path)
    assert dirs == [leaf, tmp_path / "memory"]


def test_cgroup_dirs_of_v2(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("memory\n")
    (tmp_path / "a" / "b").mkdir(parents=True)
    assert _cgroup_dirs("0::/a/b\n", tmp_path) == [tmp_path / "a" / "b", tmp_path / "a", tmp_path]


def test_flag_given_wins_and_unset_comes_from_the_budget() -> None:
    given = config_from_args(build_parser().parse_args(["--standalone", "--max-bytes", "123"]))
    assert given.core.max_bytes == 123
    unset = config_from_args(build_parser().parse_args(["--standalone"]))
    assert unset.core.max_bytes > 0 and unset.core.max_bytes != 4 * 1024**3


def test_collector_hwm_bounds_a_writers_queue_in_bytes() -> None:
    mib = 1024 * 1024
    largest = mib + 64 * 1024  # MAXMSGSIZE: libzmq drops a sender of a larger frame
    assert collector_hwm(32 * mib, largest, 100_000) == 30
    assert collector_hwm(32 * mib, largest, 10) == 10  # --hwm is lower: it wins
    assert collector_hwm(32 * mib, largest, 0) == 30  # --hwm 0: bytes alone
    assert collector_hwm(1, largest, 100_000) == 1  # never 0 (libzmq: unlimited)
    # Whatever a writer sends, its queue holds at most collector_bytes (+ nothing).
    assert collector_hwm(32 * mib, largest, 100_000) * largest <= 32 * mib
    with pytest.raises(ValueError):
        collector_hwm(0, largest, 1)


def test_the_queue_flags_reach_the_config() -> None:
    args = ["--standalone", "--snapshot-bytes", "1000", "--collector-bytes", "2000",
            "--snapshot-stall-timeout", "2.5"]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(args))
    assert (cfg.snapshot_bytes, cfg.collector_bytes, cfg.snapshot_stall_timeout) == (
        1000, 2000, 2.5)  # fmt: skip
    default = config_from_args(build_parser().parse_args(["--standalone"]))
    assert default.snapshot_bytes == 128 * 1024 * 1024
    assert default.collector_bytes == 32 * 1024 * 1024
    assert default.snapshot_stall_timeout == 10.0


def _state(data_dir: Path, nbytes: int) -> None:
    data_dir.mkdir()
    entries = {
        f"/k{i}".encode(): ((i + 1).to_bytes(8, "big"), b"u" * 16, b"", b"v" * 1000)
        for i in range(nbytes // 1000)
    }
    write_state_file(data_dir / DATA_FILE, entries, sequence=len(entries), term=0)


def test_check_fits(tmp_path: Path) -> None:
    _state(tmp_path / "d", 50_000)
    with Storage.open(tmp_path / "d", checkpoint_interval=3600) as storage:
        size = storage.logical_bytes()
        assert size == sum(len(f"/k{i}") + 8 + 16 + 1000 for i in range(50))
        check_fits(storage, size)
        check_fits(storage, 0)
        with pytest.raises(DataDirTooBig, match=r"holds \d+ bytes of data, more than"):
            check_fits(storage, size - 1)


@pytest.mark.slow
def test_a_server_over_its_budget_at_start_exits_2(servers: Servers) -> None:
    data = servers.data_dir("big")
    _state(data, 200_000)
    port = free_base_port()
    server = servers.spawn(
        "big",
        ["--standalone", "--port", str(port), "--bind", "127.0.0.1",
         "--data-dir", str(data), "--max-bytes", "100000"],
        port,
        None,
    )  # fmt: skip
    assert server.proc is not None
    assert server.proc.wait(timeout=60) == 2
    assert "more than this server's --max-bytes budget of 100000" in server.log_text()
