"""The one local SparkSession of a test run, shared by every Spark test.

tests/conftest.py registers this module as a plugin, so tests take a ``spark``
argument.  Starting Spark costs
about ten seconds, so the session is built once (whatever number of modules
import the fixture) and stopped when the run ends.

Jobs on separate executor JVMs (``CLUSTER_MASTER``) cannot share this JVM: they
run ``clone-pipeline`` or ``spark-submit`` (``spark_script("spark-submit")``,
from pip's pyspark) as child processes, with :func:`child_env`.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["CLUSTER_MASTER", "child_env", "spark_fixture", "shared_session", "spark_script"]

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


@functools.cache
def shared_session() -> SparkSession:
    """Build the session on first use (local[2], quiet, 4 shuffle partitions)."""
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark.*")
    from clone.pipeline.session import build_session

    return build_session("local[2]", "clone-pipeline-tests")


@pytest.fixture(scope="session", name="spark")
def spark_fixture() -> Iterator[SparkSession]:
    session = shared_session()
    yield session
    session.stop()
