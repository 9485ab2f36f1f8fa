"""The latency section: percentiles at fixed offered rates, from the intended send time."""

from __future__ import annotations

from typing import Any

from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.profiling import Profiler
from clone.tools.bench.targets import ServerOptions, running_target, server_summary, traffic
from clone.tools.drill.analysis import nearest_rank
from clone.tools.histogram import LatencyHistogram
from clone.tools.procs import ProcessGroup

__all__ = ["latency_once", "run_latency"]


def latency_once(
    cfg: BenchConfig,
    group: ProcessGroup,
    kind: str,
    rate: int,
    subs: int,
    rep: int,
    server: ServerOptions | None = None,
) -> dict[str, Any]:
    """One run at ``rate`` through a fresh target (``server``: how a clone keeps its state)."""
    with running_target(kind, group, cfg.server_heartbeat_ms, server) as target:
        label = f"latency-{kind}-{rate}-{subs}sub" + (f"-{server.label}" if server else "")
        profiled = kind == "clone" and (rate == max(cfg.rates) or server is not None) and rep == 0
        with Profiler(cfg.profile_dir if profiled else None, label, target.pid) as prof:
            count = max(1, int(rate * cfg.rate_seconds))
            writer, watchers = traffic(
                target,
                "latency",
                subs,
                count,
                {"rate": rate, "seconds": cfg.rate_seconds, "value_size": cfg.value_size},
                deadline_s=cfg.rate_seconds + 60,
                probes=cfg.probes,
            )
    merged = LatencyHistogram()
    for w in watchers:
        merged.merge(LatencyHistogram.decode(w["hist"]))
    lag = LatencyHistogram.decode(writer["lag"])
    run: dict[str, Any] = {
        "target": kind,
        "rate": rate,
        "subscribers": subs,
        "seconds": cfg.rate_seconds,
        "sent": writer["sent"],
        "received_min": min((w["received"] for w in watchers), default=0),
        "probes": len(watchers),
        "lost": writer["sent"] * len(watchers) - sum(w["received"] for w in watchers),
        "latency": merged.summary(),
        "writer_lag": lag.summary(),
        "distribution": merged.distribution(),
    }
    if target.restricted is not None:
        run["restricted_reader"] = target.restricted
    if summary := server_summary(target):
        run["server"] = summary
    if prof.summary:
        run["profile"] = prof.summary
    return run


def run_latency(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Latency percentiles at fixed offered rates, measured from the intended send time.

    With ``repeats`` > 1 every (target, rate, subscribers) runs that many times,
    interleaved; the run with the median p99 is reported in full and every
    repeat's percentiles are kept (``repeats``), so a disturbed run shows.
    """
    plan: list[tuple[str, int, int]] = []
    for kind in cfg.latency_targets:
        plan += [(kind, rate, 1) for rate in cfg.rates]
        if cfg.multi_subs > 1:
            plan.append((kind, cfg.multi_sub_rate, cfg.multi_subs))
    reps: dict[tuple[str, int, int], list[dict[str, Any]]] = {p: [] for p in plan}
    for rep in range(cfg.repeats):
        for kind, rate, subs in plan:
            one = latency_once(cfg, group, kind, rate, subs, rep)
            reps[(kind, rate, subs)].append(one)
            lat = one["latency"]
            say(
                f"  latency {kind:>8} {rate:>6}/s {subs:>2} sub: p50 {lat['p50_ms']:.3f} "
                f"p99 {lat['p99_ms']:.3f} p99.9 {lat['p99_9_ms']:.3f} max {lat['max_ms']:.3f} ms"
                f" (lost {one['lost']}, writer lag p99 {one['writer_lag']['p99_ms']:.3f})"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else "")
            )
    runs: list[dict[str, Any]] = []
    for ones in reps.values():
        ranked = sorted(ones, key=lambda o: o["latency"]["p99_ms"])
        run = dict(ranked[nearest_rank(len(ranked), 50)])  # the median p99
        run["lost"] = sum(o["lost"] for o in ones)
        run["repeats"] = [
            {k: o["latency"][k] for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")}
            | {"writer_lag_p99_ms": o["writer_lag"]["p99_ms"]}
            for o in ones
        ]
        profile = next((o["profile"] for o in ones if "profile" in o), None)
        if profile:
            run["profile"] = profile
        runs.append(run)
    return {"runs": runs}
