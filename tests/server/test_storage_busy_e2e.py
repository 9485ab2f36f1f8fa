"""A database lock held elsewhere delays a server's commits; it never stops the server.

The WAL checkpointer's TRUNCATE holds the database's writer lock while it
copies, syncs and waits for readers; on a slow disk that once outlasted the
reactor's 2 s busy timeout, the commit failed with SQLITE_BUSY and the server
fail-stopped.  Here another connection holds the lock for as long as
the test decides -- past that 2 s, until the server has logged that it waits --
so the contention is deterministic.  The write then lands, is confirmed, and
the server has counted no storage error.
"""

from __future__ import annotations

import sqlite3
import threading

import pytest

from clone.storage import DATA_FILE
from tests.support.clients import synced_client
from tests.support.servers import Servers, read_stats

pytestmark = pytest.mark.slow


def test_a_write_waits_for_a_held_database_lock_and_the_server_stays_up(
    servers: Servers,
) -> None:
    server = servers.standalone()
    path = servers.data_dir("standalone") / DATA_FILE
    with synced_client(server) as client:
        client.set("/busy/before", b"1", wait=True, timeout=30)
        holder = sqlite3.connect(path, isolation_level=None, timeout=30.0)
        confirmed: list[object] = []
        writer = threading.Thread(
            target=lambda: confirmed.append(client.set("/busy/during", b"2", wait=True,
                                                       timeout=60)))
        try:
            holder.execute("BEGIN IMMEDIATE")
            offset = server.log_size()
            writer.start()
            # The reactor's first wait (its 2 s busy timeout) ran out, and it waits on.
            server.wait_log("waits for the database lock", timeout=60, after=offset)
            assert server.alive
            assert not confirmed  # nothing confirmed before it is on disk
        finally:
            if holder.in_transaction:
                holder.execute("ROLLBACK")
            holder.close()
        writer.join(90)
        assert confirmed and isinstance(confirmed[0], int), confirmed
        assert client.get("/busy/during") == b"2"
    assert server.alive
    stats = read_stats(server)
    assert stats["storage_errors"] == 0
    assert int(str(stats["commit_busy_waits"])) >= 1
