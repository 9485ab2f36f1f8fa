"""The export: a consistent snapshot of the store written as Parquet.

The snapshot is taken in the driver over raw CHP (:mod:`clone.pipeline.snapshot`)
and handed to Spark one output file at a time (:func:`write_snapshot`), so the
driver's JVM never holds more than one file's rows, whatever the store's size.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from clone.pipeline.errors import InputError
from clone.pipeline.sources import EXPORT_SCHEMA, SNAPSHOT_META_FILE, ExportMeta

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

    from clone.pipeline.snapshot import Snapshot
    from clone.wire.codec import KVMsg

__all__ = [
    "ROWS_PER_FILE",
    "export_snapshot",
    "snapshot_dataframe",
    "write_snapshot",
    "write_text_file",
]

log = logging.getLogger(__name__)

#: Rows per Parquet file of an export (and of a history export): also the
#: most rows of an export the driver's JVM holds at once.
ROWS_PER_FILE = 500_000


def _entries_table(entries: Sequence[KVMsg]) -> pa.Table:
    import pyarrow as pa

    return pa.table(
        {
            "key": pa.array([m.key for m in entries], pa.string()),
            "value": pa.array([m.body for m in entries], pa.binary()),
            "sequence": pa.array([m.sequence for m in entries], pa.int64()),
            "uuid": pa.array([m.uuid.hex() if m.uuid else None for m in entries], pa.string()),
            "properties": pa.array(
                [list(m.properties) for m in entries], pa.map_(pa.string(), pa.string())
            ),
        }
    )


def _arrow_dataframe(spark: SparkSession, table: pa.Table) -> DataFrame:
    """Snapshot rows as a DataFrame in :data:`EXPORT_SCHEMA` (built from Arrow
    columns: no per-row Python objects on the way to the JVM)."""
    from clone.pipeline.transforms import snapshot_to_export

    raw_schema = ", ".join(
        f"`{f.name}` {f.dataType.simpleString()}" for f in EXPORT_SCHEMA.fields[:5]
    )
    return snapshot_to_export(spark.createDataFrame(table, schema=raw_schema))


def snapshot_dataframe(spark: SparkSession, snap: Snapshot) -> DataFrame:
    """A (small) driver-side snapshot as one DataFrame in :data:`EXPORT_SCHEMA`.
    The export does not use it: it hands the snapshot over a file at a time
    (:func:`write_snapshot`)."""
    return _arrow_dataframe(spark, _entries_table(sorted(snap.entries.values(),
                                                         key=lambda m: m.key)))  # fmt: skip


def write_snapshot(
    spark: SparkSession, snap: Snapshot, output: str, *, rows_per_file: int = ROWS_PER_FILE
) -> int:
    """Write a snapshot as Parquet files of at most ``rows_per_file`` rows in
    key order, one Spark job per file; the number of files.

    Why a file at a time: ``createDataFrame`` puts its rows on the driver's JVM
    heap, and a whole 10M-key snapshot there ran Spark's default heap out
    (``OutOfMemoryError: Java heap space``).  A file's rows (500,000, about
    75 MB at 100-byte values) are all the JVM holds at once, whatever the
    store's size; the first file replaces the directory, the others are added.
    """
    if rows_per_file < 1:
        raise ValueError("rows_per_file must be >= 1")
    keys = sorted(snap.entries)
    entries = snap.entries
    files = 0
    for start in range(0, max(1, len(keys)), rows_per_file):
        table = _entries_table([entries[k] for k in keys[start : start + rows_per_file]])
        mode = "overwrite" if files == 0 else "append"
        _arrow_dataframe(spark, table).coalesce(1).write.mode(mode).parquet(output)
        files += 1
    return files


def write_text_file(spark: SparkSession, path: str, text: str) -> None:
    """Write a small text file through Hadoop's FileSystem, so that ``path``
    may be local or on any file system the cluster can write to."""
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    hpath = jvm.org.apache.hadoop.fs.Path(path)
    fs = hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    out = fs.create(hpath, True)
    try:
        out.write(bytearray(text.encode("utf-8")))
    finally:
        out.close()


def export_snapshot(
    spark: SparkSession,
    servers: Sequence[str],
    output: str,
    *,
    subtree: str = "",
    timeout: float = 5.0,
    curve: tuple[Any, bytes] | None = None,
    rows_per_file: int = ROWS_PER_FILE,
) -> ExportMeta:
    """Write a consistent snapshot of the store (or ``subtree``) to ``output``
    as Parquet (:func:`write_snapshot`), with ``_clone_snapshot.json``
    recording its sequence."""
    from clone.pipeline.progress import stage_progress
    from clone.pipeline.snapshot import take_snapshot
    from clone.progress import Progress

    started = time.time()
    with Progress("export: snapshot", unit="keys", show_after=1.0, transient=True) as bar:
        snap = take_snapshot(
            servers, subtree, timeout=timeout, curve=curve, progress=lambda keys: bar.update(keys)
        )
    log.info(
        "snapshot of %d keys at sequence %d from %s in %.2fs",
        len(snap.entries),
        snap.sequence,
        snap.server,
        time.time() - started,
    )
    try:
        with stage_progress(spark, f"export {len(snap.entries):,} keys"):
            write_snapshot(spark, snap, output, rows_per_file=rows_per_file)
    except Exception as exc:
        if type(exc).__name__ in ("AnalysisException", "Py4JJavaError"):
            first = str(exc).strip().splitlines()[0]
            raise InputError(f"cannot write the export to {output}: {first}") from None
        raise
    meta = ExportMeta(
        sequence=snap.sequence,
        snapshot_sequence=snap.snapshot_sequence,
        servers=tuple(servers),
        server=snap.server,
        subtree=subtree,
        time=started,
        rows=len(snap.entries),
    )
    write_text_file(
        spark, f"{output.rstrip('/')}/{SNAPSHOT_META_FILE}", json.dumps(meta.to_json(), indent=2)
    )
    return meta
