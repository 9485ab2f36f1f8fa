"""Relays on real processes: ``clone-server --relay --upstream A,B``.

A relay's snapshot equals the pair's, byte for byte; its KVPUBs carry the
pair's sequences; a client that knows only the relay makes confirmed writes;
the relay follows a failover of the pair; relays chain; a relay that lost the
pair keeps serving its last state and says ``stale=1`` in its HUGZ.
"""

from __future__ import annotations

import time

import zmq

from clone import Clone
from clone.client.status import query_status
from clone.wire.codec import Hugz, decode_update
from tests.support.servers import Servers, read_stats, wait_role
from tests.support.waiting import eventually

Entry = tuple[bytes, bytes, bytes, bytes, bytes]


def _snapshot(ctx: zmq.Context, port: int, timeout: float = 30.0) -> tuple[list[Entry], int]:
    """A raw ICANHAZ? for everything: the sorted KVSYNCs and KTHXBAI's sequence."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"ICANHAZ?", b""])
        entries: list[Entry] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not dealer.poll(200):
                continue
            frames = dealer.recv_multipart()
            if frames[0] == b"KTHXBAI":
                return sorted(entries), int.from_bytes(frames[1], "big")
            assert len(frames) == 5
            entries.append((frames[0], frames[1], frames[2], frames[3], frames[4]))
        raise TimeoutError(f"no KTHXBAI from {port}")
    finally:
        dealer.close(linger=0)


class _Sub:
    """A raw SUB on a server's publisher (P+1)."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(f"tcp://127.0.0.1:{port + 1}")

    def updates(self, count: int, timeout: float = 30.0) -> list[tuple[bytes, int]]:
        """The next ``count`` KVPUBs as (key, sequence)."""
        out: list[tuple[bytes, int]] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            if self.sock.poll(100):
                frames = self.sock.recv_multipart()
                if frames[0] != b"HUGZ":
                    out.append((frames[0], int.from_bytes(frames[1], "big")))
        return out

    def hugz(self, timeout: float = 10.0) -> Hugz:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(100):
                msg = decode_update(self.sock.recv_multipart())
                if isinstance(msg, Hugz):
                    return msg
        raise TimeoutError("no HUGZ")


def _write(port: int, items: dict[str, bytes]) -> None:
    with Clone([f"tcp://127.0.0.1:{port}"], heartbeat=0.1) as client:
        client.wait_synced(10)
        for key, value in items.items():
            client.set(key, value, wait=True, timeout=10)


def _wait_same_snapshot(ctx: zmq.Context, a: int, b: int, timeout: float = 30.0) -> list[Entry]:
    got: list[list[Entry]] = []

    def same() -> bool:
        left, right = _snapshot(ctx, a)[0], _snapshot(ctx, b)[0]
        got[:] = [left]
        return left == right

    eventually(same, timeout=timeout)
    return got[0]


def test_relay_serves_the_pairs_snapshot_and_sequences(servers: Servers, ctx: zmq.Context) -> None:
    primary, backup = servers.pair("--in-memory")
    _write(primary.port, {f"/r/{i}": f"v{i}".encode() for i in range(20)})
    relay = servers.relay(primary, backup, name="relay")
    entries = _wait_same_snapshot(ctx, primary.port, relay.port)
    assert len(entries) == 20
    via_pair, via_relay = _Sub(ctx, primary.port), _Sub(ctx, relay.port)
    # A HUGZ on each SUB: both subscriptions have reached their publishers.
    via_pair.hugz()
    via_relay.hugz()
    _write(primary.port, {f"/s/{i}": b"x" for i in range(5)})
    from_pair = via_pair.updates(5)
    assert len(from_pair) == 5
    assert via_relay.updates(5) == from_pair  # the pair's sequences
    hugz = via_relay.hugz()
    assert not hugz.stale
    assert hugz.sequence == from_pair[-1][1]


def test_a_write_through_a_relay_is_confirmed(servers: Servers, ctx: zmq.Context) -> None:
    primary, backup = servers.pair("--in-memory")
    relay = servers.relay(primary, backup, name="relay")
    with Clone([f"tcp://127.0.0.1:{relay.port}"], heartbeat=0.1) as client:
        client.wait_synced(10)
        # A first confirmed write proves the client's subscription live.  Before
        # that, an update can reach the relay's publisher ahead of it (a slow
        # joiner): the next HUGZ shows the hole, the client resyncs and sends
        # its unconfirmed write again, and the relay forwards it twice.
        client.set("/via/first", b"1", wait=True, timeout=10)
        before = read_stats(relay)["kvset_forwarded"]
        assert isinstance(before, int) and before >= 1
        client.set("/via/relay", b"yes", wait=True, timeout=10)
        assert client.get("/via/relay") == b"yes"
    entries, _ = _snapshot(ctx, primary.port)
    assert [e[4] for e in entries if e[0] == b"/via/relay"] == [b"yes"]
    assert read_stats(relay)["kvset_forwarded"] == before + 1


def test_a_relay_follows_a_failover(servers: Servers, ctx: zmq.Context) -> None:
    primary, backup = servers.pair("--in-memory")
    _write(primary.port, {"/before": b"1"})
    relay = servers.relay(primary, backup, name="relay")
    offset = relay.log_size()
    primary.kill9()
    # The relay's own request to the backup is a client's vote: it takes over.
    wait_role(backup, "active")
    relay.wait_log(f"synced from 127.0.0.1:{backup.port}", after=offset)
    _write(backup.port, {"/after": b"2"})
    entries = _wait_same_snapshot(ctx, backup.port, relay.port)
    assert {e[0] for e in entries} == {b"/before", b"/after"}
    assert read_stats(relay)["upstream_switches"] >= 1


def test_relays_chain(servers: Servers, ctx: zmq.Context) -> None:
    primary, backup = servers.pair("--in-memory")
    _write(primary.port, {"/chain/a": b"1"})
    first = servers.relay(primary, backup, name="relay1")
    second = servers.relay(first, name="relay2")
    _wait_same_snapshot(ctx, primary.port, second.port)
    with Clone([f"tcp://127.0.0.1:{second.port}"], heartbeat=0.1) as client:
        client.wait_synced(10)
        client.set("/chain/b", b"2", wait=True, timeout=10)
    entries = _wait_same_snapshot(ctx, primary.port, second.port)
    assert {e[0] for e in entries} == {b"/chain/a", b"/chain/b"}


def test_a_relay_that_lost_the_pair_serves_its_last_state_and_says_stale(
    servers: Servers, ctx: zmq.Context
) -> None:
    primary, backup = servers.pair("--in-memory")
    _write(primary.port, {"/kept": b"1"})
    relay = servers.relay(primary, backup, name="relay")
    second = servers.relay(relay, name="relay2")
    before = _wait_same_snapshot(ctx, primary.port, relay.port)
    primary.kill9()
    backup.kill9()
    sub = _Sub(ctx, relay.port)
    eventually(lambda: sub.hugz().stale, timeout=30)
    assert _snapshot(ctx, relay.port)[0] == before
    # Stale it stays, across its tries of each upstream in turn: 25 HUGZ at
    # 100 ms, however long a busy machine takes to send them.
    for _ in range(25):
        assert sub.hugz().stale
    # A relay of a stale relay is stale too, and serves the same state.
    sub2 = _Sub(ctx, second.port)
    eventually(lambda: sub2.hugz().stale, timeout=30)
    assert _snapshot(ctx, second.port)[0] == before


def test_a_relay_catches_up_after_a_failover_even_with_no_update_since_its_snapshot(
    servers: Servers, ctx: zmq.Context
) -> None:
    """docs/benchmarks.md saw a full resync here: the relay's state came from a
    full snapshot that no update followed, so its history held no update to
    name in X-CHP-Since.  The snapshot holds that update (the key written at
    its sequence), so the relay asks for a catch-up, and the new active, whose
    history holds the same update, sends an empty one."""
    primary, backup = servers.pair("--in-memory")
    _write(primary.port, {f"/c/{i}": f"v{i}".encode() for i in range(20)})
    relay = servers.relay(primary, backup, name="relay")
    before = _wait_same_snapshot(ctx, primary.port, relay.port)
    sequence = _snapshot(ctx, relay.port)[1]
    eventually(
        lambda: query_status([f"tcp://127.0.0.1:{backup.port}"])[0]["sequence"] == sequence,
        what="the backup at the relay's sequence",
    )
    offset = relay.log_size()
    primary.kill9()
    wait_role(backup, "active")
    relay.wait_log(f"synced from 127.0.0.1:{backup.port} (catch-up)", after=offset)
    stats = read_stats(relay)
    assert (stats["syncs_full"], stats["syncs_catchup"]) == (1, 1), stats
    assert _snapshot(ctx, relay.port)[0] == before
    # Live again: a write to the new active reaches the relay.
    _write(backup.port, {"/c/after": b"x"})
    assert len(_wait_same_snapshot(ctx, backup.port, relay.port)) == 21
