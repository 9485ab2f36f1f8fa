"""Rendering of the drill report: markdown tables and a PNG plot.

The numbers are computed in Spark (:mod:`clone.pipeline.transforms`); what
arrives here is a handful of small collected rows as plain dicts, so this
module needs neither Spark nor a session, only tabulate for the tables and
matplotlib (Agg backend, no display) for the plot.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from tabulate import tabulate

__all__ = ["CrossCheck", "ReportData", "cross_check", "render_markdown", "render_plot"]

Row = Mapping[str, Any]

# summary.json fields we recompute, and how close "the same" is.
_CHECKED_FIELDS: tuple[tuple[str, float], ...] = (
    ("clients", 0.0),
    ("failover_p50_s", 0.01),
    ("failover_p99_s", 0.01),
    ("failover_max_s", 0.01),
    ("confirmed_writes", 0.0),
    ("confirmed_lost", 0.0),
    ("unconfirmed_lost", 0.0),
    ("duplicates", 0.0),
    ("out_of_order", 0.0),
    ("converged", 0.0),
)


@dataclass(frozen=True, slots=True)
class CrossCheck:
    """One field where our number and the drill's own summary disagree."""

    run: str
    field: str
    ours: Any
    drill: Any


@dataclass(slots=True)
class ReportData:
    """Everything the report shows, as collected rows."""

    overview: Sequence[Row]
    percentiles: Sequence[Row]
    clients: Sequence[Row]
    gaps: Sequence[Row]
    rates: Sequence[Row]
    faults: Sequence[Row]
    mismatches: list[CrossCheck] = field(default_factory=list)
    summaries_seen: int = 0


def _same(ours: Any, theirs: Any, tolerance: float) -> bool:
    if ours is None or theirs is None:
        return ours is None and theirs is None
    if isinstance(ours, bool) or isinstance(theirs, bool):
        return bool(ours) == bool(theirs)
    try:
        a, b = float(ours), float(theirs)
    except (TypeError, ValueError):
        return str(ours) == str(theirs)
    if tolerance == 0.0:
        return a == b
    # Relative for large values, absolute (10 ms) for small ones.
    return abs(a - b) <= max(tolerance, tolerance * max(abs(a), abs(b)))


def cross_check(
    overview: Iterable[Row], summaries: Mapping[str, Mapping[str, Any]]
) -> list[CrossCheck]:
    """Fields of each run's ``summary.json`` that our recomputation disagrees with."""
    out: list[CrossCheck] = []
    for row in overview:
        summary = summaries.get(row["run"])
        if not summary:
            continue
        for name, tolerance in _CHECKED_FIELDS:
            if name in summary and not _same(row.get(name), summary[name], tolerance):
                out.append(CrossCheck(row["run"], name, row.get(name), summary[name]))
    return out


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}"
    return str(value).replace("|", "\\|")


def _table(rows: Sequence[Row], columns: Sequence[tuple[str, str]]) -> list[str]:
    if not rows:
        return ["_(none)_", ""]
    table = tabulate(
        [[_fmt(r.get(name)) for name, _ in columns] for r in rows],
        headers=[title for _, title in columns],
        tablefmt="github",
        stralign=None,  # unpadded cells: | kill-primary | 2 | 6 |
        numalign=None,
        disable_numparse=True,  # the cells are formatted by _fmt already
    )
    return [*table.splitlines(), ""]


def render_markdown(data: ReportData, plot_name: str = "report.png") -> str:
    """The report as markdown: verdict, failover percentiles per scenario,
    one line per run, per-client counts, and the cross-check against the
    drills' own summaries."""
    runs = len(data.overview)
    bad_runs = [
        r["run"]
        for r in data.overview
        if r.get("confirmed_lost")
        or r.get("duplicates")
        or r.get("out_of_order")
        or r.get("converged") is False
    ]
    lines = ["# Failover drill report", ""]
    clients = sum(int(r.get("clients") or 0) for r in data.overview)
    faults = sum(int(r.get("faults") or 0) for r in data.overview)
    lines.append(f"{runs} run(s), {clients} client stream(s), {faults} injected fault(s).")
    if bad_runs:
        lines.append(
            f"**{len(bad_runs)} run(s) lost, duplicated or reordered confirmed writes, "
            "or did not converge:** " + ", ".join(f"`{r}`" for r in bad_runs) + "."
        )
    else:
        lines.append("Every run: no confirmed write lost, no duplicate, no reordering, converged.")
    lines += ["", f"![failover times and write rate]({plot_name})", ""]

    lines += ["## Failover time per scenario (seconds)", ""]
    lines.append(
        "From each client's `failover_done` event: the gap between the last update "
        "from the old server and the first complete update from the new one."
    )
    lines.append("")
    lines += _table(
        data.percentiles,
        [
            ("scenario", "scenario"),
            ("runs", "runs"),
            ("failovers", "failovers"),
            ("p50_s", "p50"),
            ("p90_s", "p90"),
            ("p99_s", "p99"),
            ("max_s", "max"),
            ("mean_s", "mean"),
        ],
    )

    lines += ["## Runs", ""]
    lines += _table(
        data.overview,
        [
            ("scenario", "scenario"),
            ("run", "run"),
            ("clients", "clients"),
            ("faults", "faults"),
            ("failover_p50_s", "failover p50"),
            ("failover_p99_s", "p99"),
            ("failover_max_s", "max"),
            ("confirmed_writes", "confirmed writes"),
            ("confirmed_lost", "confirmed lost"),
            ("unconfirmed_lost", "unconfirmed lost"),
            ("duplicates", "duplicates"),
            ("out_of_order", "out of order"),
            ("converged", "converged"),
        ],
    )

    lines += ["## Clients", ""]
    lines.append(
        "`lost` counts writes of the run (by any client) that this client never applied; "
        "`out of order` counts updates of a key not above the last sequence it applied for "
        "that key."
    )
    lines.append("")
    lines += _table(
        data.clients,
        [
            ("run", "run"),
            ("client", "client"),
            ("writes_sent", "sent"),
            ("writes_confirmed", "confirmed"),
            ("write_timeouts", "timeouts"),
            ("updates", "updates"),
            ("failovers", "failovers"),
            ("confirmed_lost", "confirmed lost"),
            ("unconfirmed_lost", "unconfirmed lost"),
            ("duplicates", "duplicates"),
            ("out_of_order", "out of order"),
        ],
    )

    lines += ["## Cross-check with the drills' summary.json", ""]
    if not data.summaries_seen:
        lines.append("No `summary.json` found; nothing to compare.")
    elif not data.mismatches:
        lines.append(f"All {data.summaries_seen} summaries agree with the numbers above.")
    else:
        lines.append(
            f"{len(data.mismatches)} field(s) differ (ours are recomputed from events.jsonl):"
        )
        lines.append("")
        lines += _table(
            [
                {"run": m.run, "field": m.field, "ours": m.ours, "drill": m.drill}
                for m in data.mismatches
            ],
            [("run", "run"), ("field", "field"), ("ours", "ours"), ("drill", "summary.json")],
        )
    return "\n".join(lines).rstrip() + "\n"


def render_plot(data: ReportData, path: str) -> None:
    """Two panels: failover time per scenario (box and points, p50/p99
    marked), and confirmed writes/s over time per run with faults marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(
        1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.4]}
    )
    scenarios = sorted({str(g["scenario"]) for g in data.gaps})
    if scenarios:
        series = [[float(g["gap_s"]) for g in data.gaps if g["scenario"] == s] for s in scenarios]
        left.boxplot(series, showfliers=False)
        for i, values in enumerate(series, start=1):
            offsets = [i + 0.12 * (((j * 7919) % 11) / 10 - 0.5) for j in range(len(values))]
            left.scatter(offsets, values, s=12, alpha=0.6, color="tab:blue", zorder=3)
        # p50/p99 in each scenario's axis label, one line each, and p99 as a
        # marker on its box: text placed next to the boxes overlapped the
        # neighbour's box and label (at a million rows).
        by_name = {str(p["scenario"]): p for p in data.percentiles}
        labels = []
        for i, s in enumerate(scenarios, start=1):
            p = by_name.get(s)
            if p and p.get("p99_s") is not None:
                labels.append(f"{s}\np50 {p['p50_s']:.2f}s\np99 {p['p99_s']:.2f}s")
                left.plot([i], [p["p99_s"]], marker="_", markersize=18, color="tab:red", zorder=4)
            else:
                labels.append(s)
        left.set_xticks(range(1, len(scenarios) + 1), labels, fontsize=8)
        left.set_ylim(bottom=0)
    else:
        left.text(
            0.5, 0.5, "no failovers recorded", ha="center", va="center", transform=left.transAxes
        )
        left.set_xticks([])
    left.set_title("Failover time per scenario (orange: p50, red: p99)")
    left.set_ylabel("seconds (last old update → first new update)")
    left.grid(axis="y", alpha=0.3)

    runs = sorted({str(r["run"]) for r in data.rates} | {str(f["run"]) for f in data.faults})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        color = colors[i % len(colors)]
        points = [(float(r["t"]), float(r["rate"])) for r in data.rates if r["run"] == run]
        label = next((str(r["scenario"]) for r in data.rates if r["run"] == run), run)
        if points:
            right.step(
                [p[0] for p in points],
                [p[1] for p in points],
                where="post",
                color=color,
                label=f"{label} ({_short(run)})",
                linewidth=1.2,
            )
        for f in (f for f in data.faults if f["run"] == run):
            right.axvline(float(f["t"]), color=color, linestyle="--", alpha=0.7, linewidth=1)
    if runs:
        right.legend(fontsize=8, loc="lower right")
    else:
        right.text(
            0.5, 0.5, "no writes recorded", ha="center", va="center", transform=right.transAxes
        )
    right.set_title("Confirmed writes/s (dashed: injected faults)")
    right.set_xlabel("seconds since the run started")
    right.set_ylabel("writes/s")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short(run: str) -> str:
    parts = [p for p in run.replace("\\", "/").split("/") if p]
    return parts[-1] if parts else run


# --------------------------------------------------------------------------
# audit


def _utc(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _busiest(rows: Sequence[Mapping[str, Any]], top: int) -> list[str]:
    totals: dict[str, int] = {}
    for r in rows:
        totals[str(r["prefix"])] = totals.get(str(r["prefix"]), 0) + int(r["writes"])
    return sorted(totals, key=lambda p: (-totals[p], p))[:top]


# Above this many windows, a prefix's quiet windows are not drawn as zeros.
_MAX_FILLED_WINDOWS = 10_000


def render_audit_plot(
    rates: Sequence[Mapping[str, Any]],
    blocks: Sequence[Mapping[str, Any]],
    depth: int,
    bucket: int,
    window: float,
    path: str,
    top: int = 8,
) -> None:
    """Two panels for the ``top`` busiest key prefixes: writes per second over
    time (or, when no time is known, a note saying so) and writes per
    ``bucket`` sequences."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    busiest = _busiest(rates, top)
    if busiest:
        t0 = min(float(r["window_start"]) for r in rates)
        t1 = max(float(r["window_start"]) for r in rates)
        windows = round((t1 - t0) / window) + 1
        for prefix in busiest:
            mine = {float(r["window_start"]): float(r["writes_per_s"])
                    for r in rates if r["prefix"] == prefix}  # fmt: skip
            if windows <= _MAX_FILLED_WINDOWS:  # a quiet window is a zero, not a gap
                starts = [t0 + i * window for i in range(windows)]
                points = [(t, mine.get(t, 0.0)) for t in starts]
            else:
                points = sorted(mine.items())
            left.plot([t - t0 for t, _ in points], [v for _, v in points], marker="o", ms=3,
                      label=prefix or "(root)")  # fmt: skip
        left.legend(fontsize=8, loc="upper left")
        left.set_xlabel(f"seconds after {_utc(t0)}")
    else:
        left.text(0.5, 0.5, "times unknown: the inputs are history\nexports taken over "
                  "the network", ha="center", va="center", transform=left.transAxes)  # fmt: skip
    left.set_title(f"Writes per second ({window:g} s windows), by key prefix (depth {depth})")
    left.set_ylabel("writes/s")
    left.set_ylim(bottom=0)
    left.grid(alpha=0.3)

    for prefix in _busiest(blocks, top):
        points = sorted((int(r["bucket"]), int(r["writes"]))
                        for r in blocks if r["prefix"] == prefix)  # fmt: skip
        right.plot([b for b, _ in points], [w for _, w in points], marker="o", ms=3,
                   label=prefix or "(root)")  # fmt: skip
    if blocks:
        right.legend(fontsize=8, loc="upper left")
    else:
        right.text(0.5, 0.5, "no updates held", ha="center", va="center",
                   transform=right.transAxes)  # fmt: skip
    right.set_title(f"Writes per {bucket} sequences, by key prefix (depth {depth})")
    right.set_xlabel("sequence (block start)")
    right.set_ylabel("writes")
    right.set_ylim(bottom=0)
    right.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_RATE_HEADERS = ["prefix", "writes", "mean writes/s", "peak writes/s", "peak window (start)"]


def _rate_lines(result: Any, rates: Sequence[Mapping[str, Any]], depth: int) -> list[str]:
    window = float(result.rate_window)
    lines = [f"## Write rates per key prefix (depth {depth}), {window:g} s windows", ""]
    if not result.timed:
        return [
            *lines,
            "**Unknown: no update held has a time.** History exports taken over the "
            "network (`clone-pipeline history`) carry no time of application (the wire "
            "has none); only a data directory's log records it. Audit the servers' data "
            "directories for writes per second. `rates/` is empty; the counts per block "
            "of sequences below need no time.",
            "",
        ]
    if result.timed < result.updates:
        lines += [
            f"{result.updates - result.timed} of {result.updates} updates have no time "
            "(held only by history exports taken over the network): they are left out "
            "of the rates below and of `rates/`, and counted in the blocks of sequences.",
            "",
        ]
    peak: dict[str, tuple[float, float]] = {}
    totals: dict[str, int] = {}
    for r in rates:
        prefix = str(r["prefix"])
        totals[prefix] = totals.get(prefix, 0) + int(r["writes"])
        here = (float(r["writes_per_s"]), -float(r["window_start"]))
        if prefix not in peak or here > peak[prefix]:
            peak[prefix] = here
    t0 = min(float(r["window_start"]) for r in rates)
    t1 = max(float(r["window_end"]) for r in rates)
    span = t1 - t0
    table = [
        [p or "(root)", totals[p], f"{totals[p] / span:.4g}", f"{peak[p][0]:.4g}",
         _utc(-peak[p][1])]
        for p in _busiest(rates, 20)
    ]  # fmt: skip
    lines += [
        f"{result.timed} updates with a time, in the windows from {_utc(t0)} to {_utc(t1)} "
        f"({span:g} s; windows start at multiples of {window:g} s since the epoch).",
        "",
        tabulate(table, _RATE_HEADERS, "github"),
        "",
        "Every window with a write, per prefix, in `rates/`.",
        "",
    ]
    return lines


def render_audit_markdown(
    result: Any,
    spans: Sequence[Any],
    rates: Sequence[Mapping[str, Any]],
    blocks: Sequence[Mapping[str, Any]],
    depth: int,
    bucket: int,
    diff: tuple[int, int] | None,
) -> str:
    """``report.md`` of an audit: inputs, what is held, the state, rates, the diff."""
    lines = ["# Clone audit", "", "## Inputs", ""]
    rows = [
        [s.source, s.first if s.first <= s.last else "-", s.last,
         "-" if s.state_seq is None else s.state_seq]
        for s in spans
    ]  # fmt: skip
    lines += [tabulate(rows, ["input", "oldest update", "newest", "state (kv) at"], "github"), ""]
    lines += [f"Held without a hole: {result.coverage}; {result.updates} updates.", ""]
    lines += ["## State", ""]
    if result.state_at is not None:
        lines += [f"`state_at/`: {result.state_keys} keys at sequence {result.state_at}.", ""]
    for note in result.notes:
        lines += [f"- {note}"]
    if lines[-1]:
        lines += [""]
    lines += _rate_lines(result, rates, depth)
    totals: dict[str, list[int]] = {}
    for r in blocks:
        t = totals.setdefault(str(r["prefix"]), [0, 0])
        t[0] += int(r["writes"])
        t[1] += int(r["deletes"] or 0)
    lines += [f"## Writes per key prefix (depth {depth}), all updates held", ""]
    ranked = sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))
    table = [[p or "(root)", w, d] for p, (w, d) in ranked[:20]]
    lines += [tabulate(table, ["prefix", "writes", "deletes"], "github"), ""]
    lines += [f"Per {bucket} sequences in `blocks/`; every change in `changes/`.", ""]
    lines += ["![writes per second and per block of sequences, by prefix](report.png)", ""]
    if diff is not None:
        lines += [f"## Differences between {diff[0]} and {diff[1]}", ""]
        counts = [[k, result.diff.get(k, 0)] for k in ("added", "removed", "changed")]
        lines += [tabulate(counts, ["status", "keys"], "github"), "", "Keys in `diff/`.", ""]
    stages = list(getattr(result, "stages", []))
    if stages:
        lines += ["## Time", ""]
        lines += [tabulate([[name, f"{secs:.1f}"] for name, secs in stages],
                           ["stage", "seconds"], "github"), ""]  # fmt: skip
        name, secs = max(stages, key=lambda stage: stage[1])
        lines += [f"Slowest stage: {name} ({secs:.1f} s of {sum(t for _, t in stages):.1f} s).", ""]
    return "\n".join(lines).rstrip() + "\n"
