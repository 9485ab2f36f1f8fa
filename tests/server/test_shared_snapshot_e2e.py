"""Many requesters at once, as after a failover, against a real ``clone-server``:
each gets the whole, correct snapshot, byte for byte what the others of its
view get, encoded once (clone.server.sharedsnap); a write between requests
starts a new one; under CURVE, requesters of different views never share."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import zmq

from clone.wire.batch import decode_kvbatch
from clone.wire.codec import KVMsg, encode_kv, new_uuid
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size
from clone.wire.protocol import (
    BATCH_METADATA,
    COLLECTOR_OFFSET,
    KTHXBAI,
    KVBATCH,
    PUBLISHER_OFFSET,
)
from tests.support.bulk import fill_store
from tests.support.curve import CurveKeys, curve_socket, wait_serving_curve
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

KEYS = 20_000  # about 3 MB: five KVBATCHes, so readers overlap
PREFIX = "/fleet/"

Snapshot = tuple[int, dict[bytes, tuple[int, bytes]]]  # KTHXBAI's sequence, key -> (seq, value)


def _accepted(server: ServerProcess) -> int:
    conns = psutil.Process(server.pid).net_connections(kind="tcp")
    return sum(1 for c in conns if c.status == psutil.CONN_ESTABLISHED
               and c.laddr.port == server.port)  # fmt: skip


def _dealers(ctx: zmq.Context[Any], server: ServerProcess, n: int,
             make: Any = None) -> list[zmq.Socket[Any]]:  # fmt: skip
    out = []
    for _ in range(n):
        d = make() if make is not None else ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)
        cap_message_size(d, MAX_SYNC_FRAME_BYTES)
        d.setsockopt(zmq.METADATA, BATCH_METADATA)
        d.connect(f"tcp://127.0.0.1:{server.port}")
        out.append(d)
    return out


def _read_all(dealers: list[zmq.Socket[Any]], timeout: float = 120) -> list[Snapshot]:
    """Each dealer's snapshot, read all together until every KTHXBAI."""
    got: dict[zmq.Socket[Any], dict[bytes, tuple[int, bytes]]] = {d: {} for d in dealers}
    ends: dict[zmq.Socket[Any], int] = {}
    poller = zmq.Poller()
    for d in dealers:
        poller.register(d, zmq.POLLIN)
    deadline = time.monotonic() + timeout  # bounds a hang only
    while len(ends) < len(dealers):
        assert time.monotonic() < deadline, f"{len(ends)} of {len(dealers)} snapshots complete"
        for sock, _ in poller.poll(200):
            while sock.poll(0):
                frames = sock.recv_multipart()
                if frames[0] == KTHXBAI:
                    ends[sock] = int.from_bytes(frames[1], "big")
                else:
                    assert frames[0] == KVBATCH, frames[0]
                    batch = decode_kvbatch(frames)
                    entries = got[sock]
                    for key, seq, body in zip(batch.raw_keys, batch.sequences, batch.bodies,
                                              strict=True):  # fmt: skip
                        assert key not in entries, f"{key!r} twice in one snapshot"
                        entries[key] = (seq, body)
    return [(ends[d], got[d]) for d in dealers]


def _ask(dealers: list[zmq.Socket[Any]], subtree: bytes) -> None:
    for d in dealers:
        d.send_multipart([b"ICANHAZ?", subtree])


def test_a_storm_of_requesters_gets_one_encoding_and_identical_correct_snapshots(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone("--in-memory", "--max-snapshots", "256")
    fill_store(server.port, KEYS, PREFIX)
    first = _dealers(ctx, server, 100)
    later = _dealers(ctx, server, 20)
    try:
        eventually(lambda: _accepted(server) >= 120, 60, "120 connections accepted")
        before = read_stats(server)
        _ask(first, PREFIX.encode())
        snapshots = _read_all(first)
        sequence, entries = snapshots[0]
        assert all(s == snapshots[0] for s in snapshots), "the requesters' snapshots differ"
        assert len(entries) == KEYS + 1  # and the load's sentinel
        assert {v for k, (_, v) in entries.items() if not k.endswith(b"~done")} == {b"v" * 100}
        assert sequence == max(seq for seq, _ in entries.values())
        stats = read_stats(server)
        encoded = int(str(stats["snapshot_encodings_shared"])) - int(
            str(before["snapshot_encodings_shared"]))
        joined = int(str(stats["snapshots_shared"])) - int(str(before["snapshots_shared"]))
        assert encoded + joined == 100, stats
        # All asked at once: a few encodings, not one each.  (Not always one: a
        # stream whose bytes all fit in the kernel's socket buffers can end,
        # and free its encoding, before the server has read the next request.)
        assert encoded <= 20, stats
        # A write: the next requesters get a new encoding, with it.
        fill_store(server.port, 1, "/fleet/new/")
        _ask(later, PREFIX.encode())
        newer = _read_all(later)
        assert all(s == newer[0] for s in newer)
        assert newer[0][0] > sequence and len(newer[0][1]) == KEYS + 3  # the key, its sentinel
        assert int(str(read_stats(server)["snapshot_encodings_shared"])) > int(
            str(stats["snapshot_encodings_shared"]))
    finally:
        for d in first + later:
            d.close(linger=0)


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    keys = CurveKeys.make(tmp_path / "sec", admitted=("admin", "reader"), strangers=())
    keys.write_acl({"admin": ([""], [""]), "reader": (["/fleet/node-00000"], [])})
    return keys


def test_under_curve_requesters_of_different_views_never_share(
    servers: Servers, ctx: zmq.Context[Any], keys: CurveKeys
) -> None:
    server = servers.standalone(*keys.server_args(), "--in-memory", "--max-snapshots", "256",
                                wait=False)  # fmt: skip
    wait_serving_curve(server, keys)
    _curve_fill(ctx, keys, server, 2000)
    admins = _dealers(ctx, server, 30, lambda: curve_socket(ctx, zmq.DEALER, keys, "admin"))
    readers = _dealers(ctx, server, 30, lambda: curve_socket(ctx, zmq.DEALER, keys, "reader"))
    try:
        eventually(lambda: _accepted(server) >= 60, 60, "60 connections accepted")
        mixed = [d for pair in zip(admins, readers, strict=True) for d in pair]
        _ask(mixed, b"")
        snapshots = dict(zip(mixed, _read_all(mixed), strict=True))
        everything = snapshots[admins[0]][1]
        assert len(everything) == 2000
        assert all(snapshots[d][1] == everything for d in admins)
        allowed = {k: v for k, v in everything.items() if k.startswith(b"/fleet/node-00000")}
        assert 0 < len(allowed) < 2000
        assert all(snapshots[d][1] == allowed for d in readers), "a reader saw another view"
        stats = read_stats(server)
        assert int(str(stats["snapshot_encodings_shared"])) >= 2  # one per view at least
        assert int(str(stats["snapshots_shared"])) >= 1
    finally:
        for d in admins + readers:
            d.close(linger=0)


def _curve_fill(ctx: zmq.Context[Any], keys: CurveKeys, server: ServerProcess, n: int) -> None:
    """Write ``n`` keys and a sentinel as the admin through the collector (as
    tests.support.bulk does in clear text), until the sentinel is published."""
    pub = curve_socket(ctx, zmq.PUB, keys, "admin")
    done = curve_socket(ctx, zmq.SUB, keys, "admin")
    try:
        pub.setsockopt(zmq.SNDHWM, 0)
        done.setsockopt(zmq.SUBSCRIBE, b"/fleet/~done")
        pub.connect(f"tcp://127.0.0.1:{server.port + COLLECTOR_OFFSET}")
        done.connect(f"tcp://127.0.0.1:{server.port + PUBLISHER_OFFSET}")
        deadline = time.monotonic() + 60

        def sentinel(body: bytes) -> list[bytes]:
            return encode_kv(KVMsg("/fleet/~done", 0, new_uuid(), (), body))

        # A PUB drops what it sends before its connection is up.
        while not done.poll(100):
            pub.send_multipart(sentinel(b"x"))
            assert time.monotonic() < deadline, "the server never published the sentinel"
        while done.poll(0):
            done.recv_multipart()
        for i in range(n - 1):
            pub.send_multipart(encode_kv(KVMsg(f"{PREFIX}node-{i:07d}/cpu", 0, new_uuid(), (),
                                               b"v")))  # fmt: skip
        pub.send_multipart(sentinel(b"y"))
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"{n} keys not applied in time"
            if done.poll(int(left * 1000)) and done.recv_multipart()[-1] == b"y":
                return
    finally:
        pub.close(linger=0)
        done.close(linger=0)
