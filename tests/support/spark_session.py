"""The one local SparkSession of a test run, shared by every Spark test.

tests/conftest.py registers this module as a plugin, so tests take a ``spark``
argument.  Starting Spark costs
about ten seconds, so the session is built once (whatever number of modules
import the fixture) and stopped when the run ends.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["spark_fixture", "shared_session"]


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
