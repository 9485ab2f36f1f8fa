"""LatencyHistogram on hdrhistogram: percentiles of known distributions, and a
histogram recorded in another process arriving whole (as the bench's watchers send it)."""

from __future__ import annotations

import multiprocessing
import random

import pytest

from clone.tools.histogram import PERCENTILES, LatencyHistogram


def _uniform(lo_us: int, hi_us: int) -> LatencyHistogram:
    hist = LatencyHistogram()
    for us in range(lo_us, hi_us + 1):
        hist.record_us(us)
    return hist


def test_uniform_percentiles_within_three_significant_digits() -> None:
    hist = _uniform(1, 100_000)  # 1 us .. 100 ms, each once
    assert hist.count == 100_000
    for p in PERCENTILES:
        assert hist.percentile_ms(p) == pytest.approx(p, rel=1e-3)  # p % of 100 ms
    assert hist.max_ms() == pytest.approx(100.0, rel=1e-3)
    summary = hist.summary()
    assert summary["mean_ms"] == pytest.approx(50.0, rel=1e-3)
    assert set(summary) == {"count", "mean_ms", "p50_ms", "p90_ms", "p99_ms", "p99_9_ms",
                            "p99_99_ms", "max_ms"}


def test_bimodal_tail_shows_in_the_high_percentiles() -> None:
    hist = LatencyHistogram()
    for _ in range(990):
        hist.record_seconds(0.001)  # 1 ms
    for _ in range(10):
        hist.record_seconds(0.250)  # 1 % at 250 ms
    assert hist.percentile_ms(50) == pytest.approx(1.0, rel=1e-3)
    assert hist.percentile_ms(99) == pytest.approx(1.0, rel=1e-3)
    assert hist.percentile_ms(99.9) == pytest.approx(250.0, rel=1e-3)


def test_exponential_against_its_quantile_function() -> None:
    rng = random.Random(7)
    hist = LatencyHistogram()
    for _ in range(200_000):
        hist.record_seconds(rng.expovariate(1 / 0.002))  # mean 2 ms
    # Quantile of Exp(mean m): -m ln(1 - p); sampling error dominates HDR's 0.1 %.
    for p, expected_ms in [(50, 1.386), (90, 4.605), (99, 9.210)]:
        assert hist.percentile_ms(p) == pytest.approx(expected_ms, rel=0.03)


def test_out_of_range_values_are_clamped_and_negatives_counted() -> None:
    hist = LatencyHistogram()
    hist.record_us(-5)
    hist.record_us(0)
    hist.record_seconds(7200.0)  # above the hour the histogram covers
    assert hist.count == 3 and hist.clamped == 1
    assert hist.percentile_ms(50) == pytest.approx(0.001)
    assert hist.max_ms() == pytest.approx(3_600_000.0, rel=1e-3)


def test_empty_histogram() -> None:
    hist = LatencyHistogram()
    assert hist.summary()["count"] == 0 and hist.percentile_ms(99) == 0.0
    assert hist.distribution() == []
    again = LatencyHistogram.decode(hist.encode())
    assert again.count == 0


def _record_in_child(lo_us: int, hi_us: int, queue: multiprocessing.Queue[str]) -> None:
    hist = _uniform(lo_us, hi_us)
    hist.record_us(-1)
    queue.put(hist.encode())


def test_encode_decode_across_a_process_boundary() -> None:
    ctx = multiprocessing.get_context("forkserver")  # as the bench starts its watchers
    queue: multiprocessing.Queue[str] = ctx.Queue()
    procs = [ctx.Process(target=_record_in_child, args=(lo, lo + 9_999, queue))
             for lo in (1, 10_001)]
    for proc in procs:
        proc.start()
    texts = [queue.get(timeout=30) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    merged = LatencyHistogram()
    for text in texts:
        merged.merge(LatencyHistogram.decode(text))
    local = _uniform(1, 20_000)
    assert merged.count == local.count + 2 and merged.clamped == 2
    assert merged.percentile_ms(50) == pytest.approx(local.percentile_ms(50), rel=1e-3)
    assert merged.percentile_ms(99) == pytest.approx(19.8, rel=1e-3)
    assert merged.max_ms() == pytest.approx(20.0, rel=1e-3)
