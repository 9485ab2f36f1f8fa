"""The export's raw-CHP snapshot against real servers: exact at one sequence."""

from __future__ import annotations

import threading
import time

import pytest

from clone import Clone
from clone.pipeline import snapshot as snapshot_module
from clone.pipeline.errors import InputError, ServersUnreachable
from clone.pipeline.snapshot import find_active, parse_servers, take_snapshot
from clone.wire.batch import KVBatch
from tests.support.fake_server import FakeServer
from tests.support.ports import free_base_port
from tests.support.servers import ServerProcess, Servers

pytestmark = pytest.mark.slow

HB = 0.1


def endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def test_parse_servers() -> None:
    assert parse_servers("h:1, tcp://g:2,") == ["tcp://h:1", "tcp://g:2"]
    assert parse_servers(["tcp://h:1"]) == ["tcp://h:1"]
    for bad in ("", "h", "h:x", "tcp://:5"):
        with pytest.raises(InputError):
            parse_servers(bad)


def test_nothing_listening_is_unreachable() -> None:
    with pytest.raises(ServersUnreachable, match="no active Clone server"):
        find_active([f"tcp://127.0.0.1:{free_base_port()}"], timeout=0.3)
    with pytest.raises(ServersUnreachable, match="delivered a snapshot"):
        take_snapshot([f"tcp://127.0.0.1:{free_base_port()}"], timeout=0.3)
    with pytest.raises(InputError, match="bad subtree"):
        take_snapshot(["tcp://127.0.0.1:1"], "nope")


def test_snapshot_is_exact_while_writes_go_on(servers: Servers) -> None:
    """A writer sets /w/n for n = 1, 2, ... and then /w/last = n, one confirmed
    write after the other.  A snapshot exact at one sequence holds /w/1 .. /w/m
    and /w/last = m or m - 1 (taken between the two writes), never a hole."""
    primary, backup = servers.pair()
    eps = [endpoint(primary), endpoint(backup)]
    stop = threading.Event()
    written = [0]

    def writer() -> None:
        with Clone(eps, heartbeat=HB, server_timeout=1.0) as c:
            c.wait_synced(10)
            n = 0
            while not stop.is_set():
                n += 1
                c.set(f"/w/{n}", f"v{n}", wait=True, timeout=30)
                c.set("/w/last", str(n), wait=True, timeout=30)
                written[0] = n

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        snaps = []
        deadline = time.monotonic() + 120  # bounds a hang only
        while len(snaps) < 5:
            assert time.monotonic() < deadline and thread.is_alive(), "the writer is stuck"
            if written[0] > 20 * (len(snaps) + 1):
                snaps.append(take_snapshot(eps, "/w/", timeout=30))
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    for snap in snaps:
        assert snap.server == eps[0]
        assert snap.sequence >= snap.snapshot_sequence
        numbered = sorted(int(k[3:]) for k in snap.entries if k != "/w/last")
        m = len(numbered)
        assert numbered == list(range(1, m + 1)), "a hole: not one point in time"
        last = int(snap.entries["/w/last"].body)
        assert last in (m, m - 1)
        assert max(e.sequence for e in snap.entries.values()) <= snap.sequence
    # Quiet now: the snapshot equals what a synced client holds, sequences included.
    with Clone(eps, heartbeat=HB) as c:
        c.wait_synced(10)
        final = take_snapshot(eps, timeout=30)
        held = {e.key: (e.value, e.sequence) for e in c.entries()}
    assert {k: (m.body, m.sequence) for k, m in final.entries.items()} == held


def test_snapshot_from_a_server_that_sends_plain_kvsyncs() -> None:
    """The export asks for KVBATCHes; a Guide-style server ignores the metadata
    and streams KVSYNCs, which the export takes the same way."""
    with FakeServer() as fake:
        for i in range(50):
            fake.publish(f"/g/{i:03d}", f"v{i}".encode())
        fake.publish("/other/x", b"y")  # applied once publish() returns
        snap = take_snapshot([fake.endpoint], "/g/", timeout=30)
        assert fake.batch_requests >= 1
    assert sorted(snap.entries) == [f"/g/{i:03d}" for i in range(50)]
    assert snap.entries["/g/007"].body == b"v7"
    assert snap.sequence >= snap.snapshot_sequence == 51


#: Keys of the large snapshot: MAX_BATCH_ENTRIES (4,096) x 2 and some, three batches.
KEYS = 9_000


def test_a_large_snapshot_arrives_in_kvbatches_whole(
    servers: Servers,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """9,000 keys, with properties: several KVBATCHes from a real server (at
    most 4,096 entries each, so a first, a middle and a last: what five
    batches of 20,000 keys proved, for less than half the CPU), and the result
    equals what a client holds, sequences and properties included."""
    batches: list[int] = []
    real_decode = snapshot_module.decode_kvbatch

    def counting_decode(frames: list[bytes]) -> KVBatch:
        batch = real_decode(frames)
        batches.append(len(batch))
        return batch

    monkeypatch.setattr(snapshot_module, "decode_kvbatch", counting_decode)
    server = servers.standalone()
    eps = [endpoint(server)]
    with Clone(eps, heartbeat=HB) as c:
        c.wait_synced(10)
        futures = [
            # Confirm ceilings for a busy machine: 9,000 writes in flight at once.
            c.set_async(f"/big/{i:05d}", f"value {i}", ttl=3600 if i % 7 == 0 else 0,
                        timeout=120)
            for i in range(KEYS)
        ]
        for f in futures:
            f.result(150)
        snap = take_snapshot(eps, "/big/", timeout=60)
        held = {e.key: (e.value, e.sequence, e.properties) for e in c.entries()}
    assert len(snap.entries) == KEYS
    assert {k: (m.body, m.sequence, m.properties) for k, m in snap.entries.items()} == held
    assert dict(snap.entries["/big/00007"].properties)["ttl"] == "3600"
    assert sum(batches) == KEYS and len(batches) >= 3, batches


def test_heartbeats_do_not_keep_a_snapshot_that_stopped_coming_alive() -> None:
    """A server that sends HUGZ but no more of the snapshot (one that aborted
    the stream of a requester it took for stalled) is given up after the
    timeout; its HUGZ prove it is alive, not that the snapshot is coming."""
    with FakeServer() as fake:
        fake.publish("/s/a", b"1")
        fake.answer_snapshots = False
        failed: list[BaseException] = []

        def export() -> None:
            try:
                take_snapshot([fake.endpoint], "/s/", timeout=0.5)
            except BaseException as exc:
                failed.append(exc)

        reader = threading.Thread(target=export, daemon=True)
        started = time.monotonic()
        reader.start()
        reader.join(60)  # a ceiling only: it gives up after 0.5 s of no snapshot
        assert not reader.is_alive(), "the snapshot reader still waits, fed by HUGZ"
        assert time.monotonic() - started < 60
    assert len(failed) == 1 and isinstance(failed[0], ServersUnreachable)
    assert "delivered a snapshot" in str(failed[0])
