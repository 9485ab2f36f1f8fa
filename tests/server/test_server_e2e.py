"""End-to-end: real ``clone-server`` processes driven by a raw CHP peer.

Heartbeats are 100 ms (``tests.support.servers``), so a failover takes well under a
second.  Every wait has a deadline; the fixtures stop every process and close
every socket, and dump the servers' logs when a test fails.
"""

from __future__ import annotations

import itertools
import json
import signal
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.support.chp_peer import ChpPeer, Snapshot, Update
from tests.support.ports import free_base_port, free_port
from tests.support.servers import ServerProcess, Servers, server_pool, wait_role
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

SEQ0 = struct.pack(">Q", 0)


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    with server_pool(tmp_path, request) as pool:
        yield pool



@pytest.fixture
def peers(ctx: zmq.Context) -> Iterator[list[ChpPeer]]:
    """Peers created by a test through ``peers.append``; all closed afterwards."""
    made: list[ChpPeer] = []
    yield made
    for peer in made:
        peer.close()


def _peer(ctx: zmq.Context, peers: list[ChpPeer], server: ServerProcess, *also: int) -> ChpPeer:
    peer = ChpPeer(ctx)
    peers.append(peer)
    peer.connect(server.port, collectors=[server.port, *also])
    peer.wait_hugz()
    return peer


def _snapshot_with_retry(peer: ChpPeer, port: int, timeout: float = 10.0) -> Snapshot:
    """Ask like a client failing over: short timeouts, repeated, fresh socket."""
    deadline = time.monotonic() + timeout
    while True:
        peer.use_snapshot_server(port)
        try:
            return peer.snapshot(timeout=0.5)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


# -- the basics, on a standalone server ----------------------------------------


def test_snapshot_with_and_without_subtree(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    for key in (b"/a/1", b"/a/2", b"/b/1", b"/ab/3"):
        peer.kvset(key, b"value of " + key)
    peer.updates(4)
    full = peer.snapshot()
    assert set(full.entries) == {b"/a/1", b"/a/2", b"/b/1", b"/ab/3"}
    assert full.sequence == 4 and full.subtree == b""
    assert full.entries[b"/b/1"].body == b"value of /b/1"
    sub = peer.snapshot(b"/a/")
    assert set(sub.entries) == {b"/a/1", b"/a/2"}
    assert sub.sequence == 4 and sub.subtree == b"/a/"
    assert peer.snapshot(b"/zzz/").entries == {}


def test_sequences_uuid_properties_and_delete(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    sent = [peer.kvset(b"/k/%d" % i, b"v%d" % i, props={"owner": f"t{i}"}) for i in range(50)]
    got = peer.updates(50)
    assert [u.sequence for u in got] == list(range(1, 51))
    assert [u.uuid for u in got] == sent
    assert [u.props for u in got] == [{"owner": f"t{i}"} for i in range(50)]
    delete_id = peer.kvset(b"/k/7", b"")
    (deleted,) = peer.updates(1)
    assert (deleted.key, deleted.body, deleted.sequence, deleted.uuid) == (
        b"/k/7", b"", 51, delete_id
    )
    snap = peer.snapshot()
    assert b"/k/7" not in snap.entries and len(snap.entries) == 49
    assert snap.entries[b"/k/8"].uuid == sent[8]  # KVSYNC carries uuid and properties
    assert snap.entries[b"/k/8"].props == {"owner": "t8"}


def test_duplicate_uuid_is_published_once(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    uid = peer.kvset(b"/d", b"1")
    peer.kvset(b"/d", b"1", uuid=uid)  # a resend after a failover
    peer.kvset(b"/e", b"2")
    got = peer.updates(2)
    assert [(u.key, u.sequence) for u in got] == [(b"/d", 1), (b"/e", 2)]


def test_ttl_expiry_publishes_a_delete_and_bad_ttl_is_rejected(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    before = time.time()
    peer.kvset(b"/bad", b"x", props={"ttl": "abc"})
    peer.kvset(b"/neg", b"x", props={"ttl": "-5"})
    peer.kvset(b"/eph", b"x", props={"ttl": "0.5"})
    (pub,) = peer.updates(1)
    assert pub.key == b"/eph" and pub.sequence == 1
    assert pub.props["ttl"] == "0.5"
    assert before + 0.5 <= float(pub.props["expires"]) <= time.time() + 0.5 + 0.01
    assert set(peer.snapshot().entries) == {b"/eph"}
    expired = peer.wait_for(lambda u: not u.is_hugz, timeout=3.0)
    assert (expired.key, expired.sequence, expired.uuid, expired.props, expired.body) == (
        b"/eph", 2, b"", {}, b""
    )
    assert time.time() >= float(pub.props["expires"])
    assert peer.snapshot().entries == {}
    server.wait_log("ttl='abc' is not a decimal number")


def test_hugz_cadence_and_sequence(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    peer.kvset(b"/x", b"1")
    peer.updates(1)
    peer.wait_hugz()
    start = time.monotonic()
    beats = peer.updates(10, timeout=3.0, hugz=True)
    elapsed = time.monotonic() - start
    assert all(b.is_hugz and b.sequence == 1 for b in beats)
    # Our extension: each HUGZ says the interval, so clients judge silence by it.
    assert all(b.props == {"heartbeat": str(servers.heartbeat_ms)} for b in beats)
    assert 0.7 <= elapsed <= 2.0, elapsed  # 10 beats at 100 ms


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_exits_zero(servers: Servers, sig: int) -> None:
    server = servers.standalone()
    server.signal(sig)
    assert server.proc is not None
    assert server.proc.wait(10) == 0
    assert "server stopped" in server.log_text()


# -- bad input on every socket --------------------------------------------------


def test_malformed_input_never_stops_the_server(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    for frames in (
        [b"ICANHAZ?"],  # missing subtree frame
        [b"GIMME", b""],  # unknown command
        [b"ICANHAZ?", b"", b"extra"],  # extra frame
        [b"ICANHAZ?", b"no-slashes"],  # bad subtree
        [b"ICANHAZ?", b"/a//"],  # empty segment
        [b"ICANHAZ?", b"\xff\xfe"],  # not UTF-8
        [b"ICANHAZ?", b"/" + b"x" * 2000 + b"/"],  # oversized subtree
    ):
        peer.send_snapshot_frames(frames)
    for frames in (
        [b"/k", SEQ0, b"", b""],  # wrong frame count
        [b"/k", b"\x00\x01", b"", b"", b"v"],  # bad sequence
        [b"/k", SEQ0, b"short", b"", b"v"],  # bad uuid
        [b"/k", SEQ0, b"", b"", b"x" * (1024 * 1024 + 1)],  # huge value
        [b"/k", SEQ0, b"", b"ttl=abc\n", b"v"],  # bad ttl
        [b"/k", SEQ0, b"", b"noequals\n", b"v"],  # bad properties
        [b"\xff", SEQ0, b"", b"", b"v"],  # key not UTF-8
        [b"KTHXBAI", SEQ0, b"", b"", b"v"],  # reserved key
        [b"x" * 2000, SEQ0, b"", b"", b"v"],  # oversized key
    ):
        peer.send_collector_frames(frames)
    peer.kvset(b"/ok", b"fine")
    (ok,) = peer.updates(1)
    assert ok.key == b"/ok" and ok.sequence == 1
    assert set(peer.snapshot().entries) == {b"/ok"}
    log = server.log_text()
    assert "dropped a request" in log and "dropped a client update" in log
    assert server.alive


def test_garbage_on_the_binary_star_port_and_from_the_peer(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    """A backup whose "primary" is this test: bad state messages, a bad
    snapshot and bad KVPUBs on its peer subscription, then the "primary" dies
    and the backup must serve exactly the valid part."""
    fake_port, fake_ha = free_base_port(), free_port()
    fake_state = ctx.socket(zmq.PUB)
    fake_router = ctx.socket(zmq.ROUTER)
    fake_pub = ctx.socket(zmq.PUB)
    for sock in (fake_state, fake_router, fake_pub):
        sock.setsockopt(zmq.LINGER, 0)
    try:
        fake_state.bind(f"tcp://127.0.0.1:{fake_ha}")
        fake_router.bind(f"tcp://127.0.0.1:{fake_port}")
        fake_pub.bind(f"tcp://127.0.0.1:{fake_port + 1}")
        port, ha = free_base_port(), free_port()
        args = [
            "--backup", "--port", str(port), "--peer", f"127.0.0.1:{fake_port}",
            "--ha-port", str(ha), "--peer-ha", f"127.0.0.1:{fake_ha}",
            "--bind", "127.0.0.1", "--heartbeat", "100", "--verbose",
        ]  # fmt: skip
        backup = servers.spawn("backup", args, port, ha)
        # Garbage, then "I am active", until it asks us for a snapshot.
        deadline = time.monotonic() + 10
        request = None
        while request is None:
            assert time.monotonic() < deadline, "backup never asked for a snapshot"
            for junk in ([b"zz"], [b"3", b"3"], [b"9"], [b"x" * 100]):
                fake_state.send_multipart(junk)
            fake_state.send(b"3")
            if fake_router.poll(100):
                request = fake_router.recv_multipart()
        assert request[1:] == [b"ICANHAZ?", b""]
        who = request[0]
        for frames in (
            [b"bad"],
            [b"/s/bad", b"\x01", b"", b"", b"v"],
            [b"/s/1", struct.pack(">Q", 1), b"", b"", b"one"],
            [b"KTHXBAI", struct.pack(">Q", 1), b"", b"", b""],
        ):
            fake_router.send_multipart([who, *frames])
        backup.wait_log("synced from", timeout=5)
        for frames in (
            [b"garbage"],
            [b"/p/2", b"\x00", b"", b"", b"two"],
            [b"HUGZ", b""],
            [b"/p/2", struct.pack(">Q", 2), b"", b"", b"two"],
            [b"HUGZ", struct.pack(">Q", 2), b"", b"", b""],
        ):
            fake_state.send(b"3")
            fake_pub.send_multipart(frames)
            time.sleep(0.02)
        # The fake primary goes silent; a client vote promotes the backup.
        peer = ChpPeer(ctx)
        peers.append(peer)
        snap = _snapshot_with_retry(peer, port)
        assert {k: u.body for k, u in snap.entries.items()} == {b"/s/1": b"one", b"/p/2": b"two"}
        assert snap.sequence == 2
        log = backup.log_text()
        assert "dropped a message from the peer" in log
        assert "dropped a snapshot entry from the peer" in log
        assert "dropped state message" in log or "bad state message" in log
    finally:
        for sock in (fake_state, fake_router, fake_pub):
            sock.close(linger=0)


# -- failover ---------------------------------------------------------------------


def test_failover_serves_full_state_and_publishes_the_failover_window(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    primary, backup = servers.pair()
    peer = _peer(ctx, peers, primary, backup.port)
    peer.sub.connect(f"tcp://127.0.0.1:{backup.port + 1}")  # hear whoever is active
    before = [peer.kvset(b"/k/%d" % i, b"v%d" % i) for i in range(200)]
    got = peer.updates(200)
    assert [u.uuid for u in got] == before
    _caught_up(backup, got[-1].sequence)  # the backup's copy of the last KVPUBs landed
    primary.kill9()
    window = [peer.kvset(b"/w/%d" % i, b"w%d" % i, props={"ttl": "60"}) for i in range(100)]
    # The backup has taken every window write before the vote: its collector
    # queue is bounded in bytes (30 messages), so the last ones could still be
    # in the socket when the snapshot starts (they would follow as KVPUBs).
    eventually(lambda: _stats(backup)["pending"] >= 100, 30, "the window parked")
    snap = _snapshot_with_retry(peer, backup.port)
    assert snap.kvsync_count == 300
    assert {k: u.body for k, u in snap.entries.items() if k.startswith(b"/k/")} == {
        b"/k/%d" % i: b"v%d" % i for i in range(200)
    }
    assert all(float(snap.entries[b"/w/%d" % i].props["expires"]) > time.time() for i in range(100))
    assert snap.sequence >= 300
    # Every update of the failover window was published by the new active.
    published: list[Update] = []
    deadline = time.monotonic() + 5
    while len(published) < 100:
        msg = peer.recv(deadline - time.monotonic())
        assert msg is not None, f"only {len(published)} of 100 window updates published"
        if msg.key.startswith(b"/w/"):
            published.append(msg)
    assert [u.uuid for u in published] == window
    seqs = [u.sequence for u in published]
    assert seqs == list(range(seqs[0], seqs[0] + 100)) and seqs[0] > 200
    # A client resending an unconfirmed update after the failover is deduplicated.
    peer.kvset(b"/w/0", b"w0", uuid=window[0], props={"ttl": "60"})
    peer.kvset(b"/after", b"x")
    nxt = peer.wait_for(lambda u: not u.is_hugz)
    assert nxt.key == b"/after" and nxt.sequence == seqs[-1] + 1
    backup.wait_log("now ACTIVE (was passive)")


def _stats(server: ServerProcess) -> dict[str, Any]:
    """Ask for the stats line (SIGUSR1) and return its JSON object."""
    mark = server.log_size()
    server.signal(signal.SIGUSR1)
    start = server.wait_log("stats: {", after=mark)
    end = server.wait_log("\n", after=start)
    text = server.log_path.read_bytes()[start - 1 : end].decode(errors="replace")
    stats: dict[str, Any] = json.loads(text)
    return stats


def _caught_up(server: ServerProcess, sequence: int) -> None:
    """Until ``server`` (a passive) holds the state up to ``sequence``, by its stats."""
    eventually(
        lambda: _stats(server)["sequence"] >= sequence,
        what=f"{server.name} to reach sequence {sequence}",
    )


def _await_kthxbai(dealer: zmq.Socket, timeout: float) -> int:
    """KVSYNCs received before KTHXBAI on ``dealer``; TimeoutError if none comes."""
    deadline = time.monotonic() + timeout
    entries = 0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not dealer.poll(int(remaining * 1000)):
            raise TimeoutError(f"no KTHXBAI within {timeout} s ({entries} KVSYNCs)")
        frames = dealer.recv_multipart()
        if frames[0] == b"KTHXBAI":
            return entries
        entries += 1


@pytest.fixture
def slow_servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    """Servers at the production heartbeat (1 s): a held vote lives 4 s."""
    with server_pool(tmp_path, request, heartbeat_ms=1000) as pool:
        yield pool


def test_vote_held_by_the_passive_is_served_once_the_primary_dies(
    slow_servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    """A client that votes for the backup before the backup knows the primary
    is dead is answered when it finds out, on the same request: no re-send.

    The primary is frozen before the client asks (it is dead to the client,
    and silent from then on, as a dead process is): a primary heard active
    after the request contradicts it (the next test)."""
    primary, backup = slow_servers.pair()
    peer = _peer(ctx, peers, primary, backup.port)
    for i in range(20):
        peer.kvset(b"/held/%d" % i, b"%d" % i)
    last = peer.updates(20)[-1]
    _caught_up(backup, last.sequence)  # the backup applied the last KVPUBs
    early = ctx.socket(zmq.DEALER)
    early.setsockopt(zmq.LINGER, 0)
    try:
        primary.sigstop()
        early.connect(f"tcp://127.0.0.1:{backup.port}")
        early.send_multipart([b"ICANHAZ?", b""])
        assert not early.poll(300), "a passive server with a live peer served a snapshot"
        primary.kill9()
        assert _await_kthxbai(early, timeout=5.0) == 20  # the request sent before the kill
    finally:
        early.close(linger=0)
    backup.wait_log("now ACTIVE (was passive)")
    stats = _stats(backup)
    assert stats["votes_deferred"] >= 1 and stats["votes_deferred_served"] >= 1, stats
    assert stats["votes_deferred_held"] == 0, stats


def test_vote_held_while_the_primary_still_speaks_never_promotes(
    slow_servers: Servers, ctx: zmq.Context
) -> None:
    """Chaos run seed 11: a request the passive held while the active was alive
    and speaking was replayed as a vote when the active expired after a cut of
    the Binary Star link alone, and made a split brain. A primary heard active
    after the request contradicts it: dropped, never a vote."""
    primary, backup = slow_servers.pair()  # 1 s heartbeats: held up to 4 s, expiry 2 s
    heard = _stats(backup)["ha_state_messages_received"]
    early = ctx.socket(zmq.DEALER)
    early.setsockopt(zmq.LINGER, 0)
    try:
        early.connect(f"tcp://127.0.0.1:{backup.port}")
        early.send_multipart([b"ICANHAZ?", b""])
        eventually(lambda: _stats(backup)["votes_deferred"] >= 1, what="the request held")
        # The primary speaks after the request, then falls silent: the backup
        # expires it about 2 s after that, while the request is still held.
        eventually(
            lambda: _stats(backup)["ha_state_messages_received"] >= heard + 2,
            what="the primary heard after the request",
        )
        primary.sigstop()
        backup.wait_log("presumed dead")
        assert not early.poll(500), "a held request was served after the active spoke"
        stats = _stats(backup)
        assert stats["votes_deferred_served"] == 0, stats
        assert stats["votes_deferred_expired"] >= 1, stats
        assert "now ACTIVE" not in backup.log_text()
    finally:
        early.close(linger=0)
        primary.sigcont()


def test_request_right_after_the_kill_is_answered_without_resending(
    slow_servers: Servers, ctx: zmq.Context
) -> None:
    primary, backup = slow_servers.pair()
    primary.kill9()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{backup.port}")
        dealer.send_multipart([b"ICANHAZ?", b""])
        # Held at most until the backup's expiry of the primary (2 s after its
        # last heartbeat), never the client's 2.5 s timeout plus a retry.
        _await_kthxbai(dealer, timeout=5.0)
    finally:
        dealer.close(linger=0)
    backup.wait_log("now ACTIVE (was passive)")


def test_held_vote_ages_out_while_the_peer_lives(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    _primary, backup = servers.pair()  # 100 ms heartbeats: held at most 0.4 s
    probe = ChpPeer(ctx)
    peers.append(probe)
    probe.use_snapshot_server(backup.port)
    assert probe.no_snapshot_reply(1.0)
    stats = _stats(backup)
    assert stats["votes_deferred"] >= 1, stats
    assert stats["votes_deferred_expired"] >= 1 and stats["votes_deferred_served"] == 0, stats
    assert stats["votes_deferred_held"] == 0, stats
    assert "now ACTIVE" not in backup.log_text()  # a held vote never promoted it


def test_restarted_primary_comes_back_passive_with_the_full_state(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    primary, backup = servers.pair()
    peer = _peer(ctx, peers, primary, backup.port)
    for i in range(100):
        peer.kvset(b"/a/%d" % i, b"%d" % i)
    _caught_up(backup, peer.updates(100)[-1].sequence)
    primary.kill9()
    _snapshot_with_retry(peer, backup.port)  # the vote: backup takes over
    peer.resubscribe(backup.port)
    peer.wait_hugz()
    mark = primary.log_size()
    primary.restart()
    wait_role(primary, "passive")
    primary.wait_log("synced from", after=mark)
    # Passive: it does not answer snapshot requests while the backup lives.
    probe = ChpPeer(ctx)
    peers.append(probe)
    probe.use_snapshot_server(primary.port)
    assert probe.no_snapshot_reply(0.5)
    # It follows the active backup: updates made now reach it too.
    for i in range(100, 150):
        peer.kvset(b"/a/%d" % i, b"%d" % i)
    last = peer.updates(50)[-1]
    _caught_up(primary, last.sequence)
    backup.kill9()
    snap = _snapshot_with_retry(peer, primary.port)
    assert snap.kvsync_count == 150
    assert {k: u.body for k, u in snap.entries.items()} == {
        b"/a/%d" % i: b"%d" % i for i in range(150)
    }
    assert snap.sequence >= last.sequence  # never backwards


def test_a_passive_that_resyncs_a_large_state_misses_nothing(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    """Regression: the follower's drain loop used to drop the message it had just
    received whenever its turn ran out, one snapshot entry per 1000, silently."""
    primary, backup = servers.pair()
    peer = _peer(ctx, peers, primary, backup.port)
    n = 5000
    for i in range(n):
        peer.kvset(b"/big/%d" % i, b"%d" % i)
    peer.updates(n)
    mark = backup.log_size()
    backup.kill9()
    backup.restart()
    backup.wait_log("synced from", after=mark)
    _caught_up(backup, n)
    primary.kill9()
    snap = _snapshot_with_retry(peer, backup.port)
    assert snap.kvsync_count == n
    assert {k: u.body for k, u in snap.entries.items()} == {
        b"/big/%d" % i: b"%d" % i for i in range(n)
    }


# -- big snapshots -----------------------------------------------------------------


def test_100k_snapshot_is_complete_and_heartbeats_keep_flowing(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    # The second requester reads nothing until the first snapshot is done: on
    # a loaded machine that took more than the default 10 s stall timeout
    # (TCP_MAXRT), which then cut it off as a requester that reads nothing
    # (seen with six workers on two cores).  Not what this test is about.
    server = servers.standalone("--snapshot-hwm", "1000", "--snapshot-stall-timeout", "120")
    peer = _peer(ctx, peers, server)
    n = 100_000
    value = b"x" * 100
    for i in range(n):
        peer.kvset(b"/big/%d" % i, value)
    peer.wait_for(lambda u: u.sequence == n and not u.is_hugz, timeout=120)
    # A watcher thread with its own socket timestamps HUGZ as they arrive.
    hugz_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        sub.connect(f"tcp://127.0.0.1:{server.port + 1}")
        try:
            while not stop.is_set():
                if sub.poll(50):
                    sub.recv_multipart()
                    hugz_at.append(time.monotonic())
        finally:
            sub.close(linger=0)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        deadline = time.monotonic() + 5
        while not hugz_at:
            assert time.monotonic() < deadline, "watcher heard no HUGZ"
            time.sleep(0.01)
        other = ChpPeer(ctx)  # a second snapshot streams concurrently, read later
        peers.append(other)
        other.use_snapshot_server(server.port)
        assert other.dealer is not None
        other.dealer.send_multipart([b"ICANHAZ?", b"/big/"])
        start = time.monotonic()
        snap = peer.snapshot(timeout=40)
        count = 0
        deadline = time.monotonic() + 30
        while True:
            assert other.dealer.poll(int(max(0, deadline - time.monotonic()) * 1000))
            frames = other.dealer.recv_multipart()
            if frames[0] == b"KTHXBAI":
                break
            count += 1
        end = time.monotonic()
    finally:
        stop.set()
        watcher.join(5)
    assert snap.kvsync_count == n and len(snap.entries) == n
    assert snap.sequence == n
    assert count == n
    during = [t for t in hugz_at if start <= t <= end]
    gaps = [b - a for a, b in itertools.pairwise([start, *during, end])]
    print(f"2 x 100k snapshots in {end - start:.2f} s, {len(during)} HUGZ meanwhile, "
          f"longest gap {max(gaps):.3f} s")
    # Heartbeats keep flowing (the Guide's server stalled 2.2 s).  The bound is
    # loose because a 2-core CI box running server, peer and watcher threads
    # deschedules any of them for 100+ ms now and then; with the cores kept
    # busy a gap reached 1.9 s, so the bound grows with the snapshots' time: a
    # server that blocked on them would go silent for most of it.
    assert len(during) >= (end - start) / 0.1 / 2, (len(during), end - start)
    assert max(gaps) < max(1.0, (end - start) / 3), (max(gaps), end - start)


# -- batched snapshots (our KVBATCH extension) ---------------------------------------

BATCH_META = b"X-CHP-Batch:1"


def _snapshot_dealer(
    ctx: zmq.Context, server: ServerProcess, *, batched: bool, rcvhwm: int = 0
) -> zmq.Socket:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVHWM, rcvhwm)
    if batched:
        dealer.setsockopt(zmq.METADATA, BATCH_META)
    dealer.connect(f"tcp://127.0.0.1:{server.port}")
    return dealer


def _replies(dealer: zmq.Socket, subtree: bytes = b"", timeout: float = 10.0) -> list[list[bytes]]:
    """ICANHAZ? and every reply up to and including KTHXBAI, raw."""
    dealer.send_multipart([b"ICANHAZ?", subtree])
    out: list[list[bytes]] = []
    deadline = time.monotonic() + timeout
    while not out or out[-1][0] != b"KTHXBAI":
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not dealer.poll(int(remaining * 1000)):
            raise TimeoutError(f"no KTHXBAI within {timeout} s ({len(out)} messages)")
        out.append(dealer.recv_multipart())
    return out


def _unbatch(frames: list[bytes]) -> list[list[bytes]]:
    """A KVBATCH as the KVSYNCs it stands for, parsed by hand from the spec."""
    assert len(frames) == 10 and frames[0] == b"KVBATCH", frames[:1]
    columns = []
    for at in (1, 4, 6, 8):
        lens_frame, data = frames[at], frames[at + 1]
        lens = struct.unpack(f"!{len(lens_frame) // 4}I", lens_frame)
        assert sum(lens) == len(data)
        offsets = list(itertools.accumulate(lens, initial=0))
        columns.append([data[a:b] for a, b in itertools.pairwise(offsets)])
    keys, uuids, props, bodies = columns
    seqs = [frames[3][i : i + 8] for i in range(0, len(frames[3]), 8)]
    assert len(seqs) == len(keys) == len(uuids) == len(props) == len(bodies)
    return [list(e) for e in zip(keys, seqs, uuids, props, bodies, strict=True)]


def _fill(peer: ChpPeer, n: int, value: bytes, prefix: bytes = b"/big/") -> None:
    for i in range(n):
        peer.kvset(prefix + b"%d" % i, value)
    peer.wait_for(lambda u: u.sequence == n and not u.is_hugz, timeout=120)


def test_batched_snapshot_is_the_standard_one_packed(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    """Negotiated by metadata: the same entries, byte for byte and in the same
    order, in KVBATCH messages; a requester without it (the Guide's clients)
    gets the standard stream, with no KVBATCH in it."""
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    n = 9000  # three batches
    for i in range(n):
        props = {"ttl": "3600", "owner": "t"} if i % 1000 == 0 else None
        peer.kvset(b"/k/%05d" % i, b"v%d" % i, props=props)
    peer.kvset("/s/é\x00nul".encode(), b"x" * 5000, uuid=b"")
    peer.kvset(b"/s/other", b"o")
    peer.kvset(b"/k/00007", b"")  # a delete: in neither
    seq = struct.pack(">Q", n + 3)
    peer.wait_for(lambda u: u.sequence == n + 3 and not u.is_hugz, timeout=30)
    plain = _replies(_snapshot_dealer(ctx, server, batched=False))
    batched = _replies(_snapshot_dealer(ctx, server, batched=True))
    assert all(len(m) == 5 for m in plain) and len(plain) == n + 2
    assert plain[-1] == batched[-1] == [b"KTHXBAI", seq, b"", b"", b""]
    assert len(batched) == 4  # three KVBATCHes, then KTHXBAI
    unpacked = [kvsync for m in batched[:-1] for kvsync in _unbatch(m)]
    assert unpacked == plain[:-1]
    by_key = {m[0]: m for m in unpacked}
    assert by_key[b"/k/01000"][3].startswith(b"ttl=3600\nowner=t\nexpires=")
    assert by_key["/s/é\x00nul".encode()][2:] == [b"", b"", b"x" * 5000]
    assert b"/k/00007" not in by_key
    # Subtrees are filtered the same way in batch mode.
    sub = _replies(_snapshot_dealer(ctx, server, batched=True), b"/s/")
    assert [m[0] for m in _unbatch(sub[0])] == ["/s/é\x00nul".encode(), b"/s/other"]
    assert sub[1] == [b"KTHXBAI", seq, b"", b"", b"/s/"]
    assert _stats(server)["snapshots_batched"] == 2


def test_a_batched_requester_that_stops_reading_pins_few_batches_and_is_aborted_when_gone(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer]
) -> None:
    """The socket's high-water mark counts messages, so without a bound of its
    own the server would queue a whole snapshot of KVBATCHes for a requester
    that does not read.  It keeps a few in flight instead; when the requester
    vanishes the stream is aborted and counted, and the server serves on."""
    server = servers.standalone()
    peer = _peer(ctx, peers, server)
    n = 60_000  # 60 MB of values: far more than socket buffers hold
    _fill(peer, n, b"x" * 1000)
    # The start-up probe may have left a stream behind (it asks again on a
    # fresh socket when the first answer is slow): aborted as gone once its
    # socket stays unroutable, which on a busy machine came after the fill.
    # Counted from when no stream is in flight.
    eventually(lambda: _stats(server)["snapshots_in_flight"] == 0, 30, "the probe's streams")
    before = _stats(server)
    served, aborted = before["snapshots_served"], before["snapshots_aborted"]
    assert isinstance(aborted, int)
    stuck = _snapshot_dealer(ctx, server, batched=True, rcvhwm=1)
    stuck.send_multipart([b"ICANHAZ?", b""])
    assert stuck.poll(5000)
    stuck.recv_multipart()  # it started, then the requester stops reading
    time.sleep(1.5)
    stats = _stats(server)
    assert stats["snapshots_batched"] == 0 and stats["snapshots_aborted"] == aborted, stats
    assert stats["snapshots_served"] == served, stats  # still in flight, not all queued
    stuck.close(linger=0)
    eventually(
        lambda: _stats(server)["snapshots_aborted"] == aborted + 1,
        what="the vanished requester's stream to be aborted",
    )
    assert "requester went away" in server.log_text()
    replies = _replies(_snapshot_dealer(ctx, server, batched=True), timeout=30)
    assert sum(len(_unbatch(m)) for m in replies[:-1]) == n
    stats = _stats(server)
    assert stats["snapshots_batched"] == 1 and stats["snapshots_aborted"] == aborted + 1, stats


@pytest.mark.parametrize("durable", [False, True], ids=["in-memory", "durable"])
def test_a_restarted_passive_resyncs_through_kvbatches(
    servers: Servers, ctx: zmq.Context, peers: list[ChpPeer], durable: bool
) -> None:
    """In memory, the restarted backup asks its peer for batches; with a data
    directory it catches up from its own state instead.  Either way, after the
    primary dies it serves exactly the state the primary served, properties
    and expiry included."""
    primary, backup = servers.pair(*(() if durable else ("--in-memory",)))
    peer = _peer(ctx, peers, primary, backup.port)
    n = 20_000
    for i in range(n):
        peer.kvset(b"/r/%d" % i, b"v%d" % i, props={"ttl": "3600"} if i % 10 == 0 else None)
    peer.updates(n, timeout=30)
    before = _replies(_snapshot_dealer(ctx, primary, batched=False), timeout=30)
    pmark, bmark = primary.log_size(), backup.log_size()
    backup.kill9()
    backup.restart()
    if durable:
        backup.wait_log("(catch-up)", after=bmark, timeout=30)
    else:
        backup.wait_log("synced from", after=bmark, timeout=30)
        primary.wait_log(", batched", after=pmark)
    _caught_up(backup, n)
    primary.kill9()
    # Each request is a vote; the backup answers once it has taken over (a
    # snapshot of 5,000 entries can take seconds on a busy machine).
    deadline = time.monotonic() + 60
    while True:
        try:
            after = _replies(_snapshot_dealer(ctx, backup, batched=False), timeout=5.0)
            break
        except TimeoutError:
            assert time.monotonic() < deadline, "the backup never served"
    assert len(after) == n + 1
    # Byte for byte, expires included.  The order of a snapshot's entries is
    # not part of CHP: a server that loaded its state lists keys in the
    # database's order.
    assert sorted(after) == sorted(before)
