"""The three jobs, wired from readers, transforms and the CHP I/O modules.

Each job takes a SparkSession built by the caller (the CLI, the benchmark or a
test) and returns a small result object; none prints.  Errors the user can fix
raise :class:`~clone.pipeline.errors.PipelineError` subclasses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from clone.errors import CloneError
from clone.pipeline import DEFAULT_REJECTS
from clone.pipeline.errors import InputError, WriteFailed
from clone.pipeline.exporting import (
    ROWS_PER_FILE,
    export_snapshot,
    snapshot_dataframe,
    write_snapshot,
    write_text_file,
)
from clone.pipeline.sources import (
    DrillRun,
    read_drill_events,
    read_drill_summaries,
    resolve_output,
)

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

    from clone.pipeline.transforms import LoadColumns

__all__ = [
    "LoadResult",
    "load_table",
    "ReportResult",
    "drill_report",
    "export_snapshot",
    "snapshot_dataframe",
    "write_snapshot",
    "write_text_file",
    "curve_keys",
    "export_history",
    "AuditResult",
    "audit",
]

log = logging.getLogger(__name__)



def curve_keys(curve_secret: str | None, server_key: str | None) -> tuple[Any, bytes] | None:
    """The CURVE key pair and server key read from their files (None: plain);
    a missing or bad file, or one without the other, is an :class:`InputError`."""
    from clone.client.frontend import load_curve_keys

    try:
        return load_curve_keys(curve_secret, server_key)
    except (ValueError, OSError, CloneError) as exc:
        raise InputError(f"CURVE keys: {exc}") from None


# --------------------------------------------------------------------------
# load


@dataclass(slots=True)
class LoadResult:
    """What a load did: rows stored, rows rejected (by reason), rows failed."""

    written: int
    rejected: int
    failed: int
    seconds: float
    partitions: int
    write_seconds: float = 0.0
    retries: int = 0
    reasons: list[tuple[str, int]] = field(default_factory=list)
    rejects_path: str | None = None
    #: CSV: the line of the first row rejected for each reason.
    first_lines: dict[str, int] = field(default_factory=dict)
    #: Rows not written because the manifest resumed says they were confirmed.
    skipped: int = 0
    manifest: str | None = None


_MANIFEST_FORMAT = 1


def _write_manifest(
    path: str, source: str, rows: int, partitions: int, results: Sequence[Any], complete: bool
) -> None:
    """What each partition confirmed, for ``load --resume`` (driver-side, small)."""
    data = {
        "format": _MANIFEST_FORMAT,
        "input": os.path.abspath(source),
        "rows": rows,
        "partitions": partitions,
        "complete": complete,
        "confirmed_through": {
            str(int(r["partition"])): r["confirmed_through"]
            for r in results
            if r["confirmed_through"] is not None
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
    os.replace(tmp, path)


def _resume_from(path: str, source: str, rows: int | None) -> tuple[int, dict[int, str]]:
    """(partitions, confirmed-through key per partition) of a manifest that
    matches this input (and its ``rows`` to write, unless None: not counted
    yet); an :class:`InputError` saying why not otherwise."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        if data.get("format") != _MANIFEST_FORMAT:
            raise ValueError(f"format {data.get('format')!r}, not {_MANIFEST_FORMAT}")
        partitions = int(data["partitions"])
        through = {int(p): str(k) for p, k in dict(data["confirmed_through"]).items()}
        expected = (str(data["input"]), int(data["rows"]))
    except FileNotFoundError:
        raise InputError(f"manifest {path} does not exist") from None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise InputError(f"manifest {path} is not a load manifest: {exc}") from None
    if expected != (os.path.abspath(source), expected[1] if rows is None else rows):
        raise InputError(
            f"manifest {path} is for {expected[0]} with {expected[1]} rows to write, "
            f"not {os.path.abspath(source)} with {rows}"
        )
    if partitions < 1 or any(not 0 <= p < partitions for p in through):
        raise InputError(f"manifest {path} names partitions out of range")
    return partitions, through


def _write_partitions(parallelism: int) -> int:
    """Partitions to write with: four per core, so every core stays busy
    while a partition ends.  Chosen before the rows are counted: the input is
    partitioned by key once, before validation, and the validation's window
    (duplicate keys) and the writers use that same partitioning, so the rows
    are shuffled once, not twice (a partition's client costs one heartbeat
    to open: it copies nothing)."""
    return max(1, parallelism * 4)


def load_table(
    spark: SparkSession,
    servers: Sequence[str],
    path: str,
    *,
    fmt: str = "parquet",
    columns: LoadColumns | None = None,
    rejects: str | None = None,
    max_in_flight: int = 256,
    confirm_timeout: float = 30.0,
    heartbeat: float = 1.0,
    curve_files: tuple[str | None, str | None] = (None, None),
    manifest: str | None = None,
    resume: str | None = None,
) -> LoadResult:
    """Validate a table, write the rejects with their reasons, and write the
    rest into the pair with confirmed writes from the executors.

    ``curve_files``: the client's secret certificate and the server's public
    one, for a secured pair (each executor opens them: :class:`WriterConfig`).
    ``manifest``: where to record what each partition confirmed (JSON);
    ``resume``: a manifest of an earlier load of the same input: only the rows
    it does not cover are written, and it is brought up to date.
    Raises :class:`WriteFailed` when rows could not be stored.
    """
    from pyspark import StorageLevel
    from pyspark.sql import functions as F

    from clone.pipeline.progress import stage_progress
    from clone.pipeline.snapshot import find_active
    from clone.pipeline.sources import INPUT_LINE, read_table
    from clone.pipeline.transforms import (
        REJECT_REASON,
        LoadColumns,
        rejected_rows,
        with_reject_reason,
        write_records,
    )
    from clone.pipeline.writer import RESULT_SCHEMA, WriterConfig, arrow_partition_writer

    cols = columns or LoadColumns()
    started = time.monotonic()
    curve = curve_keys(*curve_files)
    df = read_table(spark, path, fmt)
    through: dict[int, str] = {}
    if resume is not None:
        partitions, through = _resume_from(resume, path, None)
    else:
        partitions = _write_partitions(spark.sparkContext.defaultParallelism)
    if cols.key in df.columns:  # else with_reject_reason says it is missing
        # By key into partitions, in key order within each (below): the same
        # rows go to the same partition in the same order on a rerun, so
        # "every row up to key K of partition P is confirmed" is all a
        # manifest needs to say.  Done before validation, whose window by key
        # then needs no shuffle of its own.
        df = df.repartition(partitions, F.col(cols.key))
    checked = with_reject_reason(df, cols)
    active = find_active(servers, timeout=max(1.0, 3 * heartbeat), curve=curve)
    log.info("active server: %s", active)

    checked = checked.persist(StorageLevel.MEMORY_AND_DISK)
    try:
        aggs = [F.count(F.lit(1)).alias("count")]
        if INPUT_LINE in checked.columns:  # CSV: where each reason first occurs
            aggs.append(F.min(INPUT_LINE).alias("first_line"))
        with stage_progress(spark, "validate"):
            counts = checked.groupBy(REJECT_REASON).agg(*aggs).collect()
        first_lines = {
            str(r[REJECT_REASON]): int(r.asDict()["first_line"])
            for r in counts
            if r[REJECT_REASON] is not None and r.asDict().get("first_line") is not None
        }
        reasons = sorted(
            ((r[REJECT_REASON], int(r["count"])) for r in counts if r[REJECT_REASON] is not None),
            key=lambda rc: (-rc[1], rc[0]),
        )
        rejected = sum(n for _, n in reasons)
        to_write = sum(int(r["count"]) for r in counts if r[REJECT_REASON] is None)
        rejects_path = None
        if rejected:
            rejects_path = resolve_output(rejects or DEFAULT_REJECTS)
            rejected_rows(checked).write.mode("overwrite").json(rejects_path)
            log.info("%d rejected rows written to %s", rejected, rejects_path)

        if resume is not None:
            _resume_from(resume, path, to_write)
        config = WriterConfig(
            servers=tuple(servers),
            subtree=cols.subtree or None,
            max_in_flight=max_in_flight,
            confirm_timeout=confirm_timeout,
            heartbeat=heartbeat,
            curve_secret=curve_files[0],
            server_key=curve_files[1],
            resume=tuple(sorted(through.items())),
        )
        log.info("writing %d rows in %d partitions", to_write, partitions)
        # Partitioned by key above; the sort is the window's already (Spark
        # drops it when the plan shows that), asked for here all the same.
        records = write_records(checked).sortWithinPartitions("key")
        write_started = time.monotonic()
        with stage_progress(spark, f"load {to_write:,} rows"):
            results = records.mapInArrow(arrow_partition_writer(config), RESULT_SCHEMA).collect()
        write_seconds = time.monotonic() - write_started
    finally:
        checked.unpersist()
    for r in results:
        log.info(
            "partition %d: %d rows, %d written, %d failed, %d retries in %.1fs",
            r["partition"],
            r["rows"],
            r["written"],
            r["failed"],
            r["retries"],
            r["seconds"],
        )
    written = sum(int(r["written"]) for r in results)
    failed = sum(int(r["failed"]) for r in results)
    retries = sum(int(r["retries"]) for r in results)
    skipped = sum(int(r["skipped"]) for r in results)
    manifest_path = resume or manifest
    if manifest_path is not None:
        _write_manifest(manifest_path, path, to_write, partitions, results, failed == 0)
    result = LoadResult(
        written=written,
        rejected=rejected,
        failed=failed,
        seconds=time.monotonic() - started,
        partitions=len(results),
        write_seconds=write_seconds,
        retries=retries,
        reasons=reasons,
        rejects_path=rejects_path,
        first_lines=first_lines,
        skipped=skipped,
        manifest=manifest_path,
    )
    if failed or written + skipped != to_write:
        errors = sorted({str(r["error"]) for r in results if r["error"]})
        again = f"; to write only the rest: load --resume {manifest_path}" if manifest_path else ""
        raise WriteFailed(
            f"{failed} of {to_write} rows could not be stored "
            f"({written} written, {skipped} skipped as confirmed before, {rejected} rejected): "
            f"{errors[0] if errors else 'unknown'}{again}"
        )
    return result


# --------------------------------------------------------------------------
# drill-report


@dataclass(slots=True)
class ReportResult:
    """Where the report went and its headline numbers."""

    markdown: str
    plot: str
    runs: int
    problems: list[str] = field(default_factory=list)
    mismatches: int = 0


def drill_report(
    spark: SparkSession, inputs: Sequence[str] | Sequence[DrillRun], output: str
) -> ReportResult:
    """Read drill runs (directories, or runs already read), compute failover
    percentiles, delivery counts and convergence, and write ``report.md``,
    ``report.png`` and ``report.json`` into ``output``."""
    from clone.pipeline import report, transforms

    runs = [r for r in inputs if isinstance(r, DrillRun)]
    runs += read_drill_summaries([r for r in inputs if isinstance(r, str)])
    events = read_drill_events(spark, runs)

    def rows(df: DataFrame) -> list[dict[str, Any]]:
        return [r.asDict(recursive=True) for r in df.collect()]

    gaps = transforms.failover_gaps(events)
    overview = rows(transforms.run_overview(events))
    data = report.ReportData(
        overview=overview,
        percentiles=rows(transforms.failover_percentiles(gaps)),
        clients=rows(transforms.client_delivery_stats(events)),
        gaps=rows(gaps),
        rates=rows(transforms.confirmed_write_rate(events)),
        faults=rows(transforms.fault_marks(events)),
    )
    summaries = {run.path: run.summary for run in runs if run.summary}
    data.summaries_seen = len(summaries)
    data.mismatches = report.cross_check(overview, summaries)
    events.unpersist()

    os.makedirs(output, exist_ok=True)
    md_path = os.path.join(output, "report.md")
    png_path = os.path.join(output, "report.png")
    report.render_plot(data, png_path)
    with open(md_path, "w", encoding="utf-8") as fh:
        fh.write(report.render_markdown(data, os.path.basename(png_path)))
    with open(os.path.join(output, "report.json"), "w", encoding="utf-8") as fh:
        json.dump(
            {
                "runs": overview,
                "scenarios": data.percentiles,
                "clients": data.clients,
                "mismatches": [vars_of(m) for m in data.mismatches],
            },
            fh,
            indent=2,
            default=str,
        )
    problems = [
        str(r["run"])
        for r in overview
        if r.get("confirmed_lost")
        or r.get("duplicates")
        or r.get("out_of_order")
        or r.get("converged") is False
    ]
    return ReportResult(md_path, png_path, len(runs), problems, len(data.mismatches))


def vars_of(obj: Any) -> dict[str, Any]:
    """A slotted dataclass as a dict (``vars`` does not work on slots)."""
    return {name: getattr(obj, name) for name in obj.__slots__}


# --------------------------------------------------------------------------
# history and audit


def export_history(
    spark: SparkSession,
    servers: Sequence[str],
    since: int,
    output: str,
    *,
    silence: float = 3.0,
    curve: tuple[Any, bytes] | None = None,
) -> dict[str, Any]:
    """The updates after ``since`` up to the server's sequence when it answered,
    written to ``output`` as Parquet with ``_clone_history.json``; returns that."""
    from clone.pipeline.history import HISTORY_META_FILE, fetch_history

    fetched = fetch_history(servers, since, silence=silence, curve=curve)
    log.info("history %d..%d: %d updates", since + 1, fetched.until, fetched.updates.num_rows)
    df = spark.createDataFrame(fetched.updates)
    files = max(1, -(-fetched.updates.num_rows // ROWS_PER_FILE))
    df.coalesce(files).write.mode("overwrite").parquet(output)
    meta = fetched.meta()
    write_text_file(
        spark, f"{output.rstrip('/')}/{HISTORY_META_FILE}", json.dumps(meta, indent=2)
    )
    return meta


@dataclass(slots=True)
class AuditResult:
    """Where the audit went, and what it could and could not reconstruct."""

    markdown: str
    plot: str
    coverage: str
    updates: int
    state_at: int | None = None
    state_keys: int | None = None
    diff: dict[str, int] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: Updates whose time of application is known (a data directory's log):
    #: only they are in ``rates/``.
    timed: int = 0
    rate_window: float = 60.0
    #: Seconds each stage took, in order (``bounds``: the refusal decided from
    #: the inputs' bounds; ``read``: the updates read, deduplicated, cached
    #: and counted; then each table written, and the report).
    stages: list[tuple[str, float]] = field(default_factory=list)

    @property
    def slowest(self) -> tuple[str, float] | None:
        """The stage that took longest."""
        return max(self.stages, key=lambda stage: stage[1]) if self.stages else None


class _Stopwatch:
    """Times an audit's stages one after the other (Spark is lazy: a stage's
    time is the work its own actions set off)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._since = clock()
        self.stages: list[tuple[str, float]] = []

    def done(self, name: str) -> None:
        now = self._clock()
        self.stages.append((name, round(now - self._since, 3)))
        self._since = now


def _audit_inputs(spark: SparkSession, paths: Sequence[str]) -> tuple[Any, Any, list[Any]]:
    """(updates, states by sequence, spans) of data directories and history exports."""
    from functools import reduce

    from pyspark.sql import DataFrame

    from clone.pipeline.history import (
        HISTORY_COLUMNS,
        HistorySpan,
        read_data_dir,
        read_history_meta,
    )
    from clone.storage.schema import DATA_FILE

    updates: list[DataFrame] = []
    states: dict[int, DataFrame] = {}
    spans: list[HistorySpan] = []
    for path in paths:
        if os.path.isfile(os.path.join(path, DATA_FILE)) or os.path.isfile(path):
            held = read_data_dir(path)
            updates.append(spark.createDataFrame(held.updates))
            if held.state is not None and held.span.state_seq is not None:
                states[held.span.state_seq] = spark.createDataFrame(held.state)
            spans.append(held.span)
            continue
        meta = read_history_meta(path)
        if meta is None:
            raise InputError(
                f"{path} is neither a data directory (no {DATA_FILE}) nor a history export "
                "(no _clone_history.json; write one with clone-pipeline history)"
            )
        updates.append(spark.read.parquet(path).select(*HISTORY_COLUMNS))
        spans.append(HistorySpan(path, int(meta["since"]) + 1, int(meta["until"])))
    return reduce(DataFrame.unionByName, updates), states, spans


def _audit_span(path: str) -> Any:
    """The :class:`~clone.pipeline.history.HistorySpan` of an audit input, from
    its bounds only (a data directory's log and position, an export's meta)."""
    from clone.pipeline.history import HistorySpan, read_data_dir_span, read_history_meta
    from clone.storage.schema import DATA_FILE

    if os.path.isfile(os.path.join(path, DATA_FILE)) or os.path.isfile(path):
        return read_data_dir_span(path)
    meta = read_history_meta(path)
    if meta is None:
        raise InputError(
            f"{path} is neither a data directory (no {DATA_FILE}) nor a history export "
            "(no _clone_history.json; write one with clone-pipeline history)"
        )
    return HistorySpan(path, int(meta["since"]) + 1, int(meta["until"]))


def audit(
    spark: SparkSession,
    inputs: Sequence[str],
    output: str,
    *,
    at: int | None = None,
    diff: tuple[int, int] | None = None,
    depth: int = 1,
    bucket: int = 1000,
    rate_window: float = 60.0,
) -> AuditResult:
    """Read the update history of data directories and history exports and
    write ``state_at/``, ``changes/``, ``rates/`` (writes per second per
    prefix per ``rate_window`` seconds, from the updates whose time is known),
    ``blocks/`` (writes per prefix per ``bucket`` sequences) and ``diff/`` as
    Parquet, with ``report.md`` and ``report.png``.

    ``at`` (default: the newest sequence held, if that state can be
    reconstructed) and both ends of ``diff`` must be reconstructible exactly,
    else :class:`~clone.pipeline.errors.HistoryIncomplete`.
    """
    from pyspark import StorageLevel

    from clone.pipeline import audit as A
    from clone.pipeline import report
    from clone.pipeline.errors import HistoryIncomplete
    from clone.pipeline.history import state_arrow_schema

    # Refuse first: what can be rebuilt follows from the inputs' bounds, read
    # without a single update or key; only then is anything read in bulk.
    watch = _Stopwatch()
    cov = A.coverage([_audit_span(path) for path in inputs])
    for seq in ([] if at is None else [at]) + ([] if diff is None else list(diff)):
        A.plan_state(cov, seq)
    watch.done("bounds")
    raw, states, spans = _audit_inputs(spark, inputs)
    cov = A.coverage(spans)
    updates = A.distinct_updates(raw).persist(StorageLevel.MEMORY_AND_DISK)
    try:
        empty_state = spark.createDataFrame(state_arrow_schema().empty_table())

        def state(seq: int) -> DataFrame:
            base_seq = A.plan_state(cov, seq)
            base = empty_state if base_seq == 0 else states[base_seq]
            result, unknown = A.state_at(updates, base, base_seq, seq, max(cov.first, 1))
            missing = unknown.count()
            if missing:
                raise HistoryIncomplete(
                    f"the state at {seq} cannot be reconstructed: {missing} key(s) changed "
                    f"after it were last written before {cov.first}, the oldest update held "
                    f"({cov.describe()}); an update does not carry the value it replaced"
                )
            return result

        def out(name: str) -> str:
            return os.path.join(output, name)

        os.makedirs(output, exist_ok=True)
        notes: list[str] = []
        result = AuditResult(out("report.md"), out("report.png"), cov.describe(), updates.count())
        watch.done("read")
        # The state at --at, else at the newest sequence held if it can be.
        target = cov.last if at is None else at
        try:
            snapshot = state(target)
        except HistoryIncomplete as exc:
            if at is not None:
                raise
            notes.append(f"no state_at/: {exc}")
        else:
            snapshot.orderBy("key").write.mode("overwrite").parquet(out("state_at"))
            result.state_at = target
            result.state_keys = spark.read.parquet(out("state_at")).count()
        watch.done("state_at")
        A.key_changes(updates).orderBy("seq").write.mode("overwrite").parquet(out("changes"))
        watch.done("changes")
        result.rate_window = rate_window
        result.timed = updates.filter(updates["at"].isNotNull()).count()
        A.prefix_write_rates(updates, depth, rate_window).write.mode("overwrite").parquet(
            out("rates")
        )
        rate_rows = [r.asDict() for r in spark.read.parquet(out("rates")).collect()]
        watch.done("rates")
        A.prefix_writes_per_block(updates, depth, bucket).write.mode("overwrite").parquet(
            out("blocks")
        )
        block_rows = [r.asDict() for r in spark.read.parquet(out("blocks")).collect()]
        watch.done("blocks")
        if diff is not None:
            lo, hi = diff
            A.state_diff(state(lo), state(hi)).orderBy("key").write.mode("overwrite").parquet(
                out("diff")
            )
            counts = spark.read.parquet(out("diff")).groupBy("status").count().collect()
            result.diff = {str(r["status"]): int(r["count"]) for r in counts}
            watch.done("diff")
    finally:
        updates.unpersist()
    result.notes = notes
    report.render_audit_plot(rate_rows, block_rows, depth, bucket, rate_window, result.plot)
    watch.done("report")
    result.stages = watch.stages
    with open(result.markdown, "w", encoding="utf-8") as fh:
        fh.write(
            report.render_audit_markdown(result, spans, rate_rows, block_rows, depth, bucket, diff)
        )
    return result
