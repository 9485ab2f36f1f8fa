"""End-to-end STATUS?: real ``clone-server`` processes asked by
``clone status`` and by a raw DEALER.

Heartbeats are 100 ms (``tests.support.servers``).  Every wait has a deadline;
the fixtures stop every process and dump the servers' logs when a test fails.
"""

from __future__ import annotations

import json
import time

import pytest
import zmq

from clone import Clone
from clone.client.cli import EXIT_OK, EXIT_UNREACHABLE, main
from clone.client.status import query_status
from clone.wire.status import decode_status, encode_status_request
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow



def _endpoints(*servers: ServerProcess) -> list[str]:
    return [f"tcp://127.0.0.1:{s.port}" for s in servers]


def _status_json(capsys: pytest.CaptureFixture[str], endpoints: list[str]) -> tuple[int, list]:
    code = main(["--servers", ",".join(endpoints), "status", "--json", "--timeout", "2"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_a_pair_reports_one_active_one_passive_in_step(
    servers: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    primary, backup = servers.pair()
    endpoints = _endpoints(primary, backup)
    with Clone(endpoints) as client:
        client.wait_synced(5)
        for i in range(20):
            client.set(f"/status/{i}", f"v{i}", wait=True, timeout=5)

    def in_step() -> bool:
        got = query_status(endpoints, 2.0)
        return got[0]["sequence"] == got[1]["sequence"] == 20 and bool(got[1]["in_step"])

    eventually(in_step, 10, "the passive at the active's sequence")
    code, statuses = _status_json(capsys, endpoints)
    assert code == EXIT_OK
    p, b = statuses
    assert [p["endpoint"], b["endpoint"]] == endpoints
    assert p["reachable"] and b["reachable"]
    assert (p["role"], b["role"]) == ("active", "passive")
    assert (p["mode"], b["mode"]) == ("primary", "backup")
    assert p["sequence"] == b["sequence"] == 20
    assert p["keys"] == b["keys"] == 20
    assert p["peer_state"]["state"] == "passive" and p["peer_state"]["alive"]
    assert b["peer_state"]["state"] == "active" and b["peer_state"]["alive"]
    assert b["sync_state"] == "synced" and b["in_step"] is True and p["in_step"] is None
    # Coming up active at start is not a takeover.
    assert p["failovers"] == 0 and p["last_failover"] is None
    assert b["failovers"] == 0 and b["last_failover"] is None
    assert p["uptime"] > 0 and p["version"]
    # The table: a header and one line per server.
    assert main(["--servers", ",".join(endpoints), "status"]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["ENDPOINT", "REACHABLE", "ROLE"]
    assert lines[1].split()[:3] == [endpoints[0], "yes", "active"]
    assert lines[2].split()[:3] == [endpoints[1], "yes", "passive"]


def test_a_killed_server_is_reported_unreachable_with_exit_2(
    servers: Servers, capsys: pytest.CaptureFixture[str]
) -> None:
    primary, backup = servers.pair()
    endpoints = _endpoints(primary, backup)
    primary.kill9()
    eventually(
        lambda: query_status(endpoints[1:], 1.0)[0]["peer_state"]["alive"] is False,
        5,
        "the backup to see its peer dead",
    )
    code, statuses = _status_json(capsys, endpoints)
    assert code == EXIT_UNREACHABLE
    down, up = statuses
    assert down["endpoint"] == endpoints[0] and down["reachable"] is False
    assert down["role"] is None and down["sequence"] is None and down["keys"] is None
    # Asking is no vote: the backup is still passive, until a client asks it
    # for a snapshot.
    assert up["reachable"] is True and up["role"] == "passive"
    assert up["failovers"] == 0 and up["last_failover"] is None
    with Clone(endpoints) as client:
        client.wait_synced(10)
    (up,) = query_status(endpoints[1:], 2.0)
    assert up["role"] == "active" and up["failovers"] == 1
    assert up["last_failover"] == pytest.approx(time.time(), abs=30)
    assert main(["--servers", ",".join(endpoints), "status"]) == EXIT_UNREACHABLE
    captured = capsys.readouterr()
    assert endpoints[0] in captured.err
    assert captured.out.splitlines()[1].split()[:2] == [endpoints[0], "NO"]


def _ask(ctx: zmq.Context, port: int, timeout: float = 2.0) -> dict | None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(encode_status_request())
        if not sock.poll(int(timeout * 1000)):
            return None
        return decode_status(sock.recv_multipart())
    finally:
        sock.close(linger=0)


def test_status_is_no_vote_the_passive_stays_passive(servers: Servers, ctx: zmq.Context) -> None:
    primary, backup = servers.pair()
    for _ in range(30):
        status = _ask(ctx, backup.port)
        assert status is not None and status["role"] == "passive"
        time.sleep(0.02)  # under the rate limit: every one is answered
    time.sleep(0.5)  # several peer-expiry periods (100 ms heartbeats)
    assert _ask(ctx, primary.port)["role"] == "active"  # type: ignore[index]
    assert _ask(ctx, backup.port)["role"] == "passive"  # type: ignore[index]
    assert "now ACTIVE" not in backup.log_text()
    stats = read_stats(backup)
    assert stats["status_requests"] == 31 and stats["status_dropped"] == 0


def test_a_flood_of_status_requests_is_rate_limited(servers: Servers, ctx: zmq.Context) -> None:
    server = servers.standalone()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        for _ in range(2000):
            sock.send_multipart(encode_status_request())
        answered = 0
        while sock.poll(500):
            sock.recv_multipart()
            answered += 1
    finally:
        sock.close(linger=0)
    assert 0 < answered < 200
    stats = read_stats(server)
    assert stats["status_requests"] == 2000
    assert stats["status_dropped"] == 2000 - answered
    # Still serving: clients sync and write, and a status is answered again.
    with Clone(_endpoints(server)) as client:
        client.wait_synced(5)
        client.set("/after/flood", "ok", wait=True, timeout=5)
    eventually(lambda: _ask(ctx, server.port, 0.5) is not None, 5, "a status after the flood")
