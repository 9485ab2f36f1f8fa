"""``clone backup`` and ``clone-server --restore`` against real server processes.

The snapshots compared here are taken with a raw DEALER (no KVBATCH, frames as
they arrive), so "byte for byte" means the frames a Guide client would see;
entry order is not part of CHP, so both sides are sorted.  The writes-flowing
test records the publisher's KVPUBs from before the first write, which gives
the server's exact state at any sequence to compare the backup with.
"""

from __future__ import annotations

import sqlite3
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import zmq

from clone.storage import DATA_FILE, check_state_file
from clone.storage.schema import KV_COLUMNS
from tests.support.chp_peer import ChpPeer
from tests.support.servers import ROOT, ServerProcess, Servers
from tests.support.waiting import eventually

_SEQ = struct.Struct(">Q")
_END = b"/zz/end"  # the writer's last key: all its KVPUBs are read once this one is
Frames = tuple[bytes, bytes, bytes, bytes, bytes]



def _endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def _backup(
    file: Path, *servers: ServerProcess, extra: tuple[str, ...] = (), timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """``clone --heartbeat 0.1 --servers ... backup FILE``, as a user runs it."""
    servers_arg = ",".join(_endpoint(s) for s in servers) or "tcp://127.0.0.1:1"
    return subprocess.run(
        [sys.executable, "-m", "clone.client.cli", "-v", "--heartbeat", "0.1",
         "--servers", servers_arg, "backup", str(file), *extra],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )  # fmt: skip


def _raw_snapshot(
    ctx: zmq.Context[zmq.Socket[bytes]], server: ServerProcess, timeout: float = 20.0
) -> tuple[list[Frames], int]:
    """Every KVSYNC as raw frames, sorted, and KTHXBAI's sequence."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(_endpoint(server))
        dealer.send_multipart([b"ICANHAZ?", b""])
        entries: list[Frames] = []
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0 and dealer.poll(int(remaining * 1000)), "no KTHXBAI in time"
            frames = dealer.recv_multipart()
            assert len(frames) == 5, frames
            if frames[0] == b"KTHXBAI":
                return sorted(entries), _SEQ.unpack(frames[1])[0]
            entries.append((frames[0], frames[1], frames[2], frames[3], frames[4]))
    finally:
        dealer.close(linger=0)


@pytest.fixture
def peer(ctx: zmq.Context[zmq.Socket[bytes]]) -> Iterator[ChpPeer]:
    p = ChpPeer(ctx)
    yield p
    p.close()


def _write_sample(peer: ChpPeer, server: ServerProcess) -> None:
    """Plain keys, ephemeral keys (one already expired), deletes, a binary value."""
    peer.connect(server.port, collectors=[server.port])
    peer.wait_hugz()
    n = 0
    for i in range(200):
        peer.kvset(f"/plain/{i}".encode(), f"value {i}".encode())
        n += 1
    for i in range(20):
        peer.kvset(f"/ttl/{i}".encode(), b"lives an hour", props={"ttl": "3600"})
        n += 1
    peer.kvset(b"/ttl/short", b"gone soon", props={"ttl": "0.2"})
    peer.kvset(b"/binary", bytes(range(256)), props={"x-app": "kept as sent"})
    n += 2
    for i in range(0, 200, 7):
        peer.kvset(f"/plain/{i}".encode(), b"")  # delete
        n += 1
    peer.updates(n, timeout=10)
    # The short-lived key expires: its delete is published with a sequence too.
    peer.wait_for(lambda m: m.key == b"/ttl/short" and not m.body, timeout=5)


def _summary_ok(result: subprocess.CompletedProcess[str], file: Path) -> tuple[int, int]:
    assert result.returncode == 0, result.stderr
    words = result.stdout.split()
    # "wrote N keys at sequence S to FILE in X s"
    assert words[0] == "wrote" and words[2:5] == ["keys", "at", "sequence"], result.stdout
    assert words[6:8] == ["to", str(file)] and words[-1] == "s", result.stdout
    assert result.stdout.count("\n") == 1
    return int(words[1]), int(words[5])


def test_backup_then_restore_serves_the_same_frames_and_sequence(
    servers: Servers, peer: ChpPeer, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    original = servers.standalone(name="original")
    _write_sample(peer, original)
    want, want_seq = _raw_snapshot(ctx, original)
    file = tmp_path / "state.backup"

    keys, sequence = _summary_ok(_backup(file, original), file)

    assert (keys, sequence) == (len(want), want_seq)
    assert check_state_file(file) == (len(want), want_seq, 0)
    assert any(b"expires=" in e[3] for e in want) and any(e[0] == b"/binary" for e in want)
    restored = servers.standalone("--restore", str(file), name="restored")
    assert _raw_snapshot(ctx, restored) == (want, want_seq)


def test_backup_of_a_pair_fails_over_from_the_passive_server(
    servers: Servers, peer: ChpPeer, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    primary, backup = servers.pair()
    _write_sample(peer, primary)
    want = _raw_snapshot(ctx, primary)
    file = tmp_path / "pair.backup"

    # The passive server first: it never answers a snapshot request while the
    # primary is alive, so the backup must move on to the primary.
    result = _backup(file, backup, primary)

    _summary_ok(result, file)
    restored = servers.standalone("--restore", str(file), name="restored")
    assert _raw_snapshot(ctx, restored) == want


def test_backup_with_no_server_exits_2_and_says_so(tmp_path: Path) -> None:
    file = tmp_path / "none.backup"
    started = time.monotonic()
    result = _backup(file, extra=("--timeout", "1"))
    assert result.returncode == 2, result
    assert "tcp://127.0.0.1:1" in result.stderr and "--timeout" in result.stderr
    assert time.monotonic() - started < 10
    assert not file.exists() and list(tmp_path.iterdir()) == []


def test_backup_to_an_unwritable_place_exits_4_before_copying(
    servers: Servers, tmp_path: Path
) -> None:
    server = servers.standalone()
    file = tmp_path / "missing-dir" / "x.backup"
    result = _backup(file, server)
    assert result.returncode == 4, result
    assert str(file) in result.stderr and "does not exist" in result.stderr
    result = _backup(tmp_path, server)  # a directory
    assert result.returncode == 4 and "directory" in result.stderr, result


def _db_bytes(data_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir()) if p.name != "LOCK"}


def test_restore_of_a_garbage_file_fails_naming_it_and_leaves_the_data_dir_alone(
    servers: Servers, peer: ChpPeer, tmp_path: Path
) -> None:
    server = servers.standalone(name="victim")
    _write_sample(peer, server)
    assert server.terminate() == 0
    data_dir = servers.data_dir("victim")
    before = _db_bytes(data_dir)
    garbage = tmp_path / "garbage.backup"
    garbage.write_bytes(b"this is not a database\n" * 100)

    result = subprocess.run(
        [sys.executable, "-m", "clone.server.cli", "--standalone", "--bind", "127.0.0.1",
         "--port", str(server.port), "--data-dir", str(data_dir), "--restore", str(garbage)],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )  # fmt: skip

    assert result.returncode != 0
    assert str(garbage) in result.stderr, result.stderr
    assert _db_bytes(data_dir) == before
    assert not list(data_dir.glob("replaced-*"))


def test_restore_over_a_state_moves_the_old_one_aside(
    servers: Servers, peer: ChpPeer, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    source = servers.standalone(name="source")
    _write_sample(peer, source)
    want = _raw_snapshot(ctx, source)
    file = tmp_path / "source.backup"
    _summary_ok(_backup(file, source), file)

    # Another server with a state of its own, then restarted from the backup.
    other = servers.standalone(name="other")
    with closing(ChpPeer(ctx)) as writer:
        writer.connect(other.port, collectors=[other.port])
        writer.wait_hugz()
        writer.kvset(b"/other/only", b"mine")
        writer.updates(1)
    assert other.terminate() == 0
    data_dir = servers.data_dir("other")
    old_state = sqlite3.connect(data_dir / DATA_FILE)
    old_keys = old_state.execute("SELECT key FROM kv").fetchall()
    old_state.close()
    restored = servers.standalone("--restore", str(file), name="other")

    assert _raw_snapshot(ctx, restored) == want
    aside = list(data_dir.glob("replaced-*.db"))
    assert len(aside) == 1, list(data_dir.iterdir())
    kept = sqlite3.connect(f"file:{aside[0]}?mode=ro", uri=True)
    try:
        assert kept.execute("SELECT key FROM kv").fetchall() == old_keys == [(b"/other/only",)]
    finally:
        kept.close()


def _read_state_file(file: Path) -> dict[bytes, tuple[bytes, bytes, bytes, bytes]]:
    conn = sqlite3.connect(f"file:{file}?mode=ro", uri=True)
    try:
        rows = conn.execute(f"SELECT {KV_COLUMNS} FROM kv").fetchall()
    finally:
        conn.close()
    return {bytes(k): (bytes(s), bytes(u), bytes(p), bytes(b)) for k, s, u, p, b in rows}


def test_backup_while_writes_flow_is_the_state_at_its_sequence(
    servers: Servers, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path
) -> None:
    """A big state (so the snapshot streams over many reactor turns) and one
    writer overwriting and deleting keys of it all the while.  The recorder's
    KVPUBs give the exact state at the backup's sequence."""
    server = servers.standalone()
    recorder = ChpPeer(ctx)
    writer = ChpPeer(ctx)
    try:
        recorder.connect(server.port)
        recorder.wait_hugz()
        writer.connect(server.port, collectors=[server.port])
        keys = 30_000
        for i in range(keys):
            writer.kvset(f"/big/{i:06d}".encode(), b"initial %d" % i)
        published: list[tuple[int, bytes, tuple[bytes, bytes, bytes, bytes]]] = []

        def record(count: int | None) -> None:
            """``count`` KVPUBs, or (None) all of them up to the end marker's."""
            if count is not None:
                msgs = recorder.updates(count, timeout=60)
            else:
                msgs = []
                deadline = time.monotonic() + 60  # bounds a hang only
                while not msgs or msgs[-1].key != _END:
                    assert time.monotonic() < deadline, "the end marker was not published"
                    m = recorder.recv(0.1)
                    if m is not None and not m.is_hugz:
                        msgs.append(m)
            for m in msgs:
                published.append(
                    (m.sequence, m.key, (_SEQ.pack(m.sequence), m.uuid, _props(m.props), m.body))
                )

        record(keys)
        stop = threading.Event()
        written = [0]

        def write() -> None:
            i = 0
            while not stop.is_set():
                key = f"/big/{(i * 7919) % keys:06d}".encode()
                # Every third write deletes: the deletes a fuzzy snapshot hides.
                writer.kvset(key, b"" if i % 3 == 0 else b"write %d" % i)
                i += 1
                written[0] = i
                if i % 50 == 0:
                    time.sleep(0.005)  # a pace, not a wait: the backup gets turns too

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        try:
            eventually(lambda: written[0] >= 200, 60, "writes flowing before the backup")
            file = tmp_path / "flowing.backup"
            result = _backup(file, server)
            after = written[0]
            eventually(lambda: written[0] >= after + 200, 60, "writes flowing after it")
        finally:
            stop.set()
            thread.join(10)
        writer.kvset(_END, b"end")  # the last KVPUB record(None) reads
        _, sequence = _summary_ok(result, file)
        # The copy replayed updates after its snapshot (what this test is about).
        snapshot_end = int(result.stderr.split(" ends at ")[1].split()[0])
        assert sequence > snapshot_end, result.stderr
        record(None)
        assert [p[0] for p in published] == list(range(1, len(published) + 1))
        assert published[-1][0] > sequence > keys, (sequence, published[-1][0])

        expected: dict[bytes, tuple[bytes, bytes, bytes, bytes]] = {}
        for seq, key, entry in published:
            if seq > sequence:
                break
            if entry[3]:
                expected[key] = entry
            else:
                expected.pop(key, None)
        got = _read_state_file(file)
        assert check_state_file(file)[1] == sequence
        assert got.keys() == expected.keys()
        assert got == expected
    finally:
        recorder.close()
        writer.close()


def _props(props: dict[str, str]) -> bytes:
    return b"".join(f"{k}={v}\n".encode() for k, v in props.items())
