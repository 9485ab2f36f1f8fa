"""A pair that dies mid-load is reported within seconds, and ``load --resume``
writes only the rows the manifest does not record as confirmed."""

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
from tests.support.servers import ServerProcess, Servers
from tests.support.waiting import eventually

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(600)]

HB = 0.1
ROWS = 20_000


def _endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def test_pair_dies_mid_load_then_resume_writes_only_the_rest(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    primary, backup = servers.pair()
    eps = f"{_endpoint(primary)},{_endpoint(backup)}"
    rows = {f"/resume/k{i:06d}": f"value {i}".encode() for i in range(ROWS)}
    pq.write_table(
        pa.table({"key": list(rows), "value": pa.array(list(rows.values()), pa.binary())}),
        tmp_path / "t.parquet",
    )
    manifest = tmp_path / "manifest.json"
    killed_at: list[float] = []

    def kill_pair_mid_load() -> None:
        with Clone([_endpoint(primary)], heartbeat=HB, server_timeout=1.0) as watcher:
            watcher.wait_synced(30)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and watcher.status().keys < 2_000:
                time.sleep(0.05)
        primary.kill9()
        backup.kill9()
        killed_at.append(time.monotonic())

    killer = threading.Thread(target=kill_pair_mid_load, daemon=True)
    killer.start()
    argv = ["load", "--servers", eps, "--input", str(tmp_path / "t.parquet"),
            "--heartbeat", str(HB), "--max-in-flight", "16", "-q"]  # fmt: skip
    code = main([*argv, "--manifest", str(manifest)])
    reported_at = time.monotonic()
    killer.join(30)
    out, err = capsys.readouterr()
    assert killed_at, "the pair was not killed"
    assert code == 2, out + err
    assert "rows could not be stored" in err
    assert f"load --resume {manifest}" in err
    # dead_after is 10 s; the rest is Spark ending the stage.
    assert reported_at - killed_at[0] < 20, reported_at - killed_at[0]

    data = json.loads(manifest.read_text())
    assert data["complete"] is False and data["confirmed_through"]

    primary.start()
    backup.start()
    primary.wait_serving(30)
    with Clone([_endpoint(primary)], heartbeat=HB, server_timeout=1.0) as c:
        c.wait_synced(30)
        stored_before = len(c.items("/resume/"))
    assert 0 < stored_before < ROWS
    code = main([*argv, "--resume", str(manifest)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    skipped = int(out.split("rows skipped:")[1].split()[0])
    written = int(out.split("rows written:")[1].split()[0])
    assert skipped > 0 and written + skipped == ROWS, out
    # Only rows confirmed (so stored, durably) were skipped.
    assert skipped <= stored_before
    assert json.loads(manifest.read_text())["complete"] is True

    with Clone([_endpoint(primary), _endpoint(backup)], heartbeat=HB, server_timeout=1.0) as c:
        c.wait_synced(30)
        eventually(lambda: c.status().keys >= ROWS, timeout=60)
        assert dict(c.items("/resume/")) == rows
