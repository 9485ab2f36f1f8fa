"""The one place a SparkSession is built.

Entry points (the CLI, the benchmark, the test fixture) call
:func:`build_session`; library code receives the session or a DataFrame and
never builds its own.  Local mode (``local[2]``) is the default, so nothing has
to be running; ``master`` sends the same job to a real cluster.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import sys
import tempfile
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from clone.pipeline.errors import SparkUnavailable

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["DEFAULT_MASTER", "build_session", "check_master_reachable"]

log = logging.getLogger(__name__)

DEFAULT_MASTER = "local[2]"
# Our jobs shuffle little data: Spark's default of 200 partitions would mean 200
# near-empty tasks per shuffle on a two-core laptop.
_SHUFFLE_PARTITIONS = 4
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


def _log4j_config() -> str:
    digest = hashlib.sha1(_LOG4J2.encode()).hexdigest()[:12]
    path = os.path.join(tempfile.gettempdir(), f"clone-pipeline-log4j2-{digest}.properties")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(_LOG4J2)
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


def build_session(master: str = DEFAULT_MASTER, app_name: str = "clone-pipeline") -> SparkSession:
    """A quiet SparkSession on ``master`` with few shuffle partitions.

    Raises :class:`SparkUnavailable` with a one-line reason when Spark cannot
    start (no Java, master unreachable, pyspark missing).
    """
    check_master_reachable(master)
    if master.startswith("local"):
        # Executors in local mode must run this interpreter (our venv), not
        # whatever ``python3`` is first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
        # Everything is on this machine; skips the "hostname resolves to a
        # loopback address" warning.
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    try:
        from pyspark.sql import SparkSession
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SparkUnavailable(
            f"pyspark is not installed ({exc}); install the 'spark' extra"
        ) from None
    active = SparkSession.getActiveSession()
    if active is not None:  # a test run's shared session, or a notebook's
        return active
    java_opts = f"-Dlog4j2.configurationFile=file:{_log4j_config()}"
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(_SHUFFLE_PARTITIONS))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.extraJavaOptions", java_opts)
        .config("spark.executor.extraJavaOptions", java_opts)
    )
    try:
        spark = builder.getOrCreate()
    except Exception as exc:  # Py4J and JVM start-up errors have no common base
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise SparkUnavailable(f"cannot start Spark on {master}: {first}") from None
    spark.sparkContext.setLogLevel("WARN")
    log.info("Spark %s session on %s", spark.version, master)
    return spark
