"""The ``spark`` fixture survives what used to fail every later Spark test:
a JVM that died, and a Py4J call interrupted half-way, as
pytest-timeout's ``signal`` method does to a Spark test that runs too long."""

from __future__ import annotations

import signal
import time
from types import FrameType
from typing import TYPE_CHECKING

import pytest

from tests.support.spark_session import _jvm, discard_session, usable_session

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


class _Interrupted(BaseException):
    """Like pytest-timeout's Failed, not an Exception: Py4J does not catch it."""


def test_a_session_whose_jvm_died_is_replaced_before_it_is_handed_out(
    spark: SparkSession,
) -> None:
    assert spark.range(3).count() == 3
    jvm = _jvm()
    assert jvm is not None
    jvm.kill()
    jvm.wait(30)
    fresh = usable_session()
    assert fresh is not spark
    assert fresh.range(5).count() == 5


def test_after_a_call_interrupted_half_way_a_new_session_answers(spark: SparkSession) -> None:
    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise _Interrupted

    slow_job = spark.range(1).selectExpr("java_method('java.lang.Thread', 'sleep', 5000L)")
    previous = signal.signal(signal.SIGALRM, interrupt)
    # The one real-time timer is pytest-timeout's (the ``signal`` method):
    # borrowed for a second, then given back with what was left of it, so the
    # new session below still has a ceiling.
    ceiling, _ = signal.setitimer(signal.ITIMER_REAL, 1.0)
    borrowed = time.monotonic()
    try:
        with pytest.raises(_Interrupted):  # in the middle of a five-second job
            slow_job.collect()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if ceiling:
            left = ceiling - (time.monotonic() - borrowed)
            signal.setitimer(signal.ITIMER_REAL, max(left, 0.001))
    discard_session()  # what the fixture does after such a failure
    fresh = usable_session()
    assert fresh is not spark
    assert fresh.range(7).count() == 7
