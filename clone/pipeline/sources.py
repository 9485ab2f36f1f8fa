"""Readers: every input of the pipeline as a DataFrame with a fixed schema.

Three kinds of input, one shared vocabulary:

- **tables** to load (Parquet, CSV, JSON) — any schema; the load job picks its
  columns by name (:func:`read_table`);
- **drill logs** — ``events.jsonl`` and ``summary.json`` written by
  ``scripts/drill`` (:func:`read_drill_events`, :func:`read_drill_summaries`);
- **exports** — Parquet snapshots written by ``clone-pipeline export`` with
  their ``_clone_snapshot.json`` (:func:`read_export`).

Drill logs and exports both map onto :data:`UPDATE_EVENT_SCHEMA` (one row per
update the store applied: key, value, sequence, uuid, properties, ts) through
:func:`read_drill_updates` and :func:`read_export_updates`.  A server journal
reader, when the server keeps one, returns the same schema, and the
point-in-time and audit transforms in :mod:`clone.pipeline.transforms`
(:func:`~clone.pipeline.transforms.state_at_sequence`,
:func:`~clone.pipeline.transforms.state_differences`) work on all of them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any
from urllib.parse import urlsplit

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    DoubleType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

from clone.pipeline.errors import InputError, is_spark_error, one_line

__all__ = [
    "UPDATE_EVENT_SCHEMA",
    "DRILL_EVENT_SCHEMA",
    "EXPORT_SCHEMA",
    "SNAPSHOT_META_FILE",
    "TABLE_FORMATS",
    "DrillRun",
    "ExportMeta",
    "read_table",
    "resolve_output",
    "read_drill_events",
    "read_drill_summaries",
    "read_drill_updates",
    "read_export",
    "read_export_updates",
    "require_exists",
    "INPUT_FILE",
    "INPUT_LINE",
    "INPUT_TEXT",
    "INPUT_REASON",
    "read_export_meta",
]

log = logging.getLogger(__name__)

TABLE_FORMATS = ("parquet", "csv", "json")
SNAPSHOT_META_FILE = "_clone_snapshot.json"

#: One update applied by the store.  ``value`` is null when the source does not
#: carry values (drill logs) and empty for a delete; ``uuid`` is lower-case hex
#: or null; ``ts`` is Unix seconds, null when unknown.
UPDATE_EVENT_SCHEMA = StructType(
    [
        StructField("key", StringType(), False),
        StructField("value", BinaryType(), True),
        StructField("sequence", LongType(), False),
        StructField("uuid", StringType(), True),
        StructField("properties", MapType(StringType(), StringType()), False),
        StructField("ts", DoubleType(), True),
    ]
)

#: One line of a drill's ``events.jsonl``.  Fields a given event does not use
#: are absent (null).  ``from``/``to`` are endpoints of the old and new server.
DRILL_EVENT_SCHEMA = StructType(
    [
        StructField("ts", DoubleType(), True),
        StructField("client", StringType(), True),
        StructField("event", StringType(), True),
        StructField("key", StringType(), True),
        StructField("seq", LongType(), True),
        StructField("uuid", StringType(), True),
        StructField("confirmed", BooleanType(), True),
        StructField("gap_s", DoubleType(), True),
        StructField("from", StringType(), True),
        StructField("to", StringType(), True),
        StructField("kind", StringType(), True),
        StructField("target", StringType(), True),
        StructField("hash", StringType(), True),
        StructField("keys", LongType(), True),
    ]
)

#: What ``export`` writes: one row per key of the snapshot.
EXPORT_SCHEMA = StructType(
    [
        StructField("key", StringType(), False),
        StructField("value", BinaryType(), False),
        StructField("sequence", LongType(), False),
        StructField("uuid", StringType(), True),
        StructField("properties", MapType(StringType(), StringType()), False),
        StructField("ttl", DoubleType(), False),
        StructField("expires", DoubleType(), True),
    ]
)


@dataclass(frozen=True, slots=True)
class DrillRun:
    """One drill run directory and what its ``summary.json`` says (may be empty)."""

    path: str
    scenario: str
    summary: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ExportMeta:
    """The contents of an export's ``_clone_snapshot.json``."""

    sequence: int
    snapshot_sequence: int
    servers: tuple[str, ...]
    server: str
    subtree: str
    time: float
    rows: int

    def to_json(self) -> dict[str, Any]:
        return {
            "format": 1,
            "sequence": self.sequence,
            "snapshot_sequence": self.snapshot_sequence,
            "servers": list(self.servers),
            "server": self.server,
            "subtree": self.subtree,
            "time": self.time,
            "rows": self.rows,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExportMeta:
        try:
            return cls(
                sequence=int(data["sequence"]),
                snapshot_sequence=int(data.get("snapshot_sequence", data["sequence"])),
                servers=tuple(str(s) for s in data.get("servers", ())),
                server=str(data.get("server", "")),
                subtree=str(data.get("subtree", "")),
                time=float(data["time"]),
                rows=int(data["rows"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"{SNAPSHOT_META_FILE} is malformed: {exc}") from None


def _is_local(path: str) -> bool:
    scheme = urlsplit(path).scheme
    return scheme in ("", "file") or len(scheme) == 1  # "C:" on Windows


def resolve_output(path: str) -> str:
    """A plain local path made absolute (Spark resolves a relative one against
    the JVM's working directory, not ours); a URL (``hdfs://``, ``s3a://``,
    ``file:``) as given, where making it absolute would mangle it."""
    scheme = urlsplit(path).scheme
    return os.path.abspath(path) if scheme == "" or len(scheme) == 1 else path


def _local_path(path: str) -> str:
    return urlsplit(path).path if path.startswith("file:") else path


def require_exists(path: str, what: str) -> None:
    """Raise :class:`InputError` when a local ``path`` does not exist (remote
    paths are left to Spark, whose error is turned into an InputError)."""
    if _is_local(path) and not os.path.exists(_local_path(path)):
        raise InputError(f"{what} {path} does not exist")


def _first_line(exc: BaseException) -> str:
    return one_line(exc)


#: Columns a CSV input gains (:func:`read_table`): where each record starts, and
#: for a rejected record its original text.  The rejects keep them.
INPUT_FILE = "input_file"
INPUT_LINE = "input_line"
INPUT_TEXT = "input_text"
#: Why the reader itself rejected a row (CSV: fields, quoting, UTF-8; JSON: not
#: JSON), null if it did not; merged into ``reject_reason`` by the load transform.
INPUT_REASON = "__clone_input_reason"
#: The column Spark's JSON reader puts a line that is not JSON in.
JSON_CORRUPT = "_corrupt_record"
# Records per Arrow batch out of the CSV parser.
_CSV_BATCH = 20_000


def read_table(spark: SparkSession, path: str, fmt: str = "parquet") -> DataFrame:
    """A table to load.

    CSV needs a header line; it is read as RFC 4180 by :mod:`clone.pipeline.csvinput`
    in the executors, every column as text, with :data:`INPUT_FILE`,
    :data:`INPUT_LINE`, :data:`INPUT_TEXT` and :data:`INPUT_REASON` added.
    JSON lines that are not JSON get :data:`INPUT_REASON` "not JSON".
    Any error of Spark's or the JVM's reading the input is an :class:`InputError`.
    """
    if fmt not in TABLE_FORMATS:
        raise InputError(f"unknown format {fmt!r} (one of {', '.join(TABLE_FORMATS)})")
    require_exists(path, "input")
    try:
        if fmt == "csv":
            return _read_csv(spark, path)
        df = spark.read.format(fmt).load(path)
        if not df.columns:
            raise InputError(f"input {path} has no columns (empty or not {fmt})")
        if fmt == "json" and JSON_CORRUPT in df.columns:
            df = df.withColumn(
                INPUT_REASON,
                F.when(F.col(JSON_CORRUPT).isNotNull(), F.lit("not JSON")).otherwise(
                    F.lit(None).cast("string")
                ),
            )
    except InputError:
        raise
    except Exception as exc:
        if not is_spark_error(exc):
            raise
        raise InputError(f"cannot read {fmt} input {path}: {_first_line(exc)}") from None
    return df


def _read_csv(spark: SparkSession, path: str) -> DataFrame:
    from clone.pipeline.csvinput import CsvHeaderError, parse_header

    first = spark.read.text(path).limit(1).collect()
    if not first:
        raise InputError(f"input {path} has no columns (empty or not csv)")
    try:
        header = parse_header(str(first[0][0]).encode("utf-8") + b"\n")
    except CsvHeaderError as exc:
        raise InputError(f"csv input {path}: {exc}") from None
    taken = {INPUT_FILE, INPUT_LINE, INPUT_TEXT, INPUT_REASON} & set(header)
    if taken:
        raise InputError(f"csv input {path} has column(s) {sorted(taken)}, which the reader adds")
    schema = ", ".join(
        [f"`{name}` string" for name in header]
        + [f"{INPUT_FILE} string", f"{INPUT_LINE} long", f"{INPUT_TEXT} string",
           f"{INPUT_REASON} string"]
    )  # fmt: skip
    files = spark.read.format("binaryFile").load(path).select("path", "content")
    return files.mapInArrow(_csv_parser(header), schema)


def _csv_parser(header: tuple[str, ...]) -> Any:
    """A ``mapInArrow`` function: files (path, content) in, records out."""

    def run(batches: Any) -> Any:
        import pyarrow as pa

        from clone.pipeline.csvinput import CsvHeaderError, parse_records

        names = [*header, INPUT_FILE, INPUT_LINE, INPUT_TEXT, INPUT_REASON]
        types = [pa.string()] * (len(header) + 1) + [pa.int64(), pa.string(), pa.string()]
        schema = pa.schema(list(zip(names, types, strict=True)))

        def batch(rows: list[tuple[Any, ...]]) -> Any:
            columns = list(zip(*rows, strict=True)) if rows else [()] * len(names)
            return pa.RecordBatch.from_arrays(
                [pa.array(c, t) for c, t in zip(columns, types, strict=True)], schema=schema
            )

        blank = (None,) * len(header)
        for files in batches:
            for file, content in zip(
                files.column("path").to_pylist(), files.column("content").to_pylist(),
                strict=True,
            ):  # fmt: skip
                rows: list[tuple[Any, ...]] = []
                try:
                    for rec in parse_records(content, header):
                        if rec.fields is None:
                            rows.append((*blank, file, rec.line, rec.text, rec.reason))
                        else:
                            rows.append((*rec.fields, file, rec.line, None, None))
                        if len(rows) >= _CSV_BATCH:
                            yield batch(rows)
                            rows = []
                except CsvHeaderError as exc:
                    rows.append((*blank, file, 1, None, f"file not read: {exc}"))
                if rows:
                    yield batch(rows)

    return run


def read_drill_summaries(paths: Sequence[str]) -> list[DrillRun]:
    """The runs in ``paths``, each with its ``summary.json`` (driver-side, small)."""
    runs: list[DrillRun] = []
    for path in paths:
        require_exists(path, "drill directory")
        require_exists(os.path.join(path, "events.jsonl"), "drill log")
        summary: dict[str, Any] = {}
        summary_path = os.path.join(_local_path(path), "summary.json")
        if os.path.exists(summary_path):
            try:
                with open(summary_path, encoding="utf-8") as fh:
                    loaded = json.load(fh)
            except (OSError, ValueError) as exc:
                raise InputError(f"{summary_path} is not readable JSON: {exc}") from None
            if isinstance(loaded, dict):
                summary = loaded
        scenario = str(summary.get("scenario") or os.path.basename(os.path.normpath(path)))
        runs.append(DrillRun(path=path, scenario=scenario, summary=summary))
    return runs


def read_drill_events(spark: SparkSession, runs: Sequence[DrillRun]) -> DataFrame:
    """All events of ``runs``, with ``run`` and ``scenario`` columns and a
    ``line`` number that keeps each file's order for events with equal ``ts``.

    Lines that are not JSON objects are counted and logged, not dropped
    silently.
    """
    if not runs:
        raise InputError("no drill directories given")
    schema = StructType([*DRILL_EVENT_SCHEMA.fields, StructField("_corrupt", StringType(), True)])
    frames = []
    for run in runs:
        raw = (
            spark.read.schema(schema)
            .option("mode", "PERMISSIVE")
            .option("columnNameOfCorruptRecord", "_corrupt")
            .json(os.path.join(run.path, "events.jsonl"))
        )
        frames.append(
            raw.withColumn("run", F.lit(run.path))
            .withColumn("scenario", F.lit(run.scenario))
            .withColumn("line", F.monotonically_increasing_id())
        )
    events = reduce(DataFrame.unionByName, frames).cache()
    bad = events.filter(F.col("_corrupt").isNotNull()).count()
    if bad:
        log.warning("%d drill log lines are not JSON events; they are ignored", bad)
    return events.filter(F.col("_corrupt").isNull()).drop("_corrupt")


def read_drill_updates(spark: SparkSession, runs: Sequence[DrillRun]) -> DataFrame:
    """The ``update`` events of drill logs as :data:`UPDATE_EVENT_SCHEMA` rows."""
    from clone.pipeline.transforms import drill_events_to_updates

    return drill_events_to_updates(read_drill_events(spark, runs))


def read_export_meta(path: str) -> ExportMeta:
    """The ``_clone_snapshot.json`` of an export directory."""
    meta_path = os.path.join(_local_path(path), SNAPSHOT_META_FILE)
    try:
        with open(meta_path, encoding="utf-8") as fh:
            return ExportMeta.from_json(json.load(fh))
    except FileNotFoundError:
        raise InputError(f"{path} is not a Clone export (no {SNAPSHOT_META_FILE})") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {meta_path}: {exc}") from None


def read_export(spark: SparkSession, path: str) -> tuple[DataFrame, ExportMeta]:
    """An export written by ``clone-pipeline export`` and its snapshot metadata."""
    require_exists(path, "export")
    meta = read_export_meta(path)
    try:
        df = spark.read.schema(EXPORT_SCHEMA).parquet(path)
    except Exception as exc:
        if not is_spark_error(exc):
            raise
        raise InputError(f"cannot read export {path}: {_first_line(exc)}") from None
    return df, meta


def read_export_updates(spark: SparkSession, path: str) -> DataFrame:
    """An export as :data:`UPDATE_EVENT_SCHEMA` rows stamped with the export time."""
    from clone.pipeline.transforms import export_to_updates

    df, meta = read_export(spark, path)
    return export_to_updates(df, meta.time)
