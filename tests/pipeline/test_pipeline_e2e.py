"""clone-pipeline load and export against a real server pair, on local Spark.

Load a generated table (with bad rows) and read it back through a client;
export and compare with the live store; load across a failover.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clone import Clone
from clone.pipeline.cli import main
from clone.pipeline.sources import read_export
from tests.support.servers import ServerProcess, Servers, wait_role

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(180)]

HB = 0.1
ROWS_FO = 10_000
BAD_ROWS: list[tuple[str | None, bytes | None, float | None]] = [
    (None, b"v", None),
    ("", b"v", None),
    ("HUGZ", b"v", None),
    ("/load/" + "x" * 1100, b"v", None),
    ("/load/dup", b"a", None),
    ("/load/dup", b"b", None),
    ("/load/nullvalue", None, None),
    ("/load/badttl", b"v", -1.0),
    ("/elsewhere/k", b"v", None),
]


def endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def _table(path: Path, n: int, prefix: str, bad: bool = True) -> dict[str, tuple[bytes, float]]:
    good = {
        f"{prefix}k{i:05d}": (f"value {i} ".encode() * (1 + i % 5), 600.0 if i % 10 == 0 else 0.0)
        for i in range(n)
    }
    rows = [(k, v, t or None) for k, (v, t) in good.items()] + (BAD_ROWS if bad else [])
    keys, values, ttls = zip(*rows, strict=True)
    table = pa.table(
        {
            "key": pa.array(keys, pa.string()),
            "value": pa.array(values, pa.binary()),
            "ttl": pa.array(ttls, pa.float64()),
        }
    )
    pq.write_table(table, path)
    return good


def _client(*srv: ServerProcess) -> Clone:
    c = Clone([endpoint(s) for s in srv], heartbeat=HB, server_timeout=1.0)
    c.wait_synced(60)
    return c


def test_load_read_back_and_export(
    spark: Any,
    servers: Servers,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    primary, backup = servers.pair()
    eps = f"{endpoint(primary)},{endpoint(backup)}"
    good = _table(tmp_path / "t.parquet", 2000, "/load/")

    code = main(
        ["load", "--servers", eps, "--input", str(tmp_path / "t.parquet"), "--ttl-col", "ttl",
         "--subtree", "/load/", "--rejects", str(tmp_path / "rejects"), "--heartbeat", str(HB)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1, out
    assert "rows written:  2000" in out
    assert f"rows rejected: {len(BAD_ROWS)}" in out
    assert "key is outside subtree '/load/'" in out

    rejects = [
        json.loads(line)
        for f in sorted((tmp_path / "rejects").glob("*.json"))
        for line in f.read_text().splitlines()
    ]
    assert len(rejects) == len(BAD_ROWS)
    assert all(r["reject_reason"] for r in rejects)

    with _client(primary, backup) as c:
        held = {e.key: e for e in c.entries("/load/")}
        assert {k: e.value for k, e in held.items()} == {k: v for k, (v, _) in good.items()}
        assert all((e.prop("ttl") is not None) == (good[k][1] > 0) for k, e in held.items())

        # Export the live store and compare keys, values and sequences.
        code = main(["export", "--servers", eps, "--output", str(tmp_path / "export")])
        assert code == 0, capsys.readouterr().err
        assert "exported 2000 keys at sequence" in capsys.readouterr().out
        live = {e.key: (e.value, e.sequence) for e in c.entries()}
        status = c.status()

    df, meta = read_export(spark, str(tmp_path / "export"))
    assert meta.rows == 2000 and meta.sequence == status.sequence
    assert meta.server == endpoint(primary)
    exported = {r["key"]: (bytes(r["value"]), r["sequence"]) for r in df.collect()}
    assert exported == live
    ttls = {r["key"]: r["ttl"] for r in df.select("key", "ttl").collect()}
    assert ttls == {k: t for k, (_, t) in good.items()}


def test_load_survives_a_failover(
    spark: Any,
    servers: Servers,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    primary, backup = servers.pair()
    eps = f"{endpoint(primary)},{endpoint(backup)}"
    # Enough rows that the kill (after 500 are stored) comes mid-load: the
    # write-only writers start at once, and 3,000 rows could be done first.
    good = _table(tmp_path / "t.parquet", ROWS_FO, "/fo/", bad=False)

    stored_at_kill: list[int] = []

    def kill_primary_mid_load() -> None:
        # The watcher is also the pair's voter: the load's write-only writers
        # never ask for a snapshot, so they cast no Binary Star vote
        # (docs/client.md), and the backup takes over at the watcher's
        # request after its failover.  It stays open until then: closed right
        # after the kill, on a loaded machine it was gone before it had
        # asked, nobody voted, and the writers gave up after 10 s without a
        # heartbeat (9,504 of 10,000 rows).
        with _client(primary, backup) as watcher:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and len(watcher.entries("/fo/")) < 500:
                time.sleep(0.02)
            primary.kill9()
            stored_at_kill.append(len(watcher.entries("/fo/")))
            wait_role(backup, "active")

    killer = threading.Thread(target=kill_primary_mid_load, daemon=True)
    killer.start()
    code = main(
        ["load", "--servers", eps, "--input", str(tmp_path / "t.parquet"), "--ttl-col", "ttl",
         "--heartbeat", str(HB), "--max-in-flight", "16", "--confirm-timeout", "10"]
    )  # fmt: skip
    killer.join(60)
    out, err = capsys.readouterr()
    assert stored_at_kill and stored_at_kill[0] < ROWS_FO, "the primary was killed too late"
    assert code == 0, out + err
    assert f"rows written:  {ROWS_FO}" in out
    backup.wait_log("now ACTIVE")
    with _client(backup) as c:
        assert {e.key: e.value for e in c.entries("/fo/")} == {k: v for k, (v, _) in good.items()}
