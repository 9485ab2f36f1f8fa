"""End-to-end ``--http-port``: real ``clone-server`` processes, their
/metrics parsed with prometheus_client's parser, /healthz and /readyz on both
servers of a pair, and the status WebSocket.

Heartbeats are 100 ms (``tests.support.servers``).  Every wait has a deadline;
the fixtures stop every process and dump the servers' logs when a test fails.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tornado.websocket import websocket_connect

from clone import Clone
from clone.errors import Conflict
from tests.support.ports import free_base_port, free_port
from tests.support.servers import STEADY_MISSED, ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HTTP_PORT: dict[str, int] = {}  # server name -> its HTTP port (set by http_pair)


def http_pair(servers: Servers, *extra: str) -> tuple[ServerProcess, ServerProcess]:
    """``servers.pair(*extra)`` with a different ``--http-port`` for each server
    (``pair()`` gives both the same arguments, and two servers cannot share one)."""
    ports = {"primary": free_base_port(), "backup": free_base_port()}
    ha = {"primary": free_port(), "backup": free_port()}
    http = {"primary": free_port(), "backup": free_port()}
    while http["backup"] == http["primary"]:
        http["backup"] = free_port()
    started: dict[str, ServerProcess] = {}
    for role, peer in (("primary", "backup"), ("backup", "primary")):
        args = [
            f"--{role}",
            "--port", str(ports[role]),
            "--peer", f"127.0.0.1:{ports[peer]}",
            "--ha-port", str(ha[role]),
            "--peer-ha", f"127.0.0.1:{ha[peer]}",
            "--http-port", str(http[role]),
            *servers._common(),
            *STEADY_MISSED,  # the tests read each role's metrics: no failover unless killed
            *servers._durable(role, extra),
            *extra,
        ]  # fmt: skip
        started[role] = servers.spawn(role, args, ports[role], ha[role])
        HTTP_PORT[role] = http[role]
    primary, backup = started["primary"], started["backup"]
    primary.wait_log("now ACTIVE")
    backup.wait_log("synced from")
    primary.wait_serving()
    return primary, backup


def http_get(server: ServerProcess, path: str, port: int | None = None) -> tuple[int, bytes]:
    url = f"http://127.0.0.1:{port or HTTP_PORT[server.name]}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def metrics(server: ServerProcess, port: int | None = None) -> dict[str, Any]:
    """Every sample: ``name`` or ``name{label=value,...}`` (labels sorted) -> value."""
    code, body = http_get(server, "/metrics", port)
    assert code == 200
    out: dict[str, Any] = {"_types": {}}
    for family in text_string_to_metric_families(body.decode()):
        out["_types"][family.name] = family.type
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


def json_get(server: ServerProcess, path: str) -> tuple[int, dict[str, Any]]:
    code, body = http_get(server, path)
    return code, json.loads(body)


def _write(endpoints: list[str], n: int, prefix: str = "/m/") -> None:
    with Clone(endpoints, heartbeat=0.1) as client:
        client.wait_synced(10)
        for i in range(n):
            client.set(f"{prefix}{i}", f"v{i}".encode(), wait=True, timeout=10)


def _endpoints(*servers: ServerProcess) -> list[str]:
    return [f"tcp://127.0.0.1:{s.port}" for s in servers]


def test_metrics_follow_writes_and_a_failover(servers: Servers) -> None:
    primary, backup = http_pair(servers, "--in-memory")
    m = metrics(primary)
    types = m["_types"]
    # Names and types as Prometheus conventions want them (counters end in _total
    # in the text; the parser gives the family name without it).
    assert types["clone_sequence"] == "gauge"
    assert types["clone_updates"] == "counter"
    assert types["clone_updates_refused"] == "counter"
    assert types["clone_snapshot_seconds"] == "histogram"
    assert types["clone_failovers"] == "counter"
    assert types["clone_protocol_errors"] == "counter"
    assert "process_resident_memory_bytes" in m
    assert m["clone_role{role=active}"] == 1 and m["clone_role{role=passive}"] == 0
    assert metrics(backup)["clone_role{role=passive}"] == 1
    # The backup's sync was one snapshot served by the primary, timed.
    assert m["clone_snapshots_total"] >= 1
    assert m["clone_snapshot_seconds_count"] == m["clone_snapshots_total"]
    assert m["clone_snapshot_seconds_bucket{le=+Inf}"] == m["clone_snapshot_seconds_count"]
    assert m["clone_peer_up"] == 1
    before = m["clone_sequence"]

    _write(_endpoints(primary, backup), 25)
    m = metrics(primary)
    stats = read_stats(primary)
    assert m["clone_sequence"] == stats["sequence"] == before + 25
    assert m["clone_keys"] == stats["keys"] == 25
    assert m["clone_updates_total"] == stats["kvpub_published"] == 25
    assert m["clone_store_bytes"] == stats["store_bytes"] > 0
    assert m["clone_updates_refused_total{reason=invalid}"] == stats["kvset_invalid"]
    assert m["clone_pending"] == 0
    assert m["clone_failovers_total"] == 0
    # The client's and the backup's subscriptions (the client has closed by now).
    eventually(lambda: metrics(primary)["clone_subscribers"] >= 1, 30, "a subscriber counted")
    eventually(lambda: metrics(backup)["clone_sequence"] == before + 25, 30, "the backup in step")

    # Binary Star fails over when a client asks the backup (the vote): the writer.
    primary.kill9()
    _write(_endpoints(primary, backup), 5, "/after/")
    m = metrics(backup)
    assert m["clone_role{role=active}"] == 1
    assert m["clone_failovers_total"] == 1
    assert m["clone_role{role=passive}"] == 0
    eventually(lambda: metrics(backup)["clone_peer_up"] == 0, 30, "the dead peer noticed")
    m = metrics(backup)
    assert m["clone_sequence"] == before + 30
    assert m["clone_keys"] == read_stats(backup)["keys"] == 30


def test_health_and_readiness_on_both_servers(servers: Servers) -> None:
    primary, backup = http_pair(servers, "--in-memory")
    code, body = json_get(primary, "/healthz")
    assert code == 200 and body["role"] == "active" and isinstance(body["sequence"], int)
    code, body = json_get(backup, "/healthz")
    assert code == 200 and body["role"] == "passive"
    code, body = json_get(primary, "/readyz")
    assert code == 200 and body["ready"] is True
    # The passive is ready once in step (synced, nothing pending).
    eventually(lambda: json_get(backup, "/readyz")[0] == 200, 30, "the passive ready")
    assert json_get(backup, "/readyz")[1]["reason"].startswith("passive, in step")

    # Writes keep it in step; a stopped active leaves it passive until it takes over.
    _write(_endpoints(primary, backup), 10)
    eventually(lambda: json_get(backup, "/readyz")[0] == 200, 30, "the passive in step")
    primary.kill9()
    _write(_endpoints(primary, backup), 1, "/vote/")  # a client's request: the takeover vote
    eventually(lambda: json_get(backup, "/healthz")[1]["role"] == "active", 60, "takeover")
    code, body = json_get(backup, "/readyz")
    assert code == 200 and body["reason"] == "active"

    # The old primary comes back passive: not ready while it syncs, then ready.
    primary.restart()
    eventually(lambda: _get_or_none(primary, "/healthz") == 200, 60, "the primary back")
    eventually(lambda: json_get(primary, "/readyz")[0] == 200, 60, "the primary in step")
    code, body = json_get(primary, "/readyz")
    assert body["role"] == "passive" and body["ready"] is True


def _get_or_none(server: ServerProcess, path: str) -> int | None:
    try:
        return http_get(server, path)[0]
    except OSError:
        return None


def test_not_ready_while_starting(servers: Servers) -> None:
    """A primary alone, still waiting for its peer: alive, not ready (503 and why)."""
    port = free_port()
    primary = servers.spawn(
        "primary",
        [
            "--primary",
            "--port", str(free_base_port()),
            "--peer", f"127.0.0.1:{free_base_port()}",
            "--ha-port", str(free_port()),
            "--peer-ha", f"127.0.0.1:{free_port()}",
            "--http-port", str(port),
            "--peer-wait", "30",
            "--in-memory",
            *servers._common(),
        ],
        0,
        None,
    )  # fmt: skip
    HTTP_PORT[primary.name] = port
    eventually(lambda: _get_or_none(primary, "/healthz") == 200, 60, "the HTTP port up")
    code, body = json_get(primary, "/readyz")
    assert code == 503 and body["ready"] is False and body["role"] == "starting"
    assert "starting" in body["reason"]


def test_the_status_websocket_pushes_changes(servers: Servers) -> None:
    primary, backup = http_pair(servers, "--in-memory")

    async def watch() -> list[dict[str, Any]]:
        url = f"ws://127.0.0.1:{HTTP_PORT[primary.name]}/ws"
        conn = await websocket_connect(url)
        seen: list[dict[str, Any]] = []
        try:
            first = json.loads(await asyncio.wait_for(conn.read_message(), 5))  # type: ignore[arg-type]
            seen.append(first)
            loop = asyncio.get_running_loop()
            writer = loop.run_in_executor(None, _write, _endpoints(primary, backup), 5, "/ws/")
            deadline = loop.time() + 15
            while loop.time() < deadline:
                msg = await asyncio.wait_for(conn.read_message(), 5)
                assert msg is not None, "the server closed the status socket"
                seen.append(json.loads(msg))
                # The rate is sampled each push: under load the push that shows
                # the writes may come before a sample that spans them.
                if (
                    writer.done()
                    and seen[-1]["sequence"] >= first["sequence"] + 5
                    and any(rate > 0 for _, rate in seen[-1]["rate_history"])
                ):
                    break
            await writer
        finally:
            conn.close()
        return seen

    seen = asyncio.run(watch())
    first, last = seen[0], seen[-1]
    assert first["role"] == "active" and first["ready"] is True
    assert last["sequence"] == first["sequence"] + 5
    assert last["keys"] == first["keys"] + 5
    # Keys only, newest first, with their sequence; never a value.
    assert [c["key"] for c in last["recent"][:5]] == [f"/ws/{i}" for i in range(4, -1, -1)]
    assert last["recent"][0]["sequence"] == last["sequence"]
    assert "v4" not in json.dumps(last)
    assert last["role_changes"][-1]["to"] == "active"
    assert last["limits"]["max_keys"] > 0 and "kvpub_published" in last["counters"]
    assert any(rate > 0 for _, rate in last["rate_history"])


def test_calls_and_leases_in_the_metrics(servers: Servers) -> None:
    primary, backup = http_pair(servers, "--in-memory")
    with Clone(_endpoints(primary, backup), heartbeat=0.1) as client:
        client.wait_synced(10)
        seq = client.set("/cas", "1", if_sequence=0)
        with pytest.raises(Conflict):
            client.set("/cas", "2", if_sequence=seq + 1)
        lease = client.lease(5.0)
        m = metrics(primary)
        assert m["_types"]["clone_calls"] == "counter"
        assert m["clone_calls_total{result=ok}"] == 2
        assert m["clone_calls_total{result=conflict}"] == 1
        assert m["clone_leases"] == 1
        assert metrics(backup)["clone_leases"] == 0  # only the active keeps time
        # The client sends one every ttl / 3 (1.7 s); the ceiling only bounds a hang.
        eventually(lambda: metrics(primary)["clone_lease_keepalives_total"] >= 1, 30, "keepalives")
        lease.revoke()
        assert metrics(primary)["clone_leases"] == 0
        assert metrics(primary)["clone_leases_expired_total"] == 0
