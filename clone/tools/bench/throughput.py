"""The throughput section: messages/s per subscriber, ours against the ceilings."""

from __future__ import annotations

import statistics
from typing import Any

from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.profiling import Profiler
from clone.tools.bench.targets import (
    ServerOptions,
    cpu_seconds,
    running_target,
    server_summary,
    traffic,
)
from clone.tools.procs import ProcessGroup

__all__ = ["run_throughput", "throughput_once"]


def throughput_once(
    cfg: BenchConfig,
    group: ProcessGroup,
    kind: str,
    subs: int,
    rep: int,
    server: ServerOptions | None = None,
    messages: int | None = None,
    idle_s: float | None = None,
) -> dict[str, Any]:
    """One throughput run through a fresh target (``server``: how a clone keeps its state).

    ``idle_s``: how long a watcher waits for the next message (see :func:`traffic`).
    """
    n = messages or cfg.throughput_messages
    with running_target(kind, group, cfg.server_heartbeat_ms, server) as target:
        label = f"throughput-{kind}-{subs}sub" + (f"-{server.label}" if server else "")
        profile_dir = cfg.profile_dir if kind == "clone" and rep == 0 else None
        cpu0 = cpu_seconds(target.pid) if kind == "clone" else None
        with Profiler(profile_dir, label, target.pid) as prof:
            writer, watchers = traffic(
                target,
                "throughput",
                subs,
                n,
                {"messages": n, "value_size": cfg.value_size},
                deadline_s=60 + n / 1000,
                probes=cfg.probes,
                idle_s=idle_s,
            )
        cpu1 = cpu_seconds(target.pid) if cpu0 is not None else None
    rates = [
        w["received"] / (w["last"] - writer["t_start"])
        for w in watchers
        if w["received"] and w["last"] > writer["t_start"]
    ]
    run: dict[str, Any] = {
        "received_min": min((w["received"] for w in watchers), default=0),
        "probes": len(watchers),
        "delivered": round(sum(w["received"] for w in watchers) / (n * len(watchers)), 4),
        "rate": round(min(rates)) if rates else 0,
        "writer_enqueue_rate": round(n / max(1e-9, writer["t_enqueued"] - writer["t_start"])),
    }
    if cpu0 is not None and cpu1 is not None:
        # Includes the warm-up (a message per 50 ms) and the watchers' idle wait: small.
        run["server_cpu_us_per_msg"] = {
            "main_thread": round((cpu1[0] - cpu0[0]) / n * 1e6, 2),
            "io_threads": round((cpu1[1] - cpu0[1]) / n * 1e6, 2),
        }
    if target.restricted is not None:
        run["restricted_reader"] = target.restricted
    if summary := server_summary(target):
        run["server"] = summary
    if prof.summary:
        run["profile"] = prof.summary
    return run


def run_throughput(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Messages/s received per subscriber, for each target and subscriber count.

    Each combination runs ``repeats`` times, the targets interleaved, so that a
    burst of other work on the machine hits all of them alike; the median counts.
    """
    combos = [(kind, subs) for subs in cfg.subscriber_counts for kind in cfg.throughput_targets]
    reps: dict[tuple[str, int], list[dict[str, Any]]] = {c: [] for c in combos}
    for rep in range(cfg.repeats):
        for kind, subs in combos:
            one = throughput_once(cfg, group, kind, subs, rep)
            reps[(kind, subs)].append(one)
            say(
                f"  throughput {kind:>12} {subs:>2} sub: {one['rate']:>8,} msg/s per subscriber"
                f" (delivered {one['delivered']:.1%})"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else "")
            )
    runs: list[dict[str, Any]] = []
    for (kind, subs), ones in reps.items():
        rates = [o["rate"] for o in ones]
        run: dict[str, Any] = {
            "target": kind,
            "subscribers": subs,
            "messages": cfg.throughput_messages,
            "probes": ones[0]["probes"],
            "received_min": min(o["received_min"] for o in ones),
            "delivered": min(o["delivered"] for o in ones),
            "rate_median": round(statistics.median(rates)),
            "rate_min": min(rates),
            "rate_max": max(rates),
            "rates": rates,
            "writer_enqueue_rate": round(statistics.median(o["writer_enqueue_rate"] for o in ones)),
        }
        profile = next((o["profile"] for o in ones if "profile" in o), None)
        if profile:
            run["profile"] = profile
        runs.append(run)
    # Our throughput as a fraction of each ceiling, same subscriber count.
    by = {(r["target"], r["subscribers"]): r["rate_median"] for r in runs}
    ratios: dict[str, float] = {}
    for subs in cfg.subscriber_counts:
        ours = by.get(("clone", subs))
        for ceiling in ("c-proxy", "py-forwarder"):
            theirs = by.get((ceiling, subs))
            if ours is not None and theirs:
                ratios[f"{subs}sub_vs_{ceiling}"] = round(ours / theirs, 3)
    return {"runs": runs, "ratios": ratios}
