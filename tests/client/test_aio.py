"""clone.aio against a real server: awaited writes, reads with nothing to
await, change streams, leases, Lock, Election and Registration (pytest-asyncio)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from clone import Conflict, NotJSON, NotSynced
from clone.aio import AsyncClone, Election, Lock, Registration
from clone.errors import ClosedError
from tests.support.clients import endpoint
from tests.support.servers import ServerProcess, Servers

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]


@pytest.fixture
def server(servers: Servers) -> ServerProcess:
    """A server of the test's own (one it restarts)."""
    return servers.standalone("--in-memory")


@pytest.fixture(scope="module")
def shared(module_servers: Servers) -> ServerProcess:
    """One server for the tests that only read and write it, each under key,
    lock and election names of its own (a server start is about 0.2 CPU-s)."""
    return module_servers.standalone("--in-memory")


#: The tests of ``shared``, on one xdist worker so that it starts once.
SHARED = pytest.mark.xdist_group("test_aio_shared")


@SHARED
async def test_set_then_get_sees_it_and_json_round_trips(shared: ServerProcess) -> None:
    async with AsyncClone(endpoint(shared), heartbeat=0.1) as c:
        seq = await c.set("/config/flag", b"on")
        assert seq > 0
        assert c.get("/config/flag") == b"on"  # a read after a confirmed write sees it
        value, fresh = c.get("/config/flag", with_status=True)
        assert value == b"on" and fresh.synced and fresh.state == "active"
        entry = c.entry("/config/flag")
        assert entry is not None and entry.sequence == seq and entry.freshness is not None
        await c.set_json("/config/app", {"limit": 3, "names": ["a", "é"]})
        assert c.get_json("/config/app") == {"limit": 3, "names": ["a", "é"]}
        assert c.get_json("/config/missing", {"d": 1}) == {"d": 1}
        with pytest.raises(NotJSON):
            await c.set_json("/config/bad", {1, 2})
        with pytest.raises(NotJSON, match="not a JSON document"):
            c.get_json("/config/flag")
        with pytest.raises(Conflict):
            await c.set("/config/flag", b"x", if_sequence=seq - 1 if seq > 1 else 999)
        assert await c.set("/config/flag", b"off", if_sequence=seq) > seq
        assert await c.delete("/config/flag") > seq
        assert c.get("/config/flag") is None
        assert ("/config/app", b'{"limit":3,"names":["a","\xc3\xa9"]}') in await c.items("/config/")
    with pytest.raises(ClosedError):
        c.get("/config/app")


@SHARED
async def test_changes_stream_and_since(shared: ServerProcess) -> None:
    async with AsyncClone(endpoint(shared), heartbeat=0.1) as c:
        first = await c.set("/a/0", b"zero")
        async with c.changes("/a/") as stream:
            await c.set("/b/x", b"elsewhere")
            await c.set("/a/1", b"one")
            change = await asyncio.wait_for(anext(stream), 10)
            assert (change.key, change.value) == ("/a/1", b"one")
        replay = c.changes("/a/", since=first - 1)
        seen = [await asyncio.wait_for(anext(replay), 10) for _ in range(2)]
        assert [e.key for e in seen] == ["/a/0", "/a/1"]
        await replay.aclose()


@SHARED
async def test_lease_lock_and_election(shared: ServerProcess) -> None:
    async with AsyncClone(endpoint(shared), heartbeat=0.1) as c:
        lease = await c.lease(1.0)
        await c.set("/svc/me", b"1", lease=lease)
        assert c.entry("/svc/me") is not None
        lease.revoke()
        deadline = time.monotonic() + 10
        while c.get("/svc/me") is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # a loop waiting on a condition, with a ceiling
        assert c.get("/svc/me") is None
        async with Lock(c, "/locks/a", ttl=1.0) as lock:
            assert lock.held and lock.token is not None
        assert not lock.held
        election = Election(c, "/el/a", "me", ttl=1.0)
        async with election:
            leaders = election.__aiter__()
            leader = await asyncio.wait_for(anext(leaders), 10)
            while leader != "me":
                leader = await asyncio.wait_for(anext(leaders), 10)
            assert election.is_leader and election.token is not None
            await leaders.aclose()


async def _until(condition: Callable[[], bool], ceiling: float, what: str) -> None:
    deadline = time.monotonic() + ceiling
    while not condition():
        assert time.monotonic() < deadline, f"not within {ceiling} s: {what}"
        await asyncio.sleep(0.02)


async def test_registration_to_await_comes_back_after_the_server_forgets_its_lease(
    server: ServerProcess,
) -> None:
    """Registered on entering, registered again (fresh lease) after the
    in-memory server restarted knowing no leases, and gone on leaving."""
    lost: list[str] = []
    async with AsyncClone(endpoint(server), heartbeat=0.1) as c:
        async with Registration(c, "/svc/web", "127.0.0.1:80", ttl=1.0, on_lost=lost.append) as reg:
            first = reg.lease
            assert reg.alive and first is not None and c.get("/svc/web") == b"127.0.0.1:80"
            await asyncio.to_thread(server.restart)  # the test's own wait, not the client's
            await c.wait_synced(20)
            await _until(lambda: bool(lost), 20, "on_lost ran")
            await _until(
                lambda: reg.alive and reg.lease is not first and c.get("/svc/web") is not None,
                20,
                "registered again",
            )
        assert not reg.alive
        await _until(lambda: c.get("/svc/web") is None, 10, "registration revoked")


@SHARED
async def test_reads_take_microseconds_on_the_loop(shared: ServerProcess) -> None:
    """No round trip to the agent: measured, with a ceiling generous enough for a
    busy machine (the target, and what a quiet one does, is far lower)."""
    async with AsyncClone(endpoint(shared), heartbeat=0.1) as c:
        await c.set("/flags/x", b"1")
        n = 20_000
        start = time.perf_counter()
        for _ in range(n):
            c.get("/flags/x")
        per_read = (time.perf_counter() - start) / n
        assert per_read < 50e-6, f"{per_read * 1e6:.1f} µs per read"


async def test_require_synced_and_wait_synced_without_a_server() -> None:
    async with AsyncClone("tcp://127.0.0.1:9", sync_timeout=None, heartbeat=0.1) as c:
        assert c.get("/k", b"default") == b"default"
        value, fresh = c.get("/k", with_status=True)
        assert value is None and not fresh.synced
        with pytest.raises(NotSynced, match="not synced"):
            c.get("/k", require_synced=True)
        with pytest.raises(NotSynced, match=r"tried tcp://127\.0\.0\.1:9"):
            await c.wait_synced(0.3)
