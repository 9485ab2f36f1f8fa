"""drill-report on chaos runs: the figures of a ``scripts/drill --scenario chaos``
history, computed on Spark and checked against the run's own ``verdict.json``.

A chaos run directory holds ``history.jsonl`` (one record per operation,
fault and observation: docs/drills.md, "Chaos") and ``verdict.json``.  This
module reads every given run's history into one DataFrame and computes, per
run, what :func:`clone.tools.chaos.report.figures` computes in Python: the
operations by kind and result, the faults by kind, the unknown answers, the
failovers (the active server changed) and the availability (the fraction of
1 s windows in which a confirmed write was invoked that succeeded within
1 s).  Two programs computing the same numbers from one file is the check:
every figure that differs is reported.  The guarantees themselves are judged
by the chaos checker (pure Python, ``python -m clone.tools.chaos.check``),
whose verdict the report repeats.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F
from pyspark.sql.types import DoubleType, StringType, StructField, StructType

from clone.pipeline.errors import InputError

__all__ = ["CHAOS_RECORD_SCHEMA", "ChaosResult", "chaos_report", "is_chaos_run"]

#: The columns of a chaos history the figures need (the rest is ignored).
CHAOS_RECORD_SCHEMA = StructType([
    StructField("proc", StringType(), True),
    StructField("f", StringType(), True),
    StructField("t0", DoubleType(), True),
    StructField("t1", DoubleType(), True),
    StructField("res", StringType(), True),
    StructField("kind", StringType(), True),
    StructField("server", StringType(), True),
])
#: Figures compared with verdict.json (latency percentiles are left out: the
#: Python side's nearest rank is not Spark's).
COMPARED = ("operations", "faults", "fault_count", "unknowns", "failovers", "availability")
#: Records counted without a result, as report.figures counts them.
_PLAIN = ("update", "read", "fence", "resync", "died", "release")


def is_chaos_run(path: str) -> bool:
    """A chaos run directory: a ``history.jsonl`` and no drill ``events.jsonl``."""
    return (os.path.exists(os.path.join(path, "history.jsonl"))
            and not os.path.exists(os.path.join(path, "events.jsonl")))


@dataclass
class ChaosResult:
    markdown: str
    runs: int
    failed: list[str] = field(default_factory=list)  # runs whose verdict failed
    mismatches: list[str] = field(default_factory=list)


def _histories(spark: SparkSession, paths: Sequence[str]) -> DataFrame:
    frames = []
    for path in paths:
        if not os.path.exists(os.path.join(path, "history.jsonl")):
            raise InputError(f"{path}: no history.jsonl (not a chaos run)")
        frames.append(spark.read.schema(CHAOS_RECORD_SCHEMA).json(
            os.path.join(path, "history.jsonl")).withColumn("run", F.lit(path)))
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out


def figures(history: DataFrame) -> dict[str, dict[str, Any]]:
    """Per run, the figures :data:`COMPARED` names."""
    runs: dict[str, dict[str, Any]] = {}
    for row in history.where(F.col("f") == "run").select("run", "t0", "t1").collect():
        runs[row["run"]] = {"t0": row["t0"], "t1": row["t1"], "operations": {}, "faults": {},
                            "unknowns": 0, "failovers": 0}
    label = F.when(F.col("res").isNotNull(), F.concat_ws(":", "f", "res")).when(
        F.col("f").isin(*_PLAIN), F.col("f"))
    for row in (history.select("run", label.alias("label")).where(F.col("label").isNotNull())
                .groupBy("run", "label").count().collect()):
        runs[row["run"]]["operations"][row["label"]] = row["count"]
    for row in history.where(F.col("f") == "fault").groupBy("run", "kind").count().collect():
        runs[row["run"]]["faults"][row["kind"]] = row["count"]
    for row in history.where(F.col("res") == "unknown").groupBy("run").count().collect():
        runs[row["run"]]["unknowns"] = row["count"]
    # Failovers: consecutive single-server `active` records naming another server.
    single = history.where((F.col("f") == "active") & F.col("server").isin("primary", "backup"))
    by_time = Window.partitionBy("run").orderBy("t0")
    changes = single.withColumn("prev", F.lag("server").over(by_time)).where(
        F.col("prev").isNotNull() & (F.col("prev") != F.col("server")))
    for row in changes.groupBy("run").count().collect():
        runs[row["run"]]["failovers"] = row["count"]
    # Availability: 1 s windows (from the run's start) with a confirmed write
    # invoked in them that succeeded within 1 s.
    starts = history.where(F.col("f") == "run").select("run", F.col("t0").alias("start"))
    good = (history.where((F.col("f") == "write") & (F.col("res") == "ok")
                          & (F.col("t1") - F.col("t0") <= 1.0))
            .join(starts, "run")
            .select("run", F.floor(F.col("t0") - F.col("start")).alias("w")).distinct())
    windows: dict[str, set[int]] = {}
    for row in good.collect():
        windows.setdefault(row["run"], set()).add(int(row["w"]))
    for run, fig in runs.items():
        total = max(1, math.ceil(fig["t1"] - fig["t0"]))
        ok = sum(1 for w in windows.get(run, ()) if 0 <= w < total)
        fig["availability"] = round(ok / total, 3)
        fig["operations"] = dict(sorted(fig["operations"].items()))
        fig["faults"] = dict(sorted(fig["faults"].items()))
        fig["fault_count"] = sum(fig["faults"].values())
        fig["seconds"] = round(fig["t1"] - fig["t0"], 1)
    return runs


def _differences(ours: dict[str, Any], verdict: dict[str, Any]) -> list[str]:
    theirs = verdict.get("figures", {})
    return [f"{name}: spark {ours.get(name)!r}, checker {theirs.get(name)!r}"
            for name in COMPARED if ours.get(name) != theirs.get(name)]


def chaos_report(spark: SparkSession, paths: Sequence[str], output: str) -> ChaosResult:
    """Figures of each chaos run in ``paths``, checked against its verdict.json;
    ``chaos-report.md`` and ``chaos-report.json`` in ``output``."""
    figs = figures(_histories(spark, paths))
    lines = ["# Chaos runs", "",
             "| run | verdict | seconds | faults | failovers | unknowns | availability |",
             "|---|---|---|---|---|---|---|"]
    result = ChaosResult(os.path.join(output, "chaos-report.md"), len(paths))
    details: dict[str, Any] = {}
    for path in paths:
        verdict: dict[str, Any] = {}
        vpath = os.path.join(path, "verdict.json")
        if os.path.exists(vpath):
            with open(vpath, encoding="utf-8") as fh:
                verdict = json.load(fh)
        fig = figs.get(path)
        if fig is None:
            raise InputError(f"{path}: the history has no `run` record")
        ok = verdict.get("ok")
        if ok is False:
            result.failed.append(path)
        diff = _differences(fig, verdict) if verdict else ["no verdict.json"]
        result.mismatches += [f"{path}: {d}" for d in diff]
        lines.append(f"| {path} | {'PASS' if ok else 'FAIL' if ok is False else '?'} | "
                     f"{fig['seconds']} | {fig['fault_count']} | {fig['failovers']} | "
                     f"{fig['unknowns']} | {fig['availability']} |")
        checks = verdict.get("checks", {})
        details[path] = {"figures": {k: v for k, v in fig.items() if k not in ("t0", "t1")},
                         "checks": {n: c.get("status") for n, c in checks.items()},
                         "differences": diff}
    lines += ["", "Figures computed on Spark from each history.jsonl and compared with "
              "the checker's verdict.json: "
              + ("all equal." if not result.mismatches else "")]
    lines += [f"* {m}" for m in result.mismatches]
    for path, d in details.items():
        lines += ["", f"## {path}", "", "| check | verdict |", "|---|---|"]
        lines += [f"| {n} | {s} |" for n, s in d["checks"].items()]
        lines += ["", "```", json.dumps(d["figures"]["operations"], indent=1), "```"]
    os.makedirs(output, exist_ok=True)
    with open(result.markdown, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    with open(os.path.join(output, "chaos-report.json"), "w", encoding="utf-8") as fh:
        json.dump(details, fh, indent=2)
    return result
