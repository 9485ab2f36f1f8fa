"""Split-brain conflicts on a real server: kept on disk, listed, applied, discarded.

A standalone ``clone-server`` with a data directory plays the winner; a raw
DEALER plays the stepped-down peer and forwards a split write (no CURVE: the
server cannot tell the peer, so it accepts the peer-only properties) of a key
the winner changed since the fork.  ``clone conflicts`` lists it, a restart
keeps it, and the command applies or discards it.
"""

from __future__ import annotations

import json
import sqlite3
import urllib.request
from pathlib import Path

import pytest
import zmq

from clone import Clone
from clone.client.cli import EXIT_MISSING, EXIT_OK, main
from clone.client.conflicts import query_conflicts
from clone.storage import DATA_FILE
from clone.wire.calls import OP_SET, Reply, decode_reply, encode_call
from clone.wire.codec import new_uuid
from clone.wire.protocol import SNAPSHOT_OFFSET
from clone.wire.split import SplitOrigin, split_properties
from tests.support.ports import free_port
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def _forward(server: ServerProcess, key: str, body: bytes, *, fork: int) -> Reply:
    """Send what a stepped-down peer sends at a heal: a split write."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{server.port + SNAPSHOT_OFFSET}")
        uuid = new_uuid()
        origin = SplitOrigin(term=1, fork=fork, at=1_700_000_000.0)
        sock.send_multipart(encode_call(OP_SET, uuid, key, split_properties(origin), body))
        assert sock.poll(10_000), "no REPLY within 10 s"
        reply = decode_reply(sock.recv_multipart())
        assert reply.uuid == uuid
        return reply
    finally:
        sock.close()
        ctx.term()


def _listing(capsys: pytest.CaptureFixture[str], endpoint: str, *flags: str) -> list[dict]:
    code = main(["--servers", endpoint, "conflicts", "--json", "--timeout", "5", *flags])
    assert code == EXIT_OK
    return json.loads(capsys.readouterr().out)


def test_conflicts_are_kept_across_a_restart_listed_applied_and_discarded(
    servers: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    http_port = free_port()
    winner = servers.standalone("--http-port", str(http_port))
    endpoint = f"tcp://127.0.0.1:{winner.port}"
    with Clone([endpoint]) as client:
        client.wait_synced(10)
        for key in ("/cfg/db/host", "/cfg/db/port"):
            client.set(key, f"winner's {key}", wait=True, timeout=10)
    # Forked at 0: both keys changed on the winner since, so neither write applies.
    for key in ("/cfg/db/host", "/cfg/db/port"):
        reply = _forward(winner, key, f"loser's {key}".encode(), fork=0)
        assert (reply.status, reply.reason) == ("conflict", "split"), reply
    # A key only the loser wrote is applied as before.
    assert _forward(winner, "/cfg/new", b"loser only", fork=0).ok
    listed = _listing(capsys, endpoint)
    assert [(c["id"], c["key"], c["reason"]) for c in listed] == [
        (1, "/cfg/db/host", "winner-wrote"),
        (2, "/cfg/db/port", "winner-wrote"),
    ]
    first = listed[0]
    assert first["loser"]["value"] == "loser's /cfg/db/host"
    assert first["winner"]["value"] == "winner's /cfg/db/host"
    assert first["loser"]["term"] == 1 and first["server"] == endpoint
    assert first["winner"]["uuid"] and first["loser"]["uuid"] and first["resolution"] is None
    stats = read_stats(winner)
    assert stats["split_conflicts"] == 2 and stats["split_conflicts_unresolved"] == 2

    winner.restart()
    winner.wait_serving()
    assert _listing(capsys, endpoint) == listed  # the data directory kept them

    assert main(["--servers", endpoint, "conflicts", "apply", "1"]) == EXIT_OK
    assert "conflict 1 on /cfg/db/host applied" in capsys.readouterr().out
    assert main(["--servers", endpoint, "conflicts", "discard", "2"]) == EXIT_OK
    capsys.readouterr()
    assert main(["--servers", endpoint, "conflicts", "discard", "2"]) == EXIT_MISSING
    capsys.readouterr()
    with Clone([endpoint]) as client:
        client.wait_synced(10)
        eventually(
            lambda: client.get("/cfg/db/host") == b"loser's /cfg/db/host", 10, "applied"
        )
        assert client.get("/cfg/db/port") == b"winner's /cfg/db/port"
        assert client.get("/cfg/new") == b"loser only"
    assert _listing(capsys, endpoint) == []
    resolved = _listing(capsys, endpoint, "--all")
    assert [c["resolution"] for c in resolved] == ["applied", "discarded"]
    winner.restart()
    winner.wait_serving()
    found, silent = query_conflicts([endpoint], 5.0, everything=True)
    assert silent == [] and [c["resolution"] for c in found] == ["applied", "discarded"]
    assert main(["--servers", endpoint, "status", "--json"]) == EXIT_OK
    assert json.loads(capsys.readouterr().out)[0]["conflicts"] == 0
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as page:
        metrics = page.read().decode()
    assert "clone_split_conflicts_unresolved 0.0" in metrics
    assert "clone_split_conflicts_total" in metrics


def _table_ids(db: Path) -> list[int]:
    """The ids in the winner's ``conflicts`` table, read beside the running server."""
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=5.0)
    try:
        return [row[0] for row in conn.execute("SELECT id FROM conflicts ORDER BY id")]
    finally:
        conn.close()


def test_a_busy_database_delays_conflict_rows_and_the_budget_holds_across_a_restart(
    servers: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second connection holds the write lock (as the checkpointer's TRUNCATE
    does under a write flood) while a heal records conflicts: the server keeps
    serving, and the rows land once the lock is gone.  A budget for two
    records of ~2.3 KB keeps the newest two of three, on disk and after a restart."""
    http_port = free_port()
    winner = servers.standalone("--http-port", str(http_port), "--max-conflict-bytes", "6000")
    endpoint = f"tcp://127.0.0.1:{winner.port}"
    keys = [f"/cfg/big/{n}" for n in (1, 2, 3)]
    with Clone([endpoint]) as client:
        client.wait_synced(10)
        for key in keys:
            client.set(key, "w" * 1000, wait=True, timeout=10)
    db = servers.data_dir("standalone") / DATA_FILE
    holder = sqlite3.connect(db, isolation_level=None, timeout=10.0)
    try:
        holder.execute("BEGIN IMMEDIATE")
        for key in keys:
            reply = _forward(winner, key, b"l" * 1000, fork=0)
            assert (reply.status, reply.reason) == ("conflict", "split"), reply

        def deferred() -> int:
            value = read_stats(winner).get("conflict_writes_deferred", 0)
            return value if isinstance(value, int) else 0

        # Twenty tries at 0.1 s housekeeping turns: well past the 2 s after which
        # a write on the reactor's connection fails with "database is locked".
        eventually(lambda: deferred() >= 20, 60, "twenty deferred conflict writes")
        assert winner.alive
        stats = read_stats(winner)
        assert stats["split_conflicts"] == 3
        assert stats["split_conflicts_unresolved"] == 2
        assert stats["split_conflicts_dropped"] == 1
        assert stats["storage_errors"] == 0
        assert [c["id"] for c in _listing(capsys, endpoint)] == [2, 3]  # still serving
        holder.execute("ROLLBACK")
    finally:
        holder.close()
    eventually(lambda: _table_ids(db) == [2, 3], 30, "the conflict rows on disk")
    winner.wait_log("unresolved split-brain conflicts dropped")
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as page:
        metrics = page.read().decode()
    assert "clone_split_conflicts_dropped_total 1.0" in metrics

    winner.restart()
    winner.wait_serving()
    listed = _listing(capsys, endpoint)
    assert [(c["id"], c["key"]) for c in listed] == [(2, keys[1]), (3, keys[2])]
    assert read_stats(winner)["split_conflicts_unresolved"] == 2
