"""The data directory's size in ``clone status`` and ``/metrics``."""

from __future__ import annotations

import pytest

from clone import Clone
from clone.client.status import query_status, status_table
from clone.storage.files import dir_bytes
from tests.server.test_http_e2e import metrics
from tests.support.ports import free_port
from tests.support.servers import Servers
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def test_status_and_metrics_show_the_data_dir_size(servers: Servers) -> None:
    http = free_port()
    server = servers.standalone("--http-port", str(http))
    endpoint = f"tcp://127.0.0.1:{server.port}"
    with Clone(endpoint) as client:
        client.wait_synced(10)
        for i in range(20):
            client.set(f"/d/{i}", b"x" * 100_000, wait=True, timeout=10)
    on_disk = dir_bytes(servers.data_dir("standalone"))
    assert on_disk > 2_000_000
    (status,) = query_status([endpoint], timeout=5)
    assert status["data_dir_bytes"] > 2_000_000
    assert "DISK" in status_table([status])[0]
    eventually(lambda: metrics(server, http)["clone_data_dir_bytes"] > 2_000_000, 10,
               "clone_data_dir_bytes counts the writes")


def test_in_memory_has_no_data_dir_size(servers: Servers) -> None:
    server = servers.standalone("--in-memory")
    (status,) = query_status([f"tcp://127.0.0.1:{server.port}"], timeout=5)
    assert status["data_dir_bytes"] is None
    line = status_table([status])[1]
    assert " - " in line
