"""The publisher's subscription caps and subscriber budget against real servers.

Raw zmq sockets act as the attacker: an XSUB sends subscription messages as a
SUB would, only as many and as large as it likes; a SUB that never reads is
the slow subscriber.  A real client checks that the others are untouched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from clone.server.subscribers import drop_connection
from tests.support.clients import synced_client
from tests.support.curve import CurveKeys, curve_socket, wait_serving_curve
from tests.support.ports import free_base_port, free_port
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

WAIT = 30.0


def _xsub(ctx: zmq.Context[Any], server: ServerProcess) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
    """A raw XSUB on ``server``'s publisher, and a monitor of its connection."""
    sock = ctx.socket(zmq.XSUB)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{server.port + 1}")
    return sock, monitor


def _wait_event(monitor: zmq.Socket[Any], event: int, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if monitor.poll(100) and parse_monitor_message(monitor.recv_multipart())["event"] == event:
            return
    raise AssertionError(f"no monitor event {event} within {timeout} s")


def _stat(server: ServerProcess, name: str) -> int:
    value = read_stats(server)[name]
    assert isinstance(value, int)
    return value


def test_subscriptions_beyond_the_caps_are_refused_then_the_connection_dropped(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    http = free_port()
    server = servers.standalone(
        "--max-subscriptions", "4", "--max-subscription-bytes", "64", "--http-port", str(http)
    )
    with synced_client(server) as healthy:
        xsub, monitor = _xsub(ctx, server)
        _wait_event(monitor, zmq.EVENT_CONNECTED)
        for i in range(4):
            xsub.send(b"\x01/ok/%d" % i)  # within both caps
        eventually(lambda: _stat(server, "subscriptions") >= 5, WAIT, "4 + the client's")
        assert _stat(server, "subscriptions_over_limit") == 0
        for i in range(8):  # DROP_AFTER_REFUSALS refusals
            xsub.send(b"\x01/over/%d" % i)
        _wait_event(monitor, zmq.EVENT_DISCONNECTED)
        stats = read_stats(server)
        assert stats["subscriptions_over_limit"] == 8
        assert stats["subscribers_dropped"] == 1
        assert server.wait_log("kept subscribing beyond 4 topics or 64 bytes")
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/metrics", timeout=WAIT) as r:
            body = r.read().decode()
        assert 'clone_subscriptions_refused_total{reason="over-limit"} 8.0' in body
        assert 'clone_subscribers_cut_total{reason="over-limit"} 1.0' in body
        # The others are untouched: the client still writes and hears its writes.
        healthy.set("/after", b"1", wait=True, timeout=WAIT)
        assert healthy.status().counters.get("resyncs", 0) <= 1


def test_the_bytes_cap_counts_topic_bytes(servers: Servers, ctx: zmq.Context[Any]) -> None:
    server = servers.standalone("--max-subscriptions", "100", "--max-subscription-bytes", "20")
    xsub, monitor = _xsub(ctx, server)
    _wait_event(monitor, zmq.EVENT_CONNECTED)
    xsub.send(b"\x01" + b"a" * 20)  # exactly the cap
    xsub.send(b"\x01b")  # one byte over
    eventually(lambda: _stat(server, "subscriptions_over_limit") == 1, WAIT, "a refusal")
    assert _stat(server, "subscriptions") == 1
    assert _stat(server, "subscribers_dropped") == 0


def test_an_oversized_subscription_frame_ends_the_connection_unread(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone()
    xsub, monitor = _xsub(ctx, server)
    _wait_event(monitor, zmq.EVENT_CONNECTED)
    xsub.send(b"\x01" + b"x" * 600)  # over MAXMSGSIZE (1 + 511)
    _wait_event(monitor, zmq.EVENT_DISCONNECTED)
    stats = read_stats(server)
    assert stats["subscriptions"] == 0 and stats["subscriptions_over_limit"] == 0


def test_a_flood_of_valid_subscriptions_is_cut_off_by_the_inbound_watch(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone()
    with synced_client(server) as healthy:
        xsub, monitor = _xsub(ctx, server)
        _wait_event(monitor, zmq.EVENT_CONNECTED)
        # The same 200-byte topic 2,000 times (400 KB) in one burst: the gate
        # accepts a topic a connection holds again without counting it, so
        # only the bytes give it away, far past what 16 topics of 1024 bytes
        # take (the allowance is about 6 KB).
        topic = b"\x01/flood/" + b"f" * 193
        for _ in range(2000):
            xsub.send(topic)
        _wait_event(monitor, zmq.EVENT_DISCONNECTED)
        eventually(lambda: _stat(server, "subscribers_flooding") >= 1, WAIT, "the watch's drop")
        assert server.wait_log("sent ") and server.wait_log("connection dropped")
        healthy.set("/after-flood", b"1", wait=True, timeout=WAIT)


def test_caps_hold_under_curve_for_an_admitted_client(
    servers: Servers, ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """The issue's case: a client admitted to read /t1/ only, subscribing to
    ever more /t1/... topics."""
    keys = CurveKeys.make(tmp_path / "sec", admitted=("t1",))
    keys.write_acl({"t1": (["/t1/"], ["/t1/"])})
    server = servers.standalone(
        *keys.server_args(), "--in-memory", "--max-subscriptions", "2", wait=False
    )
    wait_serving_curve(server, keys, "t1")
    sock = curve_socket(ctx, zmq.XSUB, keys, "t1")
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{server.port + 1}")
    _wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
    for i in range(10):  # 2 accepted, 8 refused: dropped
        sock.send(b"\x01/t1/%d" % i)
    _wait_event(monitor, zmq.EVENT_DISCONNECTED)
    stats = read_stats(server)
    assert stats["subscriptions"] == 2
    assert stats["subscriptions_over_limit"] == 8
    assert stats["subscribers_dropped"] == 1


def test_drop_connection_ends_one_connection_and_libzmq_sees_it(ctx: zmq.Context[Any]) -> None:
    """shutdown(2) on a duplicate of libzmq's descriptor: its peer is disconnected,
    libzmq closes the connection (its monitor says so), the others carry on."""
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.XPUB_MANUAL, 1)
    pub_monitor = pub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    pub.bind("tcp://127.0.0.1:0")
    endpoint = pub.last_endpoint.decode()
    subs = []
    for topic in (b"a", b"b"):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RECONNECT_IVL, 60_000)  # stays away once dropped
        sub.connect(endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, topic)
        subs.append(sub)
    fds: dict[bytes, int] = {}
    while len(fds) < 2:
        assert pub.poll(int(WAIT * 1000)), "no subscription"
        frame = pub.recv(copy=False)
        fds[frame.bytes[1:]] = int(frame.get(zmq.SRCFD))
        pub.setsockopt(zmq.SUBSCRIBE, frame.bytes[1:])
    ino = os.fstat(fds[b"a"]).st_ino
    assert not drop_connection(fds[b"a"], ino + 1), "a wrong inode must not be shut down"
    assert drop_connection(fds[b"a"], ino)
    _wait_event(pub_monitor, zmq.EVENT_DISCONNECTED)
    for _ in range(3):
        pub.send_multipart([b"a", b"to a"])
        pub.send_multipart([b"b", b"to b"])
    assert subs[1].poll(int(WAIT * 1000))
    assert subs[1].recv_multipart() == [b"b", b"to b"]
    assert not subs[0].poll(200), "the dropped subscriber still gets updates"


_SLOW_CLIENT = """
import sys, time
from clone import Clone
with Clone([sys.argv[1]], heartbeat=0.1, server_timeout=1.0) as c:
    c.wait_synced(30)
    print("synced", flush=True)
    while True:
        s = c.status()
        print("state", c.get("/slow/last"), s.counters.get("gaps", 0),
              s.counters.get("resyncs", 0), flush=True)
        time.sleep(0.1)
"""


def test_a_subscriber_over_its_budget_loses_updates_and_resyncs(
    servers: Servers, tmp_path: Path
) -> None:
    server = servers.standalone("--max-subscriber-bytes", str(3 * 2**20))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    out = (tmp_path / "slow.out").open("w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLIENT, f"tcp://127.0.0.1:{server.port}"],
        stdout=out,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        eventually(lambda: "synced" in (tmp_path / "slow.out").read_text(), WAIT, "its sync")
        proc.send_signal(signal.SIGSTOP)  # reads nothing, sockets open
        cut = b"past --max-subscriber-bytes 3145728: connection dropped"
        with synced_client(server) as writer:
            value = os.urandom(60 * 1024)
            # 24 MB: past every kernel buffer on the way; then on until the
            # cut.  The server's watch (a thread of its own, every 50 ms)
            # counts what is published after it has seen the subscriber stop
            # acknowledging: starved, it looked after a burst had ended, and
            # nothing more was ever published (no cut in 30 s at load 11).
            deadline = time.monotonic() + WAIT
            i = 0
            while i < 400 or cut not in server.log_path.read_bytes():
                assert time.monotonic() < deadline, "not cut while it read nothing"
                writer.set(f"/slow/k{i % 50}", value)
                i += 1
            writer.set("/slow/last", b"done", wait=True, timeout=WAIT)
        assert _stat(server, "subscribers_over_budget") >= 1
        assert server.wait_log(cut.decode())
        proc.send_signal(signal.SIGCONT)

        def caught_up() -> bool:
            lines = (tmp_path / "slow.out").read_text().splitlines()
            last = lines[-1].split() if lines else []
            # "state <value> <gaps> <resyncs>": whether it noticed by the
            # sequence gap or by its own freeze (the agent's thaw check), it
            # must have fetched a fresh snapshot to hold the last value.
            return len(last) == 4 and last[1] == "b'done'" and int(last[3]) >= 1

        eventually(caught_up, 60, "the slow client to resync")
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        out.close()


def test_caps_hold_on_a_relay(servers: Servers, ctx: zmq.Context[Any]) -> None:
    upstream = servers.standalone()
    port = free_base_port()
    args = [
        "--relay",
        "--port", str(port),
        "--upstream", f"127.0.0.1:{upstream.port}",
        "--bind", "127.0.0.1",
        "--heartbeat", str(servers.heartbeat_ms),
        "--max-subscriptions", "2",
        "--verbose",
    ]  # fmt: skip
    relay = servers.spawn("relay", args, port, None)
    relay.wait_log("synced from")
    relay.wait_serving()
    xsub, monitor = _xsub(ctx, relay)
    _wait_event(monitor, zmq.EVENT_CONNECTED)
    for i in range(10):
        xsub.send(b"\x01/r/%d" % i)
    _wait_event(monitor, zmq.EVENT_DISCONNECTED)
    stats = read_stats(relay)
    assert stats["subscriptions_over_limit"] == 8
    assert stats["subscribers_dropped"] == 1
    with synced_client(relay) as client:  # the relay still serves
        client.set("/via-relay", b"1", wait=True, timeout=WAIT)


def test_a_subscriber_over_its_budget_is_cut_off_and_loses_its_queue(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    """The cut itself: a subscriber that reads nothing while more than its budget
    is published loses its connection and its queue (libzmq reconnects it)."""
    server = servers.standalone("--in-memory", "--max-subscriber-bytes", str(3 * 2**20))
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 1)
    sub.setsockopt(zmq.RCVBUF, 4096)
    sub.setsockopt(zmq.SUBSCRIBE, b"/slow/")
    sub.connect(f"tcp://127.0.0.1:{server.port + 1}")
    with synced_client(server) as writer:
        # Its subscription travels on its own: write until it hears one.
        def heard() -> bool:
            writer.set("/slow/first", b"1", wait=True, timeout=WAIT)
            return bool(sub.poll(100))

        eventually(heard, WAIT, "the raw subscriber to be subscribed")
        while sub.poll(100):
            sub.recv_multipart()
        value = os.urandom(60 * 1024)
        for i in range(400):  # 24 MB while it reads nothing
            writer.set(f"/slow/k{i % 50}", value)
        writer.set("/slow/last", b"1", wait=True, timeout=WAIT)
    eventually(lambda: _stat(server, "subscribers_over_budget") >= 1, WAIT, "the cut")
    sequences = []
    while sub.poll(2000):
        frames = sub.recv_multipart()
        sequences.append(int.from_bytes(frames[1], "big"))
    # Of the 401 updates written while it read nothing it gets what its own
    # buffers held before the cut and what came after its reconnection.
    assert len(sequences) < 401, "nothing was dropped for it"
    assert sequences == sorted(sequences)


def _handshake(monitor: zmq.Socket[Any]) -> bool:
    """Whether a connection's handshake succeeded (True) or the server closed
    it first (False: the door's temporary refusal, 300, closes it silently:
    no ERROR is sent, as RFC 27 asks, and libzmq just reconnects later)."""
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if not monitor.poll(100):
            continue
        event = parse_monitor_message(monitor.recv_multipart())["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return True
        if event == zmq.EVENT_DISCONNECTED:
            return False
    raise AssertionError(f"no handshake outcome within {WAIT} s")


def _flood_from(ctx: zmq.Context[Any], server: ServerProcess, source: str) -> bool:
    """One raw XSUB from ``source`` that floods the publisher with valid topics
    once its handshake succeeds: True if it was admitted (and then cut off),
    False if the server closed it before its handshake."""
    sock = ctx.socket(zmq.XSUB)
    sock.setsockopt(zmq.LINGER, 0)
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://{source}:0;127.0.0.1:{server.port + 1}")
    try:
        if not _handshake(monitor):
            return False
        topic = b"\x01/flood/" + b"f" * 193
        for _ in range(2000):
            sock.send(topic)
        _wait_event(monitor, zmq.EVENT_DISCONNECTED)
        return True
    finally:
        monitor.close(linger=0)
        sock.close(linger=0)


def test_a_host_cut_off_for_flooding_is_refused_at_the_handshake_for_a_while(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    """The flood penalty (clone.server.penalty): after a cut, the flooder's
    address is refused by the publisher's door (plain mode) before libzmq
    gives it a pipe (status 300: closed without a word, it retries later);
    each cut that follows a penalty doubles the next, so a
    refusal comes however slow the machine; another host is untouched."""
    server = servers.standalone("--in-memory")
    with synced_client(server) as healthy:
        admitted = 0
        while _flood_from(ctx, server, "127.0.0.2"):
            admitted += 1
            assert admitted < 8, "never refused"
        stats = read_stats(server)
        assert int(str(stats["flood_penalties"])) >= 1
        assert int(str(stats["flood_penalty_refused"])) >= 1
        assert int(str(stats["subscribers_flooding"])) + int(
            str(stats["subscribers_dropped"])) >= 1
        # Another host (127.0.0.1) connects and syncs meanwhile, and the
        # healthy client's own connections were never touched.
        with synced_client(server, timeout=WAIT) as fresh:
            fresh.set("/after-penalty", b"1", wait=True, timeout=WAIT)
        healthy.set("/after-penalty", b"2", wait=True, timeout=WAIT)


def test_the_flood_penalty_holds_under_curve(
    servers: Servers, ctx: zmq.Context[Any], tmp_path: Path
) -> None:
    """Under CURVE the Gatekeeper asks the same penalty on the publisher's
    domain: an admitted key that kept subscribing past its caps is refused
    from the same address at its next handshake, while the penalty runs.
    (libzmq then holds the refused connection, silent, until its handshake
    times out: ``--handshake-timeout``, 10 s, where libzmq's own is 30 s.)"""
    keys = CurveKeys.make(tmp_path / "sec", admitted=("t1",))
    keys.write_acl({"t1": (["/t1/"], ["/t1/"])})
    server = servers.standalone(
        *keys.server_args(), "--in-memory", "--max-subscriptions", "2", wait=False
    )
    wait_serving_curve(server, keys, "t1")
    refused = False
    for _ in range(8):
        before = _stat(server, "flood_penalty_refused")
        sock = curve_socket(ctx, zmq.XSUB, keys, "t1")
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sock.connect(f"tcp://127.0.0.3:0;127.0.0.1:{server.port + 1}")
        try:
            # Either the server refuses this handshake (its counter moves)
            # or, the penalty over on a slow machine, it succeeds: flood again.
            def outcome(m: zmq.Socket[Any] = monitor, was: int = before) -> bool:
                return bool(m.poll(0)) or _stat(server, "flood_penalty_refused") > was

            eventually(outcome, WAIT, "a handshake outcome")
            if not monitor.poll(0):
                refused = True
                break
            for i in range(10):  # 2 accepted, 8 refused: dropped and penalized
                sock.send(b"\x01/t1/%d" % i)
            eventually(lambda: _stat(server, "flood_penalties") >= 1, WAIT, "a penalty")
        finally:
            monitor.close(linger=0)
            sock.close(linger=0)
    assert refused, "the penalized address was never refused"
    # The same key from another address is admitted to the publisher.
    other = curve_socket(ctx, zmq.XSUB, keys, "t1")
    monitor = other.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    other.connect(f"tcp://127.0.0.1:{server.port + 1}")
    _wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
