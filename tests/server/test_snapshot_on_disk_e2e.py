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
carried.  And if the server is killed instead, the restarted one serves the
state without that update: a requester that had taken it would have seen the
pair go back.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
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


class _Held:
    """A snapshot stream that showed an update whose commit is held up."""

    def __init__(self, servers: Servers, server: ServerProcess, req: zmq.Socket[Any],
                 lock: sqlite3.Connection, before: int) -> None:  # fmt: skip
        self.servers, self.server, self.req, self.lock, self.before = (
            servers, server, req, lock, before)  # fmt: skip
        self.seen: dict[bytes, int] = {}
        self.ended: list[int] = []

    def read_some(self) -> bool:
        """Take what arrived; true once the end came or every entry did."""
        while self.req.poll(0):
            frames = self.req.recv_multipart()
            if frames[0] == KTHXBAI:
                self.ended.append(int.from_bytes(frames[1], "big"))
            else:
                self.seen[frames[0]] = int.from_bytes(frames[1], "big")
        return bool(self.ended) or len(self.seen) == KEYS

    def release(self) -> None:
        if self.lock.in_transaction:
            self.lock.execute("ROLLBACK")


def _held_snapshot(servers: Servers, ctx: zmq.Context[Any], then: Callable[[_Held], None]) -> None:
    """Stall a snapshot of ``KEYS`` keys, hold the commits, overwrite the last
    key, read the stream to its end (which must wait), then ``then(held)``."""
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
    held = _Held(servers, server, req, lock, before)
    try:
        lock.execute("BEGIN IMMEDIATE")  # the server's next commit waits for it
        with synced_client(server) as writer:
            writer.set(_key(KEYS - 1), b"new")  # the last key: not streamed yet
            eventually(lambda: int(read_stats(server)["sequence"]) == before + 1,  # type: ignore[call-overload]
                       WAIT, "the overwrite to be applied")
        assert _committed(servers, server) == before, "the commit was not held up"
        # Every entry comes, the overwrite's among them: applied, not committed.
        eventually(held.read_some, WAIT, "the snapshot's entries")
        assert held.seen.get(_key(KEYS - 1).encode()) == before + 1, "the stream missed it"
        # Its end is due now: it must wait for the commit, not go.
        eventually(lambda: held.read_some() and (bool(held.ended) or int(
            read_stats(server).get("snapshot_ends_held", 0)) >= 1),  # type: ignore[call-overload]
            WAIT, "the snapshot's end to be sent or held")
        assert not held.ended, (
            f"the snapshot ended (KTHXBAI at {held.ended[0]}) while the update at sequence"
            f" {before + 1} it showed was not on disk (committed: {_committed(servers, server)})"
        )
        then(held)
    finally:
        held.release()
        lock.close()
        req.close(linger=0)


def test_a_snapshot_ends_only_once_the_updates_it_shows_are_committed(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    def commit_lands(held: _Held) -> None:
        held.release()
        eventually(lambda: held.read_some() and bool(held.ended), WAIT,
                   "the snapshot's end after the commit")  # fmt: skip
        assert _committed(held.servers, held.server) >= max(held.seen.values()), (
            "the snapshot ended before the updates it showed were committed")  # fmt: skip
        assert held.ended[0] >= held.before

    _held_snapshot(servers, ctx, commit_lands)


def test_a_snapshot_cut_by_a_crash_never_ended_so_nobody_took_the_lost_update(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    def crash(held: _Held) -> None:
        held.server.kill9()
        held.release()
        assert not held.read_some() or not held.ended
        held.server.start()
        held.server.wait_serving()
        # The update the stream showed is gone: the requester, which never got
        # the end, holds nothing of it; the restarted server serves the state
        # before it (and will give its sequence to another write).
        assert int(read_stats(held.server)["sequence"]) == held.before  # type: ignore[call-overload]
        with synced_client(held.server) as reader:
            assert reader.get(_key(KEYS - 1)) == VALUE

    _held_snapshot(servers, ctx, crash)
