"""Exact input, end to end: bad CSV and JSON rows are rejected with their reason
and line, nothing stored differs from the input, and an unreadable input is one
line on stderr (docs/pipeline.md, "Rejected rows")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from clone import Clone
from clone.pipeline.cli import main
from tests.support.servers import Servers
from tests.support.spark_session import child_env

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
        [sys.executable, "-m", "clone.pipeline", *argv], cwd=cwd, env=child_env(),
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
