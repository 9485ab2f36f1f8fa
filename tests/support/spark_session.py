"""The one local SparkSession of a test run, shared by every Spark test.

tests/conftest.py registers this module as a plugin, so tests take a ``spark``
argument.  Starting Spark costs
about ten seconds, so the session is built once per process (once per xdist
worker; tests/support/markers.py puts the tests that take this fixture in one
xdist group, so one worker runs them all) and stopped when the run ends.

A Spark test that fails may leave the session unusable: a timeout that
interrupted a Py4J call leaves the gateway out of step (the JVM's answer to the
interrupted call is read by the next call on that thread's connection: a probe
from another thread would not see it), and a JVM may have died.  So after a
Spark test fails with anything but an AssertionError, its JVM is killed and
the next Spark test gets a new session; and a session whose JVM has exited is
replaced before it is handed out: one failure, no cascade.

Jobs on separate executor JVMs (``CLUSTER_MASTER``) cannot share this JVM: they
run ``clone-pipeline`` or ``spark-submit`` (``spark_script("spark-submit")``,
from pip's pyspark) as child processes, with :func:`child_env`.
"""

from __future__ import annotations

import functools
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "CLUSTER_MASTER",
    "child_conf",
    "child_env",
    "discard_session",
    "usable_session",
    "spark_fixture",
    "shared_session",
    "spark_script",
    "TEST_CONF",
    "SparkWithoutFixture",
]

log = logging.getLogger(__name__)


# Two executors of one core and 1 GiB each, in JVMs of their own: what a
# standalone cluster does, on this machine.
CLUSTER_MASTER = "local-cluster[2,1,1024]"


def spark_script(name: str) -> str:
    """A script of pip's pyspark (``spark-submit``…), which is a SPARK_HOME."""
    import pyspark

    path = os.path.join(os.path.dirname(pyspark.__file__), "bin", name)
    assert os.access(path, os.X_OK), f"{path} is not executable"
    return path


def child_env() -> dict[str, str]:
    """The environment of a child Spark driver: our venv's Python on the
    driver and executors, loopback addresses, no inherited gateway."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
    env.update(
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SPARK_LOCAL_IP="127.0.0.1",
    )
    return env


#: Settings of the tests' session over the pipeline's own defaults
#: (clone/pipeline/session.py).  The tests' tables have tens to thousands of
#: rows: two shuffle partitions (one per core) instead of four halve the
#: near-empty tasks of every shuffle; what a test checks is the result of a
#: transform, never how many partitions made it.  The driver JVM's JIT stops at
#: its quick compiler (C1) and collects garbage in one thread: a test run is
#: many short queries, where the optimising compiler's threads cost more CPU
#: than they win back, on two cores shared with the servers of the other
#: worker (the suite's time).  C1 alone gets a 48 MB code cache, the JVM's
#: default without tiers, and one session running every Spark test of a worker
#: back to back filled it ("Out of space in CodeCache", the SparkContext
#: stopped, the drill-report tests failed in a clean-clone run): it gets the
#: 240 MB a tiered JVM has.  The JVMs skip the bytecode verification of the
#: classes they load from pip's pyspark jars (Spark's own code, not input):
#: about 1 of a local job's 13-14 CPU-seconds (an audit on ``local[1]``, runs
#: side by side).  ``defaultJavaOptions`` so that the pipeline's own
#: ``extraJavaOptions`` (the log4j file) stay as they are.  The child Spark
#: processes get the same flags through :func:`child_conf`.
#:
#: The shared session also evaluates its queries without generated code and
#: plans them once, without adaptive re-planning: on tables of tens of rows a
#: query's Janino compiles and AQE's extra stages are most of its CPU.  Side
#: by side (``-m spark``, one process, idle): 157 s and 181 CPU-seconds with
#: Spark's defaults, 141.5 s and 158 without (docs/testing.md, "Ninth pass").
#: Results do not depend on either (Spark's own suites run every expression
#: both ways).  The child Spark processes (local-cluster, the CLI) keep
#: Spark's defaults, so the run still goes through generated code and AQE as
#: a deployment does, and the 1M-row pipeline bench measures them.
JVM_OPTIONS = (
    "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -XX:ReservedCodeCacheSize=240m"
    " -XX:+UnlockDiagnosticVMOptions -XX:-BytecodeVerificationRemote"
)
TEST_CONF: dict[str, str] = {
    "spark.sql.shuffle.partitions": "2",
    "spark.driver.defaultJavaOptions": JVM_OPTIONS,
    "spark.sql.codegen.wholeStage": "false",
    "spark.sql.codegen.factoryMode": "NO_CODEGEN",  # internal; what Spark's own tests set
    "spark.sql.adaptive.enabled": "false",
}


def child_conf() -> list[str]:
    """``--conf`` arguments (for ``spark-submit`` or ``clone-pipeline``) that
    give a child Spark's driver and executor JVMs the flags of
    :data:`TEST_CONF`.  A child runs one small job and exits: its JVMs are
    mostly starting, where the optimising compiler's threads cost CPU they
    never win back (a local-cluster job is three JVMs): side by side, the
    four child-JVM tests took 76-103 s with these flags, 182-218 s without
    (docs/testing.md, "Fifth pass")."""
    return [
        "--conf", f"spark.driver.defaultJavaOptions={JVM_OPTIONS}",
        "--conf", f"spark.executor.defaultJavaOptions={JVM_OPTIONS}",
    ]  # fmt: skip


@functools.cache
def shared_session() -> SparkSession:
    """Build the session on first use (local[2], quiet, :data:`TEST_CONF`)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark.*")
    from clone.pipeline.session import build_session

    return build_session("local[2]", "clone-pipeline-tests", TEST_CONF)


def _jvm() -> subprocess.Popen[bytes] | None:
    """The JVM process of the current gateway (pyspark keeps it as ``proc``)."""
    from pyspark import SparkContext

    return getattr(SparkContext._gateway, "proc", None)


def usable_session() -> SparkSession:
    """:func:`shared_session`, unless its JVM has exited: then a new one."""
    if shared_session.cache_info().currsize:
        jvm = _jvm()
        if jvm is not None and jvm.poll() is not None:
            log.warning("the Spark JVM exited (%s): starting a new session", jvm.returncode)
            discard_session()
    return shared_session()


def discard_session() -> None:
    """Kill the JVM of the current session and forget it everywhere pyspark
    remembers it, so that the next :func:`shared_session` builds a new one.
    (``stop()`` is a Py4J call: through a gateway out of step it may hang.)"""
    from pyspark import SparkContext
    from pyspark.sql import SparkSession

    gateway = SparkContext._gateway
    proc = getattr(gateway, "proc", None)
    if proc is not None:
        proc.kill()
        try:
            proc.wait(timeout=30)
        except Exception:  # an unkillable JVM: still forget it
            log.warning("the old Spark JVM (pid %s) did not exit", proc.pid)
    if gateway is not None:
        try:
            gateway.close()
        except Exception:  # its sockets go with the JVM anyway
            pass
    SparkContext._active_spark_context = None
    SparkContext._gateway = None
    SparkContext._jvm = None
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    shared_session.cache_clear()


_BROKEN = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # An AssertionError is raised by the test's own Python between Py4J calls;
    # anything else (a timeout's Failed, a Py4JError, an interrupt) may have
    # left a call half-way.
    if (
        report.when == "call"
        and report.failed
        and call.excinfo is not None
        and not call.excinfo.errisinstance(AssertionError)
    ):
        item.stash[_BROKEN] = True
    return report


class SparkWithoutFixture(RuntimeError):
    """A test that does not take the ``spark`` fixture started Spark in its
    worker's process."""


def _gateway() -> object | None:
    """pyspark's gateway to a JVM in this process, if pyspark was imported.  The
    gateway, not the SparkContext: a command that stops its session at the end
    leaves the JVM running for as long as the process lives."""
    if "pyspark" not in sys.modules:
        return None
    from pyspark import SparkContext

    return SparkContext._gateway


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    """A test without the ``spark`` fixture that starts Spark in-process
    (``clone.pipeline.main`` does, for most commands) is an error: it is not in
    the Spark group, so it started a JVM of its own on another worker, which
    then lived to the end of the run (found so: 8 CPU-seconds and a GiB).
    Its JVM is killed and the test fails, saying what to do."""
    if "spark" in getattr(item, "fixturenames", ()) or _gateway() is not None:
        return (yield)
    try:
        result = yield
    except BaseException:
        if _gateway() is not None:
            discard_session()
        raise
    if _gateway() is not None:
        discard_session()
        raise SparkWithoutFixture(
            f"{item.nodeid} started Spark in its worker without the spark fixture: take the "
            "fixture (one session in the Spark group), or run Spark in a child process"
        )
    return result


@pytest.fixture(name="spark")
def spark_fixture(request: pytest.FixtureRequest) -> Iterator[SparkSession]:
    session = usable_session()
    yield session
    if request.node.stash.get(_BROKEN, False):
        log.warning("%s failed with the session maybe half-way through a call: "
                    "the next Spark test starts a new one", request.node.nodeid)
        discard_session()


@pytest.fixture(scope="session", autouse=True)
def _stop_spark() -> Iterator[None]:
    """Stop the session at the end of the run, if one was started."""
    yield
    if shared_session.cache_info().currsize:
        try:
            shared_session().stop()
        except Exception:  # a dead JVM at the end of the run
            log.warning("stopping the Spark session failed", exc_info=True)
