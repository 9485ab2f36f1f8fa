"""BulkWriter: pipelined set calls from the caller's thread, against real servers."""

from __future__ import annotations

import time

import pytest

from clone import Clone
from clone.client.writeonly import BulkWriter
from clone.errors import NotSynced
from tests.support.ports import free_base_port
from tests.support.servers import Servers
from tests.support.waiting import eventually


def test_nobody_listening_is_told_within_a_second_or_two() -> None:
    """Every port refuses: the pair is down, said long before the sync timeout."""
    writer = BulkWriter([f"tcp://127.0.0.1:{free_base_port()}",
                         f"tcp://127.0.0.1:{free_base_port()}"], server_timeout=0.5)  # fmt: skip
    started = time.monotonic()
    try:
        with pytest.raises(NotSynced, match="accepts connections"):
            writer.wait_synced(60)
    finally:
        writer.close()
    assert time.monotonic() - started < 30  # ~0.6 s idle; a generous ceiling


@pytest.mark.slow
def test_a_window_of_writes_is_confirmed_and_stored(servers: Servers) -> None:
    solo = servers.standalone()
    endpoint = f"tcp://127.0.0.1:{solo.port}"
    rows = {f"/bulk/k{i:05d}": f"v{i}".encode() for i in range(3000)}
    writer = BulkWriter([endpoint])
    sequences: dict[bytes, int | BaseException] = {}
    try:
        writer.wait_synced(30)
        sent: dict[bytes, str] = {}
        for key, value in rows.items():
            while writer.outstanding >= 128:
                sequences.update(writer.poll(1.0))
            sent[writer.submit(key, value, ttl=3600.0 if key.endswith("7") else 0.0)] = key
        deadline = time.monotonic() + 120
        while writer.outstanding and time.monotonic() < deadline:
            sequences.update(writer.poll(1.0))
    finally:
        writer.close()
    assert writer.outstanding == 0
    assert set(sequences) == set(sent)
    assert all(isinstance(seq, int) for seq in sequences.values())
    assert len(set(sequences.values())) == len(rows)  # one sequence per write
    with Clone([endpoint]) as reader:
        reader.wait_synced(30)
        eventually(lambda: len(reader.items("/bulk/")) == len(rows), 60, "every row read back")
        items = dict(reader.items("/bulk/"))
        assert {k: bytes(v) for k, v in items.items()} == rows
        entry = reader.entry("/bulk/k00007")
        assert entry is not None and entry.prop("ttl") == "3600.0"
