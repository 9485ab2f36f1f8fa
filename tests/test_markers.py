"""The markers are true: tests/support/markers.py keeps them so, and this checks it.

Collects the whole suite in-process (no test runs) and checks every test that
uses a real-process fixture is ``slow`` and every test that uses Spark is
``spark``, with the timeouts and xdist group the plugin promises; then runs
small inline sessions (pytester, in this process) to check the guard fails a
fast test that starts a process, before the process exists.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from tests.support import ordering
from tests.support.markers import (
    ALL_ITEMS,
    SLOW_TIMEOUT,
    SPARK_TIMEOUT,
    GroupIds,
    paused,
    process_fixtures,
)

pytest_plugins = ["pytester"]

# Run alone (not the whole suite), the ``collected`` fixture collects the
# suite in this process: 50-75 s at load average 25, past the fast tests'
# 60 s ceiling (an error at setup, nothing wrong).  A ceiling that only
# bounds a hang.
pytestmark = pytest.mark.timeout(180)

TESTS = Path(__file__).resolve().parent


class _Collector:
    def __init__(self) -> None:
        self.items: list[pytest.Item] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.items = list(session.items)


@pytest.fixture(scope="module")
def collected(request: pytest.FixtureRequest) -> list[pytest.Item]:
    """Every test of the suite: this run's own collection when it is the whole
    suite (scripts/test, with or without --quick), else a collection of its own."""
    config = request.config
    args = [(config.invocation_params.dir / a).resolve() for a in config.args]
    if args and all(a == TESTS for a in args) and ALL_ITEMS in config.stash:
        return config.stash[ALL_ITEMS]
    collector = _Collector()
    with paused():
        code = pytest.main(
            ["--collect-only", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(TESTS)],
            plugins=[collector],
        )
    assert code == pytest.ExitCode.OK, code
    return collector.items


def _timeout(item: pytest.Item) -> float:
    marker = item.get_closest_marker("timeout")
    assert marker is not None, item.nodeid
    return float(marker.args[0] if marker.args else marker.kwargs["timeout"])


def test_every_test_that_uses_a_real_process_fixture_is_slow(collected: list[pytest.Item]) -> None:
    users = [item for item in collected if process_fixtures(item)]
    # Not vacuous: the servers fixture alone has hundreds of users.
    assert len(users) > 100, len(users)
    unmarked = [
        f"{item.nodeid} ({', '.join(process_fixtures(item))})"
        for item in users
        if item.get_closest_marker("slow") is None
    ]
    assert not unmarked, "\n".join(unmarked)
    assert all(_timeout(item) >= SLOW_TIMEOUT for item in users if not item.get_closest_marker(
        "spark"))


def test_the_files_the_issue_names_are_slow_where_they_start_servers(
    collected: list[pytest.Item],
) -> None:
    """test_backup, test_relay_e2e, test_history_e2e and test_request_storm
    started servers without the marker."""
    for name in ("test_backup.py", "test_relay_e2e.py", "test_history_e2e.py",
                 "test_request_storm.py"):
        serving = [
            i for i in collected
            if i.path.name == name and "servers" in getattr(i, "fixturenames", ())
        ]
        assert serving, name
        assert all(i.get_closest_marker("slow") for i in serving), name


def test_every_spark_test_is_marked_grouped_and_given_a_patient_timeout(
    collected: list[pytest.Item],
) -> None:
    users = [item for item in collected if "spark" in getattr(item, "fixturenames", ())]
    assert len(users) > 20, len(users)
    for item in users:
        assert item.get_closest_marker("spark") is not None, item.nodeid
        assert _timeout(item) >= SPARK_TIMEOUT, item.nodeid
        # Never the thread method: it ends the worker, and xdist's loadgroup
        # then hangs the run when it replaces it.
        assert item.get_closest_marker("timeout").kwargs.get("method") == "signal", item.nodeid
        groups = [m.args[0] for m in item.iter_markers("xdist_group")]
        assert "spark" in groups, item.nodeid


def test_a_spark_test_with_its_own_spark_processes_is_not_queued_behind_the_group(
    collected: list[pytest.Item],
) -> None:
    """The local-cluster and spark-submit tests start their own JVMs as child
    processes: in the ``spark`` group they only lengthened the one worker's
    queue, which bounded the whole run's time."""
    children = [
        i for i in collected
        if i.get_closest_marker("spark") is not None
        and "spark" not in getattr(i, "fixturenames", ())
    ]
    names = {i.name for i in children}
    assert {"test_audit_on_local_cluster", "test_spark_submit_load_on_local_cluster"} <= names
    for item in children:
        assert _timeout(item) >= SPARK_TIMEOUT, item.nodeid
        assert "spark" not in [m.args[0] for m in item.iter_markers("xdist_group")], item.nodeid


def _quiet_asyncio(pytester: pytest.Pytester) -> None:
    """``getitems`` takes no ``-p no:asyncio``: give its directory the one
    setting of our setup.cfg whose absence makes pytest-asyncio warn (a
    deprecation in every CI log)."""
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def test_a_grouped_test_carries_the_group_in_its_id_for_xdist(pytester: pytest.Pytester) -> None:
    """xdist's loadgroup schedules by an ``@group`` suffix of the test's id,
    which xdist 3.8 cannot set under pytest 9: GroupIds sets it, once."""
    _quiet_asyncio(pytester)
    items = pytester.getitems(
        "import pytest\n"
        "@pytest.mark.xdist_group('spark')\n"
        "def test_a(): pass\n"
        "@pytest.mark.parametrize('x', ['a@b'])\n"
        "@pytest.mark.xdist_group('netns')\n"
        "def test_b(x): pass\n"
        "def test_c(): pass\n"
    )
    ids = [i.nodeid for i in items]
    config = types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=False))
    hook = GroupIds()
    hook.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ids  # not under loadgroup: as they are
    config.option.loadgroup = True
    hook.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    hook.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == [f"{ids[0]}@spark", f"{ids[1]}@netns", ids[2]]


def test_under_loadgroup_the_heavy_kinds_of_test_are_handed_out_first(
    pytester: pytest.Pytester,
) -> None:
    """xdist hands the single tests out in collection order: a Spark job or a
    server test collected late ran alone at the end of the run.  Under
    ``loadgroup`` they come first, each kind in its collection order."""
    _quiet_asyncio(pytester)
    items = pytester.getitems(
        "import pytest\n"
        "def test_pure_1(): pass\n"
        "@pytest.mark.slow\n"
        "def test_server_1(): pass\n"
        "def test_pure_2(): pass\n"
        "@pytest.mark.spark\n"
        "def test_cluster(): pass\n"
        "@pytest.mark.slow\n"
        "def test_server_2(): pass\n"
    )
    names = [i.name for i in items]
    config = types.SimpleNamespace(option=types.SimpleNamespace(loadgroup=False))
    ordering.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.name for i in items] == names  # not under loadgroup: pytest's order
    config.option.loadgroup = True
    ordering.pytest_collection_modifyitems(config, items)  # type: ignore[arg-type]
    assert [i.name for i in items] == [
        "test_cluster", "test_server_1", "test_server_2", "test_pure_1", "test_pure_2",
    ]  # fmt: skip


def test_the_quick_set_holds_no_process_and_no_spark_test(collected: list[pytest.Item]) -> None:
    quick = [
        i for i in collected
        if i.get_closest_marker("slow") is None and i.get_closest_marker("spark") is None
    ]
    assert len(quick) > 1000, len(quick)
    offenders = [
        i.nodeid for i in quick
        if process_fixtures(i) or "spark" in getattr(i, "fixturenames", ())
    ]
    assert not offenders, offenders


# The inline sessions' tests start their processes through importlib, out of
# the reader's sight, as a method call on some object would.
_HIDDEN = '''
import importlib

def test_hidden():
    importlib.import_module("subprocess").run(["true"])
'''

#: The inline sessions: our plugin, no xdist, no pytest-asyncio (which warns
#: without the setup.cfg the inline directory lacks).
_INLINE = ("-p", "tests.support.markers", "-p", "no:xdist", "-p", "no:asyncio")

_PLAIN = '''
import subprocess

def test_plain():
    subprocess.run(["true"])

def test_pure():
    assert 1 + 1 == 2
'''


def test_the_guard_fails_a_fast_test_that_starts_a_process(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_hidden=_HIDDEN)
    result = pytester.runpytest_inprocess(*_INLINE)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*ProcessInFastTest: test_hidden.py::test_hidden is not marked slow but starts a process*"]
    )


def test_the_reader_marks_a_test_that_uses_subprocess_slow(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=_PLAIN)
    result = pytester.runpytest_inprocess(
        *_INLINE, "-m", "not slow", "--strict-markers", "-o", "markers=slow\nspark"
    )
    result.assert_outcomes(passed=1, deselected=1)


_SPARK_WITHOUT_FIXTURE = '''
from pyspark import SparkContext

class _Gateway:  # what a started JVM leaves in pyspark, without the JVM
    proc = None
    def close(self):
        pass

def test_starts_spark():
    SparkContext._gateway = _Gateway()

def test_after():
    assert SparkContext._gateway is None  # the guard forgot the gateway
'''


@pytest.mark.slow  # a process of its own: the guard resets pyspark's globals
def test_a_test_that_starts_spark_without_the_fixture_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS.parent))  # our tests.support
    pytester.makepyfile(test_spark_alone=_SPARK_WITHOUT_FIXTURE)
    result = pytester.runpytest_subprocess(
        "-p", "tests.support.spark_session", "-p", "no:xdist", "-p", "no:asyncio",
        "-p", "no:cacheprovider",
    )  # fmt: skip
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        ["*SparkWithoutFixture: test_spark_alone.py::test_starts_spark started Spark in its"
         " worker without the spark fixture*"]
    )
