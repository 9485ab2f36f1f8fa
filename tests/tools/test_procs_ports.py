"""Where free ports are drawn: ``$CLONE_PORT_RANGE``, and each xdist worker's slice."""

from __future__ import annotations

import itertools
import os

import pytest

from clone.tools import procs
from tests.support.ports import worker_port_range


def test_the_range_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLONE_PORT_RANGE", "25000-26000")
    assert procs.port_range() == (25000, 26000)
    for _ in range(50):
        base = procs.free_base_port()
        assert 25000 <= base and base + 2 < 26000


@pytest.mark.parametrize("text", ["", "junk", "30000-20000", "10-20", "25000-25005", "1-2-3"])
def test_a_bad_range_falls_back_to_the_default(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv("CLONE_PORT_RANGE", text)
    assert procs.port_range() == procs.PORT_RANGE


def test_workers_get_disjoint_slices_of_the_default() -> None:
    slices = [worker_port_range(f"gw{i}", 4) for i in range(4)]
    bounds = [tuple(map(int, s.split("-"))) for s in slices]
    assert bounds[0][0] == procs.PORT_RANGE[0] and bounds[-1][1] <= procs.PORT_RANGE[1]
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(bounds))
    assert worker_port_range("gw5", 4) == slices[1]  # wraps, never out of range


def test_under_xdist_this_worker_draws_from_its_own_slice() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker is None or count < 2:
        pytest.skip("not in a parallel run")
    assert os.environ["CLONE_PORT_RANGE"] == worker_port_range(worker, count)
    low, high = procs.port_range()
    assert low <= procs.free_port() < high
