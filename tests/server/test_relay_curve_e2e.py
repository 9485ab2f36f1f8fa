"""Relays over CURVE, and calls through relays, on real processes.

Two sets of keys: ``up`` is the pair's (its certificate, its clients
directory, which holds the relay's own client key ``relay``, and its ACL);
``down`` is the relay's (its own server certificate, the clients it admits
and its ACL).  A client of the relay holds a key of ``down`` only: the pair
never hears of it.  Calls go through a raw DEALER, so these tests hold the
relay to the wire contract of docs/protocol.md ("CALL? / REPLY").

Every server is stopped by the fixture, every socket closed with linger 0,
every wait has a deadline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zmq

from clone import Clone
from clone.errors import NotSynced, WriteRefused
from clone.security import fingerprint
from clone.wire.calls import CALL, OP_LEASE_GRANT, OP_SET, Reply, decode_reply, encode_call
from clone.wire.codec import Hugz, decode_update, new_uuid
from clone.wire.control import ViewHeartbeat, decode_control, is_control
from tests.server.test_http_e2e import metrics
from tests.support.curve import CurveKeys, curve_socket, wait_serving_curve
from tests.support.ports import free_base_port, free_port
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1  # the servers' heartbeat (tests.support.servers)
ALL: tuple[list[str], list[str]] = ([""], [""])
READER: tuple[list[str], list[str]] = (["/public/"], [])



@pytest.fixture
def up(tmp_path: Path) -> CurveKeys:
    """The pair's keys: admin, and the relay's client key, which may read
    everything but write only under /public/ and /via/."""
    keys = CurveKeys.make(tmp_path / "up", admitted=("admin", "relay"), strangers=("intruder",))
    keys.write_acl({"admin": ALL, "relay": ([""], ["/public/", "/via/"])})
    return keys


@pytest.fixture
def down(tmp_path: Path) -> CurveKeys:
    """The relay's keys: its server certificate, admin and reader admitted,
    mallory known to nobody."""
    keys = CurveKeys.make(tmp_path / "down", admitted=("admin", "reader"), strangers=("mallory",))
    keys.write_acl({"admin": ALL, "reader": READER})
    return keys


def _endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def _relay(
    servers: Servers,
    upstream: list[int],
    *,
    up: CurveKeys | None = None,
    as_name: str = "relay",
    down: CurveKeys | None = None,
    wait: bool = True,
    extra: tuple[str, ...] = (),
) -> ServerProcess:
    """``clone-server --relay`` of the base ports ``upstream``: CURVE upstream
    as ``as_name`` of ``up``, CURVE downstream with ``down``'s certificate,
    clients and ACL."""
    port = free_base_port()
    args = [
        "--relay",
        "--port", str(port),
        "--upstream", ",".join(f"127.0.0.1:{port}" for port in upstream),
        "--bind", "127.0.0.1",
        "--heartbeat", str(servers.heartbeat_ms),
        "--verbose",
        *extra,
    ]  # fmt: skip
    if up is not None:
        args += ["--upstream-curve-secret", str(up.secret(as_name))]
        args += ["--upstream-server-key", str(up.pair_public)]
    if down is not None:
        args += down.server_args()
    relay = servers.spawn("relay", args, port, None)
    if wait:
        relay.wait_log("synced from")
        if down is not None:
            wait_serving_curve(relay, down)
        else:
            relay.wait_serving()
    return relay


def _secure_pair(servers: Servers, keys: CurveKeys) -> tuple[ServerProcess, ServerProcess]:
    primary, backup = servers.pair(*keys.server_args(), "--in-memory", wait=False)
    primary.wait_log("now ACTIVE")
    backup.wait_log("synced from")
    wait_serving_curve(primary, keys)
    return primary, backup


def _secure_standalone(servers: Servers, keys: CurveKeys) -> ServerProcess:
    server = servers.standalone(*keys.server_args(), "--in-memory", wait=False)
    wait_serving_curve(server, keys)
    return server


def _synced(server: ServerProcess, keys: CurveKeys | None, name: str = "admin") -> Clone:
    secure = keys.client(name) if keys is not None else {}
    client = Clone([_endpoint(server)], heartbeat=HB, confirm_timeout=5.0, **secure)
    try:
        client.wait_synced(10)
    except BaseException:
        client.close()
        raise
    return client


def _call(
    sock: zmq.Socket[Any], op: str, key: str = "", body: bytes = b"", **props: str
) -> Reply:
    """One call on ``sock`` (connected); its reply within 5 s."""
    uuid = new_uuid()
    sock.send_multipart(encode_call(op, uuid, key, tuple(props.items()), body))
    assert sock.poll(5000), f"no REPLY to {op} {key!r} within 5 s"
    reply = decode_reply(sock.recv_multipart())
    assert reply.uuid == uuid
    return reply


def _dealer(ctx: zmq.Context[Any], server: ServerProcess) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(_endpoint(server))
    return sock


def _stale_hugz(ctx: zmq.Context[Any], server: ServerProcess, seconds: float) -> list[bool]:
    """The ``stale`` of every HUGZ a plain SUB gets from ``server`` in ``seconds``."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
    sub.connect(f"tcp://127.0.0.1:{server.port + 1}")
    out: list[bool] = []
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                msg = decode_update(sub.recv_multipart())
                assert isinstance(msg, Hugz)
                out.append(msg.stale)
    finally:
        sub.close(linger=0)
    return out


# -- CURVE on both sides ----------------------------------------------------------


def test_a_curve_relay_of_a_curve_pair_serves_a_curve_client(
    servers: Servers, up: CurveKeys, down: CurveKeys
) -> None:
    primary, backup = _secure_pair(servers, up)
    with _synced(primary, up) as pair_admin:
        for key in ("/public/a", "/secret/b", "/other"):
            pair_admin.set(key, b"1", wait=True)
        relay = _relay(servers, [primary.port, backup.port], up=up, down=down)
        with _synced(relay, down) as admin:
            assert admin.items() == pair_admin.items()
            admin.set("/via/relay", b"yes", wait=True)  # confirmed by the pair's KVPUB
            eventually(lambda: pair_admin.get("/via/relay") == b"yes", 5, "the pair has it")
            assert admin.items() == pair_admin.items()
    fp = fingerprint(up.public_z85("relay"))
    relay.wait_log(f"CURVE towards the upstream: our key {fp}")
    assert read_stats(relay)["kvset_forwarded"] == 1


def test_an_unknown_key_is_refused_by_the_relay(
    servers: Servers, up: CurveKeys, down: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], up=up, down=down)
    # mallory has no certificate in the relay's clients directory; admin of
    # the pair is not a client of the relay either: keys do not carry over.
    for keys, name in ((down, "mallory"), (up, "admin")):
        client = Clone([_endpoint(relay)], heartbeat=HB, server_key=down.pair_public,
                       curve_secret=keys.secret(name))  # fmt: skip
        with client, pytest.raises(NotSynced):
            client.wait_synced(1.0)
    relay.wait_log(
        f"refused a CURVE connection from unknown key {fingerprint(down.public_z85('mallory'))}"
    )
    # A plain DEALER gets no answer either, not even to a call.
    plain = _dealer(ctx, relay)
    plain.send_multipart(encode_call(OP_SET, new_uuid(), "/public/x", (), b"plain"))
    assert not plain.poll(1000), "a plain DEALER got an answer from a CURVE relay"


def test_the_relays_acl_filters_a_restricted_client(
    servers: Servers, up: CurveKeys, down: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    server = _secure_standalone(servers, up)
    with _synced(server, up) as pair_admin:
        for key in ("/public/a", "/secret/a"):
            pair_admin.set(key, b"before", wait=True)
        relay = _relay(servers, [server.port], up=up, down=down)
        with _synced(relay, down, "reader") as reader:
            assert reader.items() == [("/public/a", b"before")]
            with reader.changes(timeout=10) as changes:
                for key in ("/secret/b", "/public/b"):
                    pair_admin.set(key, b"after", wait=True)
                seen = []
                for entry in changes:
                    seen.append(entry.key)
                    if entry.key == "/public/b":
                        break
            assert seen == ["/public/b"]
            started = time.monotonic()
            with pytest.raises(WriteRefused) as refused:
                reader.set("/public/a", b"reader", wait=True)
            assert refused.value.reason == "acl"
            assert time.monotonic() - started < 2.0, "the refusal came as a timeout"
            # The relay's ACL judges calls too, before anything goes upstream.
            sock = curve_socket(ctx, zmq.DEALER, down, "reader")
            sock.connect(_endpoint(relay))
            reply = _call(sock, OP_SET, "/public/a", b"reader")
            assert (reply.status, reply.reason) == ("refused", "acl")
            assert reader.status().state == "active"
        assert pair_admin.get("/public/a") == b"before"
    stats = read_stats(relay)
    # The restricted reader's confirmed write is a call too (docs/client.md,
    # "Write-only prefixes"): both refusals are the relay's call check.
    assert stats["kvset_refused_acl"] == 0 and stats["kvset_forwarded"] == 0
    assert stats["calls_forward_refused_acl"] == 2 and stats["calls_forwarded"] == 0


def test_the_pairs_acl_judges_the_relays_key(
    servers: Servers, up: CurveKeys, down: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    """The relay's admin may write anything at the relay, but the pair lets the
    relay's key write only /public/ and /via/: the pair's refusal (a notice,
    or a REPLY) reaches the relay's client."""
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], up=up, down=down)
    with _synced(relay, down) as admin:
        with pytest.raises(WriteRefused) as refused:
            admin.set("/secret/x", b"no", wait=True)
        assert refused.value.reason == "acl"
        admin.set("/public/x", b"yes", wait=True)
    sock = curve_socket(ctx, zmq.DEALER, down, "admin")
    sock.connect(_endpoint(relay))
    assert (_call(sock, OP_SET, "/secret/y", b"no").reason) == "acl"
    assert _call(sock, OP_SET, "/public/y", b"yes").ok
    relay.wait_log("refused a write we forwarded for admin (acl)")
    stats = read_stats(relay)
    assert stats["kvset_refused_upstream"] == 1
    assert stats["calls_forward_refused_acl"] == 0  # the pair refused it, not the relay


# -- fail closed ------------------------------------------------------------------


def test_a_relay_whose_key_the_pair_refuses_stays_stale(
    servers: Servers, up: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], up=up, as_name="intruder", wait=False)
    relay.wait_log("refused our key", timeout=10)
    line = next(li for li in relay.log_text().splitlines() if "refused our key" in li)
    assert fingerprint(up.public_z85("intruder")) in line
    assert "clients directory" in line
    stale = _stale_hugz(ctx, relay, 1.5)
    assert len(stale) >= 5 and all(stale), stale
    assert "synced from" not in relay.log_text()
    # The pair logs the refusal its way, by fingerprint.
    server.wait_log("refused a CURVE connection from unknown key")
    # Rate-limited: one line per 10 s for every handshake the relay retries.
    assert relay.log_text().count("refused our key") <= 2


@pytest.mark.parametrize(
    ("flag", "problem", "said"),
    [
        ("--upstream-curve-secret", "missing", "no such certificate file"),
        ("--upstream-curve-secret", "public", "this is a public certificate"),
        ("--upstream-server-key", "missing", "no such certificate file"),
        ("--curve-secret", "missing", "no such certificate file"),
    ],
)
def test_a_bad_certificate_stops_the_relay(
    servers: Servers, up: CurveKeys, down: CurveKeys, flag: str, problem: str, said: str
) -> None:
    bad = str(up.root / "nowhere.key_secret") if problem == "missing" else str(up.pair_public)
    args = {
        "--upstream-curve-secret": str(up.secret("relay")),
        "--upstream-server-key": str(up.pair_public),
        "--curve-secret": str(down.pair_secret),
    }
    args[flag] = bad
    extra = [item for pair in args.items() for item in pair]
    extra += ["--clients", str(down.clients)]
    upstream_port = free_base_port()  # nothing there: the relay must not get that far
    port = free_base_port()
    argv = ["--relay", "--port", str(port), "--upstream", f"127.0.0.1:{upstream_port}",
            "--bind", "127.0.0.1", *extra]  # fmt: skip
    relay = servers.spawn("relay", argv, port, None)
    proc = relay.proc
    assert proc is not None
    assert proc.wait(timeout=15) == 3  # never started (EXIT_START_FAILED)
    log = relay.log_text()
    assert said in log and bad in log, log[-2000:]
    if flag.startswith("--upstream"):
        assert f"{flag}:" in log, log[-2000:]
    assert "relay server: snapshots" not in log  # nothing was bound


# -- CALL? through a relay ----------------------------------------------------------


def test_a_call_through_a_relay_gets_the_pairs_reply(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    primary, backup = servers.pair("--in-memory")
    relay = _relay(servers, [primary.port, backup.port])
    sock = _dealer(ctx, relay)
    first = _call(sock, OP_SET, "/cas/a", b"1", if_sequence="0")
    assert first.ok and first.sequence > 0
    again = _call(sock, OP_SET, "/cas/a", b"2", if_sequence="0")
    assert again.status == "conflict" and again.current == first.sequence
    lease = _call(sock, OP_LEASE_GRANT, ttl="5")
    assert lease.ok and lease.lease
    # The pair applied it; it comes back through the relay's stream.
    with _synced(relay, None) as client:
        eventually(lambda: client.get("/cas/a") == b"1", 5, "the relay's copy has it")
    stats = read_stats(relay)
    assert stats["calls_forwarded"] == 3 and stats["call_replies_forwarded"] == 3


def test_a_relay_that_has_not_synced_answers_calls_not_active(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    relay = _relay(servers, [free_base_port()], wait=False)  # nothing there
    relay.wait_log("relay server: snapshots")
    sock = _dealer(ctx, relay)
    started = time.monotonic()
    reply = _call(sock, OP_SET, "/k", b"v")
    assert (reply.status, reply.reason) == ("refused", "not-active")
    assert reply.detail == "relay has not synced with the pair"
    assert time.monotonic() - started < 1.0
    # A call that is no call (no uuid) gets nothing, as from the pair.
    sock.send_multipart([CALL, b"set"])
    assert not sock.poll(300)


def test_a_plain_relay_of_a_curve_pair_says_why_it_stays_stale(
    servers: Servers, up: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], wait=False)
    relay.wait_log("the upstream may require CURVE", timeout=10)
    stale = _stale_hugz(ctx, relay, 1.0)
    assert stale and all(stale), stale


def test_calls_follow_the_relay_to_the_new_active(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    primary, backup = servers.pair("--in-memory")
    relay = _relay(servers, [primary.port, backup.port])
    sock = _dealer(ctx, relay)
    first = _call(sock, OP_SET, "/cas/a", b"1", if_sequence="0")
    assert first.ok
    offset = relay.log_size()
    primary.kill9()
    relay.wait_log(f"synced from 127.0.0.1:{backup.port}", timeout=15, after=offset)
    # The call DEALER moved with the relay: the backup, now active, answers.
    second = _call(sock, OP_SET, "/cas/a", b"2", if_sequence=str(first.sequence))
    assert second.ok and second.sequence > first.sequence


def _view_stale(ctx: zmq.Context[Any], relay: ServerProcess, keys: CurveKeys, count: int = 5,
                timeout: float = 30.0) -> list[bool]:
    """The ``stale`` of the next ``count`` view heartbeats the restricted reader
    gets (the ceiling only bounds a hang)."""
    sub = curve_socket(ctx, zmq.SUB, keys, "reader")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{relay.port + 1}")
    out: list[bool] = []
    deadline = time.monotonic() + timeout
    try:
        while len(out) < count and (left := deadline - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                frames = sub.recv_multipart()
                if is_control(frames):
                    beat = decode_control(frames)
                    if isinstance(beat, ViewHeartbeat):
                        out.append(beat.stale)
    finally:
        sub.close(linger=0)
    assert len(out) == count, f"{len(out)} of {count} view heartbeats in {timeout} s"
    return out


def test_a_relays_restricted_clients_are_told_it_is_stale(
    servers: Servers, up: CurveKeys, down: CurveKeys, ctx: zmq.Context[Any]
) -> None:
    """A restricted client gets view heartbeats instead of HUGZ: they carry
    the relay's staleness the same way."""
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], up=up, down=down)
    assert not any(_view_stale(ctx, relay, down))
    server.kill9()
    # Silent for the missed heartbeats (4 x 100 ms): stale from then on.
    relay.wait_log("is silent", timeout=30)
    assert all(_view_stale(ctx, relay, down))


def test_a_relays_metrics_count_its_forwarded_calls(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    server = servers.standalone("--in-memory")
    http = free_port()
    relay = _relay(servers, [server.port], extra=("--http-port", str(http)))
    reply = _call(_dealer(ctx, relay), OP_SET, "/via/metrics", b"1")
    assert reply.ok
    m = metrics(relay, http)
    assert m["clone_relay_calls_total{result=forwarded}"] == 1
    assert m["clone_relay_calls_total{result=not_synced}"] == 0
    assert m["clone_relay_upstream_handshake_failures_total"] == 0


def test_a_stale_curve_relay_tells_the_writer_by_name(
    servers: Servers, up: CurveKeys, down: CurveKeys
) -> None:
    """Over CURVE a stale relay's refusal notice goes to the writer's own
    topic: the writer fails at once, another client never sees it."""
    server = _secure_standalone(servers, up)
    relay = _relay(servers, [server.port], up=up, down=down)
    with _synced(relay, down) as admin, _synced(relay, down, "reader") as reader:
        server.kill9()
        # Silent for the missed heartbeats: given up, so stale from then on.
        relay.wait_log("is silent", timeout=30)
        # Refused at once: WriteRefused, not the ConfirmTimeout of 30 s later.
        with pytest.raises(WriteRefused) as refused:
            admin.set("/via/stale", b"x", wait=True, timeout=30)
        assert refused.value.reason == "stale"
        time.sleep(0.3)  # what the reader would get, it has had time to get
        assert reader.status().counters["refusals"] == 0
    stats = read_stats(relay)
    assert stats["kvset_refused_stale"] == 1 and stats["kvset_forwarded"] == 0
