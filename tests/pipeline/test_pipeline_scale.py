"""A large store (200k keys): export and ``clone dump`` succeed with their
defaults, and a write-only writer starts at once, without copying the store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from clone.client.cli import main as clone_main
from clone.client.writeonly import WriteOnlyClone
from clone.pipeline.cli import main
from tests.support.bulk import fill_store
from tests.support.servers import Servers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEYS = 200_000


@pytest.mark.spark
def test_large_store_export_dump_and_a_writer_that_does_not_copy_it(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    solo = servers.standalone()
    fill_store(solo.port, KEYS)
    endpoint = f"tcp://127.0.0.1:{solo.port}"

    # A writer that keeps no replica: its first write is confirmed at once,
    # and the server served no snapshot for it.
    before = solo.log_text().count("snapshot for ")
    started = time.monotonic()
    writer = WriteOnlyClone([endpoint], server_timeout=2.0)
    try:
        writer.wait_synced(30)
        assert writer.set_async("/fleet/new", b"1").result(30) > KEYS
        first_write_s = time.monotonic() - started
    finally:
        writer.close()
    assert solo.log_text().count("snapshot for ") == before
    assert first_write_s < 10, first_write_s  # ~0.1 s idle; generous for a busy machine

    # export with its default --timeout.
    code = main(["export", "--servers", endpoint, "--output", str(tmp_path / "export"), "-q"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"exported {KEYS + 2} keys at sequence" in out  # + the sentinel and /fleet/new

    # clone dump with its defaults.
    code = clone_main(["--servers", endpoint, "dump", "/fleet/node-"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == KEYS
    assert lines[0] == "/fleet/node-0000000/cpu=" + "v" * 100
