"""The export hands its snapshot to Spark a file at a time, never whole.

A 10M-key export ran the driver's JVM out of heap (``OutOfMemoryError: Java
heap space``) when the whole snapshot went through one ``createDataFrame``.
Here a snapshot of 2,500 keys is written with files of 1,000 rows: no
``createDataFrame`` may see more than 1,000 rows, and the files, read back,
are the snapshot exactly, in key order.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from clone.pipeline import exporting
from clone.pipeline.snapshot import Snapshot
from clone.wire.codec import KVMsg

pytestmark = pytest.mark.spark


def _snapshot(n: int) -> Snapshot:
    keys = [f"/fleet/node-{i:07d}/cpu" for i in range(n)]
    random.Random(7).shuffle(keys)  # a dict in arrival order, not key order
    entries = {}
    for seq, key in enumerate(keys, 1):
        props: tuple[tuple[str, str], ...] = (("ttl", "30.0"),) if seq % 7 == 0 else ()
        entries[key] = KVMsg(key, seq, seq.to_bytes(16, "big"), props, b"v%d" % seq)
    return Snapshot(entries, n, n, "tcp://127.0.0.1:1", "")


def _files(out: Path) -> list[Path]:
    return sorted(out.glob("part-*.parquet"))


def test_a_snapshot_goes_to_spark_a_file_at_a_time(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = _snapshot(2_500)
    handed: list[int] = []
    original = spark.createDataFrame

    def counting(data: Any, *args: Any, **kwargs: Any) -> Any:
        handed.append(data.num_rows)
        return original(data, *args, **kwargs)

    monkeypatch.setattr(spark, "createDataFrame", counting)
    out = tmp_path / "export"
    files = exporting.write_snapshot(spark, snap, str(out), rows_per_file=1_000)

    assert files == 3
    assert handed == [1_000, 1_000, 500]  # never the whole snapshot at once
    parts = _files(out)
    assert len(parts) == 3
    tables = [pq.read_table(p) for p in parts]
    assert sorted(t.num_rows for t in tables) == [500, 1_000, 1_000]
    for table in tables:  # each file in key order
        keys = table.column("key").to_pylist()
        assert keys == sorted(keys)
    rows = spark.read.parquet(str(out)).collect()
    assert len(rows) == 2_500
    for row in rows:
        msg = snap.entries[row["key"]]
        assert (row["value"], row["sequence"], row["uuid"]) == (
            msg.body, msg.sequence, msg.uuid.hex()
        )  # fmt: skip
        assert row["ttl"] == (30.0 if msg.properties else 0.0)


def test_a_new_export_replaces_the_old_files(spark: Any, tmp_path: Path) -> None:
    out = tmp_path / "export"
    assert exporting.write_snapshot(spark, _snapshot(2_500), str(out), rows_per_file=1_000) == 3
    assert exporting.write_snapshot(spark, _snapshot(10), str(out), rows_per_file=1_000) == 1
    assert spark.read.parquet(str(out)).count() == 10
    # An empty store is one file with the export's columns and no row.
    empty = Snapshot({}, 5, 5, "tcp://127.0.0.1:1", "")
    assert exporting.write_snapshot(spark, empty, str(out), rows_per_file=1_000) == 1
    back = spark.read.parquet(str(out))
    assert back.count() == 0
    assert back.columns == ["key", "value", "sequence", "uuid", "properties", "ttl", "expires"]
    with pytest.raises(ValueError):
        exporting.write_snapshot(spark, empty, str(out), rows_per_file=0)
