"""The one place a SparkSession is built.

Entry points (the CLI, the benchmark, the test fixture) call
:func:`build_session` or :func:`spark_session`; library code receives the
session or a DataFrame and never builds its own.  Local mode (``local[2]``) is
the default, so nothing has to be running; ``master`` sends the same job to a
real cluster.

Where a setting comes from, weakest first (docs/pipeline.md, "Precedence"):

1. our defaults (:data:`DEFAULTS`: quiet, UI off, few shuffle partitions);
2. what ``spark-submit`` was given (``--master``, ``--conf``,
   ``spark-defaults.conf``): under spark-submit the driver JVM is already
   running with them, and a default of ours never replaces one of them;
3. ``--conf key=value`` of ``clone-pipeline``;

and the master: spark-submit's, else ``--master``, else ``local[2]``.  A
``--master`` that disagrees with spark-submit's is ignored with a warning,
because spark-submit has already chosen the deploy mode (and on YARN or
Kubernetes started the driver) for its master.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from clone.pipeline.errors import SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = [
    "DEFAULT_MASTER",
    "DEFAULTS",
    "build_session",
    "check_master_reachable",
    "parse_conf",
    "resolve_master",
    "session_settings",
    "spark_session",
]

log = logging.getLogger(__name__)

DEFAULT_MASTER = "local[2]"
# Our jobs shuffle little data: Spark's default of 200 partitions would mean 200
# near-empty tasks per shuffle on a two-core laptop.
_SHUFFLE_PARTITIONS = 4
DEFAULTS: Mapping[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": str(_SHUFFLE_PARTITIONS),
    "spark.sql.execution.arrow.pyspark.enabled": "true",
    "spark.sql.session.timeZone": "UTC",
}
# Set by spark-submit (and the pyspark shell) for the Python driver it starts:
# the JVM, and with it the submitted configuration, already exists.
_GATEWAY_ENV = "PYSPARK_GATEWAY_PORT"
# JVM logging: warnings and errors only, and not Hadoop's native-library notice.
# TaskSetManager's "task of very large size" warning is expected: an export
# ships the driver's snapshot to the executors inside its tasks.  A failed task
# still fails the job with its error.
_LOG4J2 = """\
rootLogger.level = warn
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n%ex
logger.hadoop.name = org.apache.hadoop.util.NativeCodeLoader
logger.hadoop.level = error
logger.shutdown.name = org.apache.spark.util.ShutdownHookManager
logger.shutdown.level = error
logger.blockmanager.name = org.apache.spark.storage.BlockManager
logger.blockmanager.level = error
logger.tsm.name = org.apache.spark.scheduler.TaskSetManager
logger.tsm.level = error
"""
# Without -v: a task's failure reaches Python as an exception, which the CLI
# turns into one line; the executor's own ERROR line with the Java trace
# would only repeat it at length.
_QUIET_TASKS = """\
logger.executor.name = org.apache.spark.executor.Executor
logger.executor.level = off
logger.tsm.level = off
logger.pyrunner.name = org.apache.spark.api.python.PythonRunner
logger.pyrunner.level = off
"""


def _log4j_config() -> str:
    text = _LOG4J2
    if not logging.getLogger("clone.pipeline").isEnabledFor(logging.DEBUG):
        text += _QUIET_TASKS
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"clone-pipeline-log4j2-{digest}.properties")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    return path


def check_master_reachable(master: str, timeout: float = 5.0) -> None:
    """Fail fast when a ``spark://host:port`` master does not accept connections.

    Without this, Spark retries registration for about a minute before it
    gives up, with a page of stack traces.  Other masters (local, yarn, k8s)
    are left to Spark.
    """
    if not master.startswith("spark://"):
        return
    for hostport in master[len("spark://") :].split(","):
        parts = urlsplit(f"//{hostport}")
        host, port = parts.hostname, parts.port or 7077
        if not host:
            continue
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except OSError as exc:
            log.debug("master %s:%s: %s", host, port, exc)
    raise SparkUnavailable(f"Spark master {master} is unreachable")


def parse_conf(item: str) -> tuple[str, str]:
    """One ``--conf key=value``: ``key`` must be a ``spark.*`` setting.

    Raises :class:`ValueError` saying what is wrong; anything else (a typo of
    ours, a Hadoop setting without its ``spark.hadoop.`` prefix) would be
    silently ignored by Spark.
    """
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"{item!r} is not of the form spark.key=value")
    if not key.startswith("spark.") or key == "spark.":
        raise ValueError(
            f"{key!r} is not a Spark setting: keys start with 'spark.' "
            "(Hadoop settings with 'spark.hadoop.')"
        )
    if key == "spark.master":
        raise ValueError("spark.master is set with --master (or spark-submit's --master)")
    return key, value


def resolve_master(requested: str | None, submitted: str | None) -> str:
    """The master to use: spark-submit's (``submitted``), else ``--master``
    (``requested``), else :data:`DEFAULT_MASTER`."""
    if submitted:
        if requested and requested != submitted:
            log.warning(
                "ignoring --master %s: spark-submit set the master to %s", requested, submitted
            )
        return submitted
    return requested or DEFAULT_MASTER


def session_settings(
    master: str, submitted: Mapping[str, str], conf: Mapping[str, str]
) -> dict[str, str]:
    """The settings to give the SparkSession builder (the master aside).

    Our defaults, minus whatever spark-submit already set, plus ``conf``.  The
    log4j file is a file on this machine: the driver's JVM reads it when we
    start that JVM (not under spark-submit), executors only in local modes.
    """
    settings = {k: v for k, v in DEFAULTS.items() if k not in submitted}
    java_opts = f"-Dlog4j2.configurationFile=file:{_log4j_config()}"
    if not submitted and "spark.driver.extraJavaOptions" not in conf:
        settings["spark.driver.extraJavaOptions"] = java_opts
    if master.startswith("local") and "spark.executor.extraJavaOptions" not in submitted:
        settings["spark.executor.extraJavaOptions"] = java_opts
    settings.update(conf)
    return settings


def _submitted_conf() -> dict[str, str]:
    """The configuration spark-submit started the driver JVM with, or {}."""
    if not os.environ.get(_GATEWAY_ENV):
        return {}
    from pyspark import SparkConf, SparkContext

    SparkContext._ensure_initialized()  # connects to spark-submit's JVM, starts none
    return dict(SparkConf().getAll())


def build_session(
    master: str | None = None,
    app_name: str = "clone-pipeline",
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A quiet SparkSession with few shuffle partitions.

    ``master``: spark-submit's if the driver runs under it, else this, else
    :data:`DEFAULT_MASTER`; ``conf``: ``spark.*`` settings over our defaults
    and spark-submit's.  An active session (a test run's, a notebook's) is
    returned as it is.

    Raises :class:`SparkUnavailable` with a one-line reason when Spark cannot
    start (no Java, master unreachable, pyspark missing).
    """
    return _start(master, app_name, conf or {})[0]


@contextmanager
def spark_session(
    master: str | None = None,
    app_name: str = "clone-pipeline",
    conf: Mapping[str, str] | None = None,
) -> Iterator[SparkSession]:
    """:func:`build_session` for one job: the session is stopped afterwards
    if this built it (a clean stop lets a cluster's executors exit quietly)."""
    spark, built = _start(master, app_name, conf or {})
    try:
        yield spark
    finally:
        if built:
            spark.stop()


def _start(master: str | None, app_name: str, conf: Mapping[str, str]) -> tuple[SparkSession, bool]:
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SparkUnavailable(
            f"pyspark is not installed ({exc}); install the 'spark' extra"
        ) from None
    active = SparkSession.getActiveSession()
    if active is not None:  # a test run's shared session, or a notebook's
        running = active.sparkContext.master
        if master is not None and master != running:
            # Asked for another master: one JVM holds one SparkContext, so say
            # why not (an unreachable master first), never run on the wrong one.
            check_master_reachable(master)
            raise SparkUnavailable(
                f"this process already runs a Spark session on {running}; --master {master}"
                " cannot start another here: run the command in its own process"
            )
        return active, False
    submitted = _submitted_conf()
    master = resolve_master(master, submitted.get("spark.master"))
    check_master_reachable(master)
    if master.startswith("local"):
        # Executors in local modes (local-cluster too: separate JVMs, same
        # machine) must run this interpreter (our venv), not whatever
        # ``python3`` is first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        # Everything is on this machine; skips the "hostname resolves to a
        # loopback address" warning.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    builder = SparkSession.builder.master(master)
    # spark-submit always names the app, after the script unless given --name.
    if not submitted.get("spark.app.name", ".py").endswith(".py"):
        app_name = submitted["spark.app.name"]
    builder = builder.appName(app_name)
    for key, value in session_settings(master, submitted, conf).items():
        builder = builder.config(key, value)
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J and JVM start-up errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SparkUnavailable(f"cannot start Spark on {master}: {first}") from None
    spark.sparkContext.setLogLevel("WARN")
    log.info("Spark %s session on %s", spark.version, spark.sparkContext.master)
    return spark, True
