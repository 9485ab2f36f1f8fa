"""Exact input, end to end: bad CSV and JSON rows are rejected with their reason
and line, nothing stored differs from the input, and an unreadable input is one
line on stderr (docs/pipeline.md, "Rejected rows")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clone import Clone
from clone.pipeline.cli import main
from clone.wire.protocol import MAX_KEY_BYTES, MAX_VALUE_BYTES
from tests.support.servers import Servers
from tests.support.spark_session import child_conf, child_env

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(240)]

HB = 0.1
JVM_NOTICE = "WARNING: Using incubator modules: jdk.incubator.vector"

# (bytes of one record, reason or None when it is stored, the value stored)
CSV_ROWS: list[tuple[bytes, str | None, bytes | None]] = [
    (b'/in/quoted,"he said ""hi"", then left"\r\n', None, b'he said "hi", then left'),
    (b'/in/newline,"first\nsecond"\n', None, b"first\nsecond"),
    (b'/in/comma,"a,b"\n', None, b"a,b"),
    ("/in/utf8,é€\n".encode(), None, "é€".encode()),
    (b"/in/many,1,2\n", "too many fields: 3, the header has 2", None),
    (b"/in/few\n", "too few fields: 1, the header has 2", None),
    (b"/in/badvalue,\xff\xfeok\n", "column 'value' is not valid UTF-8", None),
    (b"/in/bad\xc3(key,v\n", "column 'key' is not valid UTF-8", None),
    (b'/in/afterquote,"ab"c\n', "not RFC 4180 CSV: ',' expected after '\"'", None),
]


# Every reason of the table a typed (Parquet) column can reach, with --subtree
# /pq/: (key, value, ttl, reason or None when it is stored).
PARQUET_ROWS: list[tuple[bytes | None, bytes | None, float | None, str | None]] = [
    (b"/pq/plain", b"v1", None, None),
    (b"/pq/binary", b"\x00\xff\xfe", 600.0, None),  # a ttl that outlives a busy test
    (b"/pq/ttl0", b"v0", 0.0, None),
    (None, b"v", None, "key is null"),
    (b"", b"v", None, "key is empty"),
    (b"/pq/\xff\xfebad", b"v", None, "key is not valid UTF-8"),
    (b"/pq/" + b"k" * MAX_KEY_BYTES, b"v", None,
     f"key is {MAX_KEY_BYTES + 4} bytes, over the {MAX_KEY_BYTES}-byte limit"),
    (b"HUGZ", b"v", None, "key 'HUGZ' is reserved"),
    (b"KTHXBAI", b"v", None, "key 'KTHXBAI' is reserved"),
    (b"/elsewhere/k", b"v", None, "key is outside subtree '/pq/'"),
    (b"/pq/dup", b"a", None, "key appears 2 times in the input"),
    (b"/pq/dup", b"b", None, "key appears 2 times in the input"),
    (b"/pq/nullvalue", None, None, "value is null"),
    (b"/pq/emptyvalue", b"", None, "value is empty (an empty value deletes the key)"),
    (b"/pq/bigvalue", b"x" * (MAX_VALUE_BYTES + 1), None,
     f"value is {MAX_VALUE_BYTES + 1} bytes, over the {MAX_VALUE_BYTES}-byte limit"),
    (b"/pq/nan", b"v", float("nan"), "ttl is not a number"),
    (b"/pq/neg", b"v", -1.0, "ttl -1.0 is negative"),
    (b"/pq/big", b"v", 4e7, "ttl 4.0E7 is over the 31536000-second limit"),
]  # fmt: skip


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _stored(port: int, prefix: str) -> dict[str, bytes]:
    client = Clone([f"tcp://127.0.0.1:{port}"], heartbeat=HB, server_timeout=1.0)
    try:
        client.wait_synced(20)
        return dict(client.items(prefix))
    finally:
        client.close()


def _rejects(where: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for f in sorted(where.glob("*.json")) for line in f.open()]


def test_csv_bad_rows_rejected_with_reason_and_line(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    solo = servers.standalone()
    data = b"key,value\r\n" + b"".join(row for row, _, _ in CSV_ROWS)
    (tmp_path / "t.csv").write_bytes(data)
    lines, line = [], 2
    for row, _, _ in CSV_ROWS:
        lines.append(line)
        line += row.count(b"\n")
    code, out, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input", str(tmp_path / "t.csv"),
        "--format", "csv", "--heartbeat", str(HB), "--rejects", str(tmp_path / "rejects"), "-q",
    )  # fmt: skip
    assert code == 1, err
    expected_rejects = {
        at: reason for at, (_, reason, _) in zip(lines, CSV_ROWS, strict=True) if reason
    }
    for at, reason in expected_rejects.items():
        assert f"  {reason} (first at line {at})" in out, out
    rejects = _rejects(tmp_path / "rejects")
    assert {r["input_line"]: r["reject_reason"] for r in rejects} == expected_rejects
    # A rejected row keeps its original text (bytes that are not UTF-8 as \xNN).
    texts = {r["input_line"]: r["input_text"] for r in rejects}
    assert texts[lines[6]] == "/in/badvalue,\\xff\\xfeok\n"
    assert texts[lines[4]] == "/in/many,1,2\n"
    # Stored: exactly the good rows, byte for byte; nothing else under /in/.
    good = {
        row.split(b",", 1)[0].decode(): value
        for row, reason, value in CSV_ROWS
        if reason is None and value is not None
    }
    assert _stored(solo.port, "/in/") == good


def test_csv_text_ttl_unclosed_quote_and_a_file_with_another_header(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CSV reasons the test above does not reach: a text ttl, a quote
    never closed (it takes the rest of its file) and a file of the input
    whose header is not the first file's (one reject for the whole file)."""
    solo = servers.standalone()
    where = tmp_path / "in"
    where.mkdir()
    # The larger file is read first by Spark (splits go by size): its header rules.
    (where / "a.csv").write_bytes(
        b"key,value,ttl\n"
        b"/tx/ok,kept,600\n"
        + b"".join(b"/tx/pad%03d,%s,0\n" % (i, b"p" * 40) for i in range(20))
        + b"/tx/badttl,v,abc\n"
        b'/tx/open,"never closed\n/tx/swallowed,v,\n'
    )
    (where / "b.csv").write_bytes(b"key,val,ttl\n/tx/other,v,\n")
    code, out, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input", str(where),
        "--format", "csv", "--ttl-col", "ttl", "--heartbeat", str(HB),
        "--rejects", str(tmp_path / "rejects"), "--manifest", str(tmp_path / "m.json"), "-q",
    )  # fmt: skip
    assert code == 1, err
    assert "rows written:  21" in out, out
    assert "rows rejected: 3" in out, out
    assert "  ttl 'abc' is not a decimal number of seconds (first at line 23)" in out, out
    assert "  not RFC 4180 CSV: unexpected end of data (first at line 24)" in out, out
    rejects = {(Path(r["input_file"]).name, r["input_line"]): r["reject_reason"]
               for r in _rejects(tmp_path / "rejects")}  # fmt: skip
    assert rejects == {
        ("a.csv", 23): "ttl 'abc' is not a decimal number of seconds",
        ("a.csv", 24): "not RFC 4180 CSV: unexpected end of data",
        ("b.csv", 1): "file not read: header 'key,val,ttl' differs from 'key,value,ttl'",
    }
    other = "file not read: header 'key,val,ttl' differs from 'key,value,ttl'"
    assert f"  {other} (first at line 1)" in out, out
    stored = _stored(solo.port, "/tx/")
    assert stored == {"/tx/ok": b"kept", **{f"/tx/pad{i:03d}": b"p" * 40 for i in range(20)}}
    with Clone([f"tcp://127.0.0.1:{solo.port}"], heartbeat=HB) as client:
        client.wait_synced(20)
        assert client.entry("/tx/ok").prop("ttl") == "600.0"


def test_every_typed_column_reason_end_to_end(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each reason a Parquet table's typed columns can reach (binary keys,
    binary values, double ttls): exit 1, the reason and its count printed and
    in the rejects, and stored exactly the good rows, values byte for byte."""
    solo = servers.standalone()
    keys, values, ttls, _ = zip(*PARQUET_ROWS, strict=True)
    table = {"k": pa.array(keys, pa.binary()), "v": pa.array(values, pa.binary()),
             "t": pa.array(ttls, pa.float64())}  # fmt: skip
    pq.write_table(pa.table(table), tmp_path / "t.parquet")
    code, out, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input",
        str(tmp_path / "t.parquet"), "--key-col", "k", "--value-col", "v", "--ttl-col", "t",
        "--subtree", "/pq/", "--heartbeat", str(HB), "--rejects", str(tmp_path / "rejects"),
        "--manifest", str(tmp_path / "m.json"), "-q",
    )  # fmt: skip
    assert code == 1, err
    expected = [reason for *_, reason in PARQUET_ROWS if reason]
    assert f"rows rejected: {len(expected)}" in out, out
    for reason in set(expected):
        assert f"  {expected.count(reason):>10}  {reason}\n" in out, (reason, out)
    got = sorted(r["reject_reason"] for r in _rejects(tmp_path / "rejects"))
    assert got == sorted(expected)
    good = {k.decode(): (v, t) for k, v, t, reason in PARQUET_ROWS if reason is None}
    with Clone([f"tcp://127.0.0.1:{solo.port}"], heartbeat=HB) as client:
        client.wait_synced(20)
        held = {e.key: e for e in client.entries("")}
        assert {k: e.value for k, e in held.items()} == {k: v for k, (v, _) in good.items()}
        for key, (_, ttl) in good.items():
            assert held[key].prop("ttl") == (None if not ttl else repr(ttl)), key


def test_json_line_that_is_not_json(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    solo = servers.standalone()
    (tmp_path / "t.jsonl").write_text(
        '{"key": "/js/a", "value": "1"}\n'
        '{"key": "/js/b", "value": \n'
        '{"key": "/js/c", "value": "3"}\n'
    )
    code, out, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input",
        str(tmp_path / "t.jsonl"), "--format", "json", "--heartbeat", str(HB),
        "--rejects", str(tmp_path / "rejects"), "-q",
    )  # fmt: skip
    assert code == 1, err
    assert "           1  not JSON\n" in out
    (reject,) = _rejects(tmp_path / "rejects")
    assert reject["reject_reason"] == "not JSON"
    assert reject["_corrupt_record"] == '{"key": "/js/b", "value": '
    assert _stored(solo.port, "/js/") == {"/js/a": b"1", "/js/c": b"3"}


def _child(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """clone-pipeline in a process of its own: its JVM's stderr is what a user sees."""
    return subprocess.run(
        [sys.executable, "-m", "clone.pipeline", *argv, *child_conf()], cwd=cwd, env=child_env(),
        capture_output=True, text=True, timeout=200,
    )  # fmt: skip


def test_csv_read_as_parquet_is_one_line_and_the_trace_only_with_v(
    servers: Servers, tmp_path: Path
) -> None:
    solo = servers.standalone()
    (tmp_path / "t.csv").write_text("key,value\n/a,1\n")
    argv = ["load", "--servers", f"127.0.0.1:{solo.port}", "--input", str(tmp_path / "t.csv"),
            "--heartbeat", str(HB), "-q"]  # fmt: skip
    done = _child(argv, tmp_path)
    assert done.returncode == 2, done.stderr
    # Java's own notice at JVM start (Spark 4 adds the module): not about the input.
    lines = [line for line in done.stderr.splitlines() if line.strip() and line != JVM_NOTICE]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"clone-pipeline load: error: cannot read parquet input {tmp_path}")
    assert "is not a Parquet file" in lines[0]
    verbose = _child([*argv[:-1], "-v"], tmp_path)
    assert verbose.returncode == 2
    assert "\tat org.apache" in verbose.stderr  # the Java trace, asked for
    assert verbose.stderr.splitlines()[-1] == lines[0]
