"""One benchmark run: the configured sections, one after the other, into one dict."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from clone.progress import Progress
from clone.tools.bench.calls import run_calls
from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.durability import run_durability
from clone.tools.bench.latency import run_latency
from clone.tools.bench.memory import run_memory
from clone.tools.bench.results import cpu_pressure, evaluate_targets, machine_info
from clone.tools.bench.security import run_security
from clone.tools.bench.snapshot import run_snapshot
from clone.tools.bench.subscribers import run_subscribers
from clone.tools.bench.throughput import run_throughput
from clone.tools.procs import ProcessGroup

__all__ = ["run_benchmarks"]

log = logging.getLogger(__name__)


_RUNNERS: dict[str, Callable[[BenchConfig, ProcessGroup, Say], dict[str, Any]]] = {
    "throughput": run_throughput,
    "latency": run_latency,
    "snapshot": run_snapshot,
    "memory": run_memory,
    "durability": run_durability,
    "security": run_security,
    "subscribers": run_subscribers,
    "calls": run_calls,
}


def run_benchmarks(
    cfg: BenchConfig, say: Say | None = None, command: str = ""
) -> dict[str, Any]:
    """Run the configured sections; the results as one JSON-able dict."""
    say = say or log.info
    results: dict[str, Any] = {
        "command": command,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()},
        "sections": {},
    }
    with ProcessGroup(cfg.log_dir) as group, Progress(
        # Polled so that a long section still gets a line every interval.
        "bench", len(cfg.sections), unit="sections", rate=False, interval=10.0,
        poll=lambda p: p.update(),
    ) as bar:

        def step(line: str) -> None:
            """A section's result line: said, and the bar's status."""
            say(line)
            bar.update(status=f"{section}: {line.strip()[:60]}")

        for section in cfg.sections:
            say(f"[{section}]")
            bar.update(status=section)
            t0 = time.monotonic()
            try:
                results["sections"][section] = _RUNNERS[section](cfg, group, step)
            except Exception as exc:  # one broken section must not lose the others
                log.exception("section %s failed", section)
                say(f"  {section} FAILED: {exc}")
                results.setdefault("errors", {})[section] = repr(exc)
                bar.advance()
                continue
            results["sections"][section]["elapsed_s"] = round(time.monotonic() - t0, 1)
            # CPU pressure includes our own processes; far above what the section
            # itself causes, it means someone else was using the machine.
            results["sections"][section]["cpu_pressure_at_end"] = cpu_pressure()
            results["sections"][section]["loadavg_at_end"] = [
                round(x, 2) for x in os.getloadavg()
            ]
            bar.advance()
    results["targets"] = evaluate_targets(results)
    return results
