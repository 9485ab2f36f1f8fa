"""Latency histograms: HDR histograms in microseconds, shippable between processes.

A thin layer over the ``hdrhistogram`` package (``hdrh``): it records values in
whole microseconds with three significant digits from 1 us to one hour, encodes
to a compact base64 string so a watcher process can send its histogram to the
benchmark driver, merges, and summarises in milliseconds.
"""

from __future__ import annotations

from hdrh.histogram import HdrHistogram

__all__ = ["LatencyHistogram", "PERCENTILES"]

# The percentiles every summary reports.
PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0, 99.9, 99.99)
_LOWEST_US = 1
_HIGHEST_US = 3_600_000_000
_SIG_DIGITS = 3


class LatencyHistogram:
    """Latencies in microseconds; negative samples are clamped to zero and counted."""

    def __init__(self) -> None:
        self._h = HdrHistogram(_LOWEST_US, _HIGHEST_US, _SIG_DIGITS)
        self.clamped = 0

    def record_seconds(self, seconds: float) -> None:
        self.record_us(int(seconds * 1e6))

    def record_us(self, us: int) -> None:
        if us < _LOWEST_US:
            if us < 0:
                self.clamped += 1
            us = _LOWEST_US
        elif us > _HIGHEST_US:
            us = _HIGHEST_US
        self._h.record_value(us)

    @property
    def count(self) -> int:
        return int(self._h.get_total_count())

    def percentile_ms(self, p: float) -> float:
        return self._h.get_value_at_percentile(p) / 1000.0 if self.count else 0.0

    def max_ms(self) -> float:
        return self._h.get_max_value() / 1000.0 if self.count else 0.0

    def merge(self, other: LatencyHistogram) -> None:
        self._h.add(other._h)
        self.clamped += other.clamped

    def encode(self) -> str:
        return f"{self.clamped}:{self._h.encode().decode('ascii')}"

    @classmethod
    def decode(cls, text: str) -> LatencyHistogram:
        clamped, _, payload = text.partition(":")
        hist = cls()
        if payload:
            hist._h = HdrHistogram.decode(payload.encode("ascii"))
        hist.clamped = int(clamped)
        return hist

    def summary(self) -> dict[str, float | int]:
        """count, mean, p50 .. p99.99 and max, in milliseconds."""
        out: dict[str, float | int] = {"count": self.count}
        out["mean_ms"] = round(self._h.get_mean_value() / 1000.0, 4) if self.count else 0.0
        for p in PERCENTILES:
            out[f"p{_pname(p)}_ms"] = round(self.percentile_ms(p), 4)
        out["max_ms"] = round(self.max_ms(), 4)
        return out

    def distribution(self, ticks_per_half: int = 5) -> list[tuple[float, float]]:
        """(percentile, ms) pairs along a log scale of 1/(1-p), for plots."""
        if not self.count:
            return []
        return [
            (float(item.percentile_level_iterated_to), item.value_iterated_to / 1000.0)
            for item in self._h.get_percentile_iterator(ticks_per_half)
        ]


def _pname(p: float) -> str:
    """50.0 -> '50', 99.9 -> '99_9'."""
    text = f"{p:g}"
    return text.replace(".", "_")
