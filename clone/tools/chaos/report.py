"""A chaos run's verdict, figures and timeline picture, from its saved history.

:func:`judge_dir` reads ``DIR/history.jsonl``, runs every check
(:func:`.checker.check_all`), and writes ``verdict.json``, ``verdict.md`` and
``timeline.png`` (faults as bands, confirmed-write latency, failovers,
unknown operations).  ``python -m clone.tools.chaos.check DIR`` runs it again
on a saved run.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clone.tools.chaos.checker import CHECKS, check_all

__all__ = ["figures", "judge_dir", "read_history", "timeline_png", "verdict_markdown"]

log = logging.getLogger(__name__)
Record = dict[str, Any]
#: Checks that inform and never fail a run.
INFORMATIONAL = ("lock_overlaps",)


def read_history(path: Path) -> list[Record]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_record(history: Sequence[Record]) -> Record:
    for r in history:
        if r.get("f") == "run":
            return r
    times = [float(r.get("t1") or r.get("t0") or 0.0) for r in history]
    return {"t0": min((float(r.get("t0", 0.0)) for r in history), default=0.0),
            "t1": max(times, default=0.0)}


def figures(history: Sequence[Record]) -> dict[str, Any]:
    """Counts of operations by kind and result, faults, failovers, unknowns, and
    availability: the fraction of 1 s windows of the run in which a confirmed
    write was invoked that succeeded within 1 s."""
    run = _run_record(history)
    ops: Counter[str] = Counter()
    for r in history:
        if "res" in r:
            ops[f"{r['f']}:{r['res']}"] += 1
        elif r.get("f") in ("update", "read", "fence", "resync", "died", "release"):
            ops[r["f"]] += 1
    faults = Counter(r["kind"] for r in history if r.get("f") == "fault")
    t0, t1 = float(run["t0"]), float(run["t1"])
    windows = max(1, math.ceil(t1 - t0))
    good = set()
    for r in history:
        if r.get("f") == "write" and r.get("res") == "ok" and r["t1"] - r["t0"] <= 1.0:
            good.add(math.floor(r["t0"] - t0))
    lat = sorted(r["t1"] - r["t0"] for r in history if r.get("f") == "write"
                 and r.get("res") == "ok")
    return {
        "seconds": round(t1 - t0, 1),
        "operations": dict(sorted(ops.items())),
        "faults": dict(sorted(faults.items())),
        "fault_count": sum(faults.values()),
        "failovers": _failovers(history),
        # The one server active once the traffic stopped (None: the pair did not
        # settle within the run's limit, a split brain or nobody active).
        "settled": next((r.get("active") for r in history if r.get("f") == "settled"), None),
        "split_brain_s": _split_brain(history),
        "unknowns": sum(1 for r in history if r.get("res") == "unknown"),
        "availability": round(len([w for w in good if 0 <= w < windows]) / windows, 3),
        "write_latency_p50_ms": round(1000 * lat[len(lat) // 2], 1) if lat else None,
        "write_latency_p99_ms": round(1000 * lat[int(len(lat) * 0.99)], 1) if lat else None,
    }


def _failovers(history: Sequence[Record]) -> int:
    """How many times the active server changed (one server to the other)."""
    last, n = None, 0
    for r in history:
        if r.get("f") == "active" and r["server"] in ("primary", "backup"):
            if last is not None and r["server"] != last:
                n += 1
            last = r["server"]
    return n


def _split_brain(history: Sequence[Record]) -> float:
    """Seconds during which both servers sent HUGZ (as the run's monitor saw them)."""
    marks = [(r["t0"], r.get("server", "")) for r in history if r.get("f") in ("active", "settled")]
    total = 0.0
    for (t, who), (t2, _) in itertools.pairwise(marks):
        if "+" in str(who):
            total += t2 - t
    return round(total, 2)


def verdict_markdown(verdict: dict[str, Any]) -> str:
    lines = [f"# Chaos run: {'PASS' if verdict['ok'] else 'FAIL'}", "",
             f"seed {verdict['seed']}, {verdict['figures']['seconds']} s, "
             f"{verdict['figures']['fault_count']} faults", "",
             "| check | verdict | checked | violations |", "|---|---|---|---|"]
    for name in CHECKS:
        c = verdict["checks"][name]
        shown = c["status"] + (" (information)" if name in INFORMATIONAL else "")
        lines.append(f"| {name} | {shown} | {c['checked']} | {c['violations']} |")
    lines += ["", "## Figures", "", "```", json.dumps(verdict["figures"], indent=1), "```"]
    for name in CHECKS:
        c = verdict["checks"][name]
        if c["examples"] and (c["status"] != "PASS" or name in INFORMATIONAL):
            lines += ["", f"## {name}: first examples", ""]
            for ex in c["examples"]:
                lines += ["```", json.dumps(ex, indent=1)[:4000], "```"]
    return "\n".join(lines) + "\n"


def timeline_png(history: Sequence[Record], path: Path, title: str) -> None:
    """Faults as bands, confirmed-write latency (ok dots, unknown crosses at the
    timeout), lock holds, failovers as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = _run_record(history)
    t0 = float(run["t0"])
    fig, (ax, axf) = plt.subplots(2, 1, figsize=(13, 6.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    writes = [r for r in history if r.get("f") in ("write", "cas")]
    for res, style, label in (("ok", ".", "ok"), ("conflict", "2", "cas conflict"),
                              ("unknown", "x", "unknown (timeout)"),
                              ("refused", "v", "refused")):
        pts = [(r["t0"] - t0, 1000 * (r["t1"] - r["t0"])) for r in writes if r["res"] == res]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, markersize=3, label=label, alpha=0.7)
    ax.set_yscale("log")
    ax.set_ylabel("write / CAS latency (ms)")
    kinds = sorted({r["kind"] for r in history if r.get("f") == "fault"})
    colors = plt.get_cmap("tab10")
    for r in history:
        if r.get("f") == "fault":
            i = kinds.index(r["kind"])
            for a in (ax, axf):
                a.axvspan(r["t0"] - t0, r["t1"] - t0, color=colors(i % 10), alpha=0.15)
            axf.plot([r["t0"] - t0, r["t1"] - t0], [i, i], color=colors(i % 10), linewidth=6)
    last = None
    for r in history:
        if r.get("f") != "active":
            continue
        style = {"none": ":", "primary+backup": "-", "backup+primary": "-"}.get(r["server"], "--")
        if last is not None:
            for a in (ax, axf):
                a.axvline(r["t0"] - t0, color="red" if "+" in r["server"] else "gray",
                          linewidth=0.8, linestyle=style)
        last = r["server"]
    axf.set_yticks(range(len(kinds)), [f"{k}" for k in kinds])
    axf.set_xlabel(f"seconds since the traffic started; gray lines: the active server "
                   f"changed ({_failovers(history)} failovers; dotted: none active), red: both "
                   f"active ({_split_brain(history)} s)")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def judge_dir(out: Path, *, picture: bool = True) -> dict[str, Any]:
    """Judge ``out/history.jsonl``; write the verdict (JSON, Markdown) and the picture."""
    history = read_history(out / "history.jsonl")
    run = _run_record(history)
    checks = check_all(history, lease_bound=float(run.get("lease_bound", 5.0)))
    # No final state (the pair did not serve one after the run): nothing proves
    # the confirmed writes survived, which fails the run.
    has_final = any(r.get("f") == "final" for r in history)
    ok = has_final and all(v.status != "FAIL" for n, v in checks.items()
                           if n not in INFORMATIONAL)
    verdict = {"ok": ok, "seed": run.get("seed"), "figures": figures(history),
               "checks": {n: v.as_dict() for n, v in checks.items()}}
    (out / "verdict.json").write_text(json.dumps(verdict, indent=1))
    (out / "verdict.md").write_text(verdict_markdown(verdict))
    if picture:
        try:
            timeline_png(history, out / "timeline.png",
                         f"chaos seed {run.get('seed')}: "
                         f"{'PASS' if ok else 'FAIL'}")
        except ImportError:
            log.warning("matplotlib is not installed: no timeline.png")
    return verdict
