"""The pipeline's pure transforms on literal rows (one shared local Spark)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from clone.pipeline.errors import InputError
from clone.pipeline.transforms import (
    LoadColumns,
    rejected_rows,
    snapshot_to_export,
    state_at_sequence,
    state_differences,
    with_reject_reason,
    write_records,
)
from clone.wire.protocol import MAX_KEY_BYTES, MAX_VALUE_BYTES

pytestmark = pytest.mark.spark

# (key, value, ttl) -> reject reason (None = stored); one row per rule.
TEXT_CASES: list[tuple[str | None, str | None, str | None, str | None]] = [
    ("/ok/plain", "v", None, None),
    ("/ok/ttl", "v", "1.5", None),
    ("/ok/ttl0", "v", "0", None),
    (None, "v", None, "key is null"),
    ("", "v", None, "key is empty"),
    ("/" + "k" * MAX_KEY_BYTES, "v", None,
     f"key is {MAX_KEY_BYTES + 1} bytes, over the {MAX_KEY_BYTES}-byte limit"),
    ("HUGZ", "v", None, "key 'HUGZ' is reserved"),
    ("KTHXBAI", "v", None, "key 'KTHXBAI' is reserved"),
    ("/dup", "a", None, "key appears 2 times in the input"),
    ("/dup", "b", None, "key appears 2 times in the input"),
    ("/nullvalue", None, None, "value is null"),
    ("/emptyvalue", "", None, "value is empty (an empty value deletes the key)"),
    ("/bigvalue", "x" * (MAX_VALUE_BYTES + 1), None,
     f"value is {MAX_VALUE_BYTES + 1} bytes, over the {MAX_VALUE_BYTES}-byte limit"),
    ("/ttl/text", "v", "abc", "ttl 'abc' is not a decimal number of seconds"),
    ("/ttl/neg", "v", "-1", "ttl '-1' is not a decimal number of seconds"),
    ("/ttl/inf", "v", "inf", "ttl 'inf' is not a decimal number of seconds"),
    ("/ttl/big", "v", "31536001", "ttl 31536001 is over the 31536000-second limit"),
]  # fmt: skip


def _reasons(df: Any) -> dict[tuple[Any, ...], str | None]:
    return {tuple(r[:-1]): r[-1] for r in df.collect()}


def test_each_reject_reason_for_text_columns(spark: Any) -> None:
    df = spark.createDataFrame(TEXT_CASES, "key string, value string, ttl string, expected string")
    checked = with_reject_reason(df, LoadColumns(ttl="ttl"))
    got = {(r["key"], r["value"]): r["reject_reason"] for r in checked.collect()}
    for key, value, _ttl, expected in TEXT_CASES:
        assert got[(key, value)] == expected, key


def test_binary_and_numeric_columns(spark: Any) -> None:
    rows = [
        (b"\xff\xfe/bad", b"v", 1.0, "key is not valid UTF-8"),
        (b"/ok", b"\x00\xff", 2.0, None),
        (b"/nan", b"v", float("nan"), "ttl is not a number"),
        (b"/neg", b"v", -1.0, "ttl -1.0 is negative"),
        (b"/big", b"v", 4e7, "ttl 4.0E7 is over the 31536000-second limit"),
        (b"/nullttl", b"v", None, None),
    ]
    df = spark.createDataFrame(rows, "k binary, v binary, t double, expected string")
    checked = with_reject_reason(df, LoadColumns(key="k", value="v", ttl="t"))
    for row in checked.collect():
        assert row["reject_reason"] == row["expected"], row["k"]
    out = {r["key"]: (r["value"], r["ttl"]) for r in write_records(checked).collect()}
    assert out == {"/ok": (bytearray(b"\x00\xff"), 2.0), "/nullttl": (bytearray(b"v"), 0.0)}


def test_subtree_and_value_types(spark: Any) -> None:
    df = spark.createDataFrame(
        [("/app/a", 1, (1, "x")), ("/other/b", 2, (2, "y"))],
        "key string, n int, doc struct<id:int,name:string>",
    )
    checked = with_reject_reason(df, LoadColumns(value="doc", subtree="/app/"))
    assert _reasons(checked.select("key", "reject_reason")) == {
        ("/app/a",): None,
        ("/other/b",): "key is outside subtree '/app/'",
    }
    assert [bytes(r["value"]) for r in write_records(checked).collect()] == [b'{"id":1,"name":"x"}']
    ints = write_records(with_reject_reason(df, LoadColumns(value="n"))).collect()
    assert sorted(bytes(r["value"]) for r in ints) == [b"1", b"2"]


def test_rejected_rows_keep_the_input_columns(spark: Any) -> None:
    df = spark.createDataFrame(
        [("", "v", 7), ("/k", "v", 8)], "key string, value string, extra int"
    )
    rejected = rejected_rows(with_reject_reason(df, LoadColumns()))
    assert rejected.columns == ["key", "value", "extra", "reject_reason"]
    assert [tuple(r) for r in rejected.collect()] == [("", "v", 7, "key is empty")]


@pytest.mark.parametrize(
    ("cols", "message"),
    [
        (LoadColumns(key="nope"), "input has no column 'nope' (columns: key, value, doc)"),
        (LoadColumns(ttl="doc"), "ttl column 'doc' has type struct<a:int>"),
        (LoadColumns(key="doc"), "key column 'doc' has type struct<a:int>"),
    ],
)
def test_bad_columns_raise_input_error(spark: Any, cols: LoadColumns, message: str) -> None:
    df = spark.createDataFrame([("/k", "v", (1,))], "key string, value string, doc struct<a:int>")
    with pytest.raises(InputError, match=re.escape(message)):
        with_reject_reason(df, cols)


UPDATES = [
    ("/a", b"1", 1, {}),
    ("/b", b"1", 2, {"ttl": "30", "expires": "1700000030.000"}),
    ("/a", b"2", 3, {}),
    ("/b", b"", 4, {}),  # delete
    ("/c", b"1", 5, {}),
]
UPDATE_SCHEMA = "key string, value binary, sequence long, properties map<string,string>"


def test_state_at_sequence_reconstructs_any_point(spark: Any) -> None:
    updates = spark.createDataFrame(UPDATES, UPDATE_SCHEMA).selectExpr(
        "*", "cast(null as string) as uuid", "cast(null as double) as ts"
    )

    def state(seq: int | None) -> dict[str, tuple[bytes, int]]:
        rows = state_at_sequence(updates, seq).collect()
        return {r["key"]: (bytes(r["value"]), r["sequence"]) for r in rows}

    assert state(2) == {"/a": (b"1", 1), "/b": (b"1", 2)}
    assert state(3) == {"/a": (b"2", 3), "/b": (b"1", 2)}
    assert state(None) == {"/a": (b"2", 3), "/c": (b"1", 5)}
    assert state(0) == {}


def test_snapshot_to_export_and_state_differences(spark: Any) -> None:
    snap = spark.createDataFrame(UPDATES[:3], UPDATE_SCHEMA).selectExpr(
        "key", "value", "sequence", "cast(null as string) as uuid", "properties"
    )
    export = {r["key"]: r for r in snapshot_to_export(snap).collect()}
    assert export["/b"]["ttl"] == 30.0 and export["/b"]["expires"] == 1700000030.0
    assert export["/a"]["ttl"] == 0.0 and export["/a"]["expires"] is None

    schema = "key string, value binary, sequence long"
    left = spark.createDataFrame(
        [("/a", b"1", 1), ("/b", b"2", 2), ("/c", b"3", 3), ("/d", b"4", 4)], schema
    )
    right = spark.createDataFrame(
        [("/a", b"1", 1), ("/b", b"X", 2), ("/c", b"3", 9), ("/e", b"5", 5)], schema
    )
    diff = {r["key"]: r["difference"] for r in state_differences(left, right).collect()}
    assert diff == {"/b": "value", "/c": "sequence", "/d": "only_left", "/e": "only_right"}
    assert state_differences(left, left).count() == 0
