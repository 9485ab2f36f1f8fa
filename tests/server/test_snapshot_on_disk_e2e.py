"""A snapshot ends only once what it showed is on the server's disk.

A chaos run (seed 1, kill-both) had a watcher resync from the freshly
promoted backup and get a counter at sequence 188, which the backup had
applied but not yet committed; the backup was killed a tenth of a second
later, came back at 187 and gave 188 to another write, and the watcher saw
the counter go back from 188 to 175 (clone/server/diskgate.py).

Here the commit is held up at will (another connection takes the
database's write lock, as in tests/server/test_durability_calls_e2e.py)
while a snapshot stream is stalled on a requester that reads nothing; a key
the stream has not reached yet is overwritten meanwhile, so the stream
shows that update, applied and not committed.  Its KTHXBAI must wait for
the commit: it may not arrive while the lock is held, and when it arrives
the commit mark (``DIR/COMMITTED``) covers every sequence the snapshot
carried.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
import zmq

from clone.wire.protocol import ICANHAZ, KTHXBAI
from tests.support.clients import synced_client
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

PREFIX = "/snap/"
KEYS = 4000  # at 2 KB each, far more than the socket buffers hold: the stream stalls
VALUE = b"v" * 2048
WAIT = 30.0  # ceilings only: a loaded machine


def _committed(servers: Servers, server: ServerProcess) -> int:
    """The sequence the server's commit mark says is on disk."""
    mark = (servers.data_dir(server.name) / "COMMITTED").read_text().split()
    return int(mark[1])


def _key(i: int) -> str:
    return f"{PREFIX}{i:05d}"


def test_a_snapshot_ends_only_once_the_updates_it_shows_are_committed(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone()
    with synced_client(server) as client:
        for i in range(KEYS - 1):
            client.set(_key(i), VALUE)
        client.set(_key(KEYS - 1), VALUE, wait=True, timeout=WAIT)
    before = int(read_stats(server)["sequence"])  # type: ignore[call-overload]
    assert _committed(servers, server) == before

    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.RCVHWM, 100)
    req.setsockopt(zmq.RCVBUF, 65536)
    req.connect(f"tcp://127.0.0.1:{server.port}")
    req.send_multipart([ICANHAZ, PREFIX.encode()])
    eventually(lambda: int(read_stats(server)["snapshot_stalls"]) >= 1,  # type: ignore[call-overload]
               WAIT, "the snapshot stream to stall on a requester that reads nothing")

    lock = sqlite3.connect(servers.data_dir(server.name) / "clone.db", isolation_level=None,
                           timeout=10)  # fmt: skip
    try:
        lock.execute("BEGIN IMMEDIATE")  # the server's next commit waits for it
        with synced_client(server) as writer:
            writer.set(_key(KEYS - 1), b"new")  # the last key: not streamed yet
            eventually(lambda: int(read_stats(server)["sequence"]) == before + 1,  # type: ignore[call-overload]
                       WAIT, "the overwrite to be applied")
        assert _committed(servers, server) == before, "the commit was not held up"

        # Read the stream: every entry comes, the overwrite's among them.
        seen: dict[bytes, int] = {}
        ended: list[int] = []

        def read_some() -> bool:
            while req.poll(0):
                frames = req.recv_multipart()
                if frames[0] == KTHXBAI:
                    ended.append(int.from_bytes(frames[1], "big"))
                else:
                    seen[frames[0]] = int.from_bytes(frames[1], "big")
            return bool(ended) or len(seen) == KEYS

        eventually(read_some, WAIT, "the snapshot's entries")
        assert seen.get(_key(KEYS - 1).encode()) == before + 1, "the stream missed the overwrite"
        # Its end is due now: it must wait for the commit, not go.
        eventually(lambda: read_some() and (bool(ended) or int(
            read_stats(server).get("snapshot_ends_held", 0)) >= 1),  # type: ignore[call-overload]
            WAIT, "the snapshot's end to be sent or held")
        assert not ended, (
            f"the snapshot ended (KTHXBAI at {ended[0]}) while the update at sequence"
            f" {before + 1} it showed was not on disk (committed: {_committed(servers, server)})"
        )
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()

    eventually(lambda: read_some() and bool(ended), WAIT, "the snapshot's end after the commit")
    assert _committed(servers, server) >= max(seen.values()), (
        "the snapshot ended before the updates it showed were committed"
    )
    assert ended[0] >= before
    req.close(linger=0)
