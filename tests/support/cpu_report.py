"""``--cpu-report``: the CPU each test used, not its wall time.

On a 2-core machine running four xdist workers the suite's wall time is
bounded by its CPU, and a test that mostly waits costs little however long it
takes; ``--durations`` cannot tell the two apart. With ``--cpu-report`` each
test's setup, call and teardown are measured in the process that runs them
(the xdist worker): its own CPU (``RUSAGE_SELF``, user + system) and that of
the children it reaped meanwhile (``RUSAGE_CHILDREN``: a server a fixture
stops at teardown is counted there, a process still running is not). The
figures travel on each report's ``user_properties``, so the controller sums
them whatever worker ran the test, and the run ends with the top tests and
the top files. ``--cpu-report-file PATH`` also writes one JSON line per test,
to compare runs.

A module- or session-scoped fixture is counted in the test whose setup
started it and the one whose teardown stopped it; the collection and start of
the worker itself are in no test.
"""

from __future__ import annotations

import json
import resource
from collections import defaultdict
from collections.abc import Generator

import pytest

__all__ = ["cpu_now"]

_KEY_SELF = "cpu_self"
_KEY_CHILDREN = "cpu_children"
_TOP = 20
_stash_start = pytest.StashKey[tuple[float, float]]()


def cpu_now() -> tuple[float, float]:
    """CPU-seconds (user + system) so far of this process and of its reaped
    children."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("clone")
    group.addoption(
        "--cpu-report",
        action="store_true",
        default=False,
        help="end the run with the tests and files that used the most CPU "
        "(the worker's own and its reaped children's, setup+call+teardown)",
    )
    group.addoption(
        "--cpu-report-file",
        default=None,
        metavar="PATH",
        help="with --cpu-report: also write one JSON line per test to PATH",
    )


def _enabled(config: pytest.Config) -> bool:
    return bool(config.getoption("--cpu-report", default=False))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, None, None]:
    outcome = yield
    if not _enabled(item.config):
        return
    start = item.stash.get(_stash_start, None)
    now = cpu_now()
    if start is not None:
        report = outcome.get_result()
        report.user_properties.append((_KEY_SELF, now[0] - start[0]))
        report.user_properties.append((_KEY_CHILDREN, now[1] - start[1]))
    # The next phase starts here: what the report itself cost is in it.
    item.stash[_stash_start] = now


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, None, None]:
    if _enabled(item.config):
        item.stash[_stash_start] = cpu_now()
    yield


class _Totals:
    """CPU per test, summed over its phases as the reports arrive (in the
    controller under xdist), and the summary at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.own: dict[str, float] = defaultdict(float)
        self.children: dict[str, float] = defaultdict(float)

    def total(self, nodeid: str) -> float:
        return self.own[nodeid] + self.children[nodeid]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        for key, value in report.user_properties:
            if key == _KEY_SELF:
                self.own[report.nodeid] += float(value)
            elif key == _KEY_CHILDREN:
                self.children[report.nodeid] += float(value)

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.own:
            return
        ids = sorted(self.own, key=self.total, reverse=True)
        by_file: dict[str, float] = defaultdict(float)
        for nodeid in ids:
            by_file[nodeid.split("::", 1)[0]] += self.total(nodeid)
        write = terminalreporter.write_line
        terminalreporter.section("CPU per test (worker + reaped children, CPU-seconds)")
        write(f"all {len(ids)} tests: {sum(self.total(n) for n in ids):.1f}")
        write(f"{'total':>7} {'own':>7} {'child':>7}  test")
        for nodeid in ids[:_TOP]:
            own, kids = self.own[nodeid], self.children[nodeid]
            write(f"{own + kids:7.1f} {own:7.1f} {kids:7.1f}  {nodeid}")
        write(f"{'total':>7}  file")
        for path, cpu in sorted(by_file.items(), key=lambda kv: kv[1], reverse=True)[:_TOP]:
            write(f"{cpu:7.1f}  {path}")
        out_path = self.config.getoption("--cpu-report-file")
        if out_path:
            with open(out_path, "w", encoding="utf-8") as out:
                for nodeid in ids:
                    row = {"own": self.own[nodeid], "children": self.children[nodeid]}
                    out.write(json.dumps({"test": nodeid, **row}) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if _enabled(config):
        config.pluginmanager.register(_Totals(config), "clone-cpu-report")
