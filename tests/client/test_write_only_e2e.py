"""Write-only ACL prefixes, on a real CURVE server.

The writer's ACL is ``read = ["/public/"]``, ``write = ["/nodes/"]``: it may
write keys it may never see.  A confirmed write, a compare-and-set and a lock
in ``/nodes/`` are confirmed to it by a REPLY (never by its KVPUB, which its
filtered stream does not carry), and its replica never shows the values; the
``clone`` command does the same (exit 0, not "not confirmed", and no hang).

Every server is stopped by the fixture, every process waited for.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clone import Clone, Conflict
from clone.recipes import Lock
from tests.support.clients import endpoint
from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.servers import ROOT, ServerProcess, Servers
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    keys = CurveKeys.make(tmp_path / "keys", admitted=("admin", "writer", "writer2"))
    write_only = (["/public/"], ["/nodes/"])
    keys.write_acl({"admin": ([""], [""]), "writer": write_only, "writer2": write_only})
    return keys


@pytest.fixture
def server(servers: Servers, keys: CurveKeys) -> ServerProcess:
    server = servers.standalone(*keys.server_args(), "--in-memory", wait=False)
    wait_serving_curve(server, keys)
    return server


def _client(server: ServerProcess, keys: CurveKeys, name: str) -> Clone:
    client = Clone([endpoint(server)], heartbeat=HB, confirm_timeout=5.0, **keys.client(name))
    try:
        client.wait_synced(10)
    except BaseException:
        client.close()
        raise
    return client


def test_a_write_only_client_confirms_writes_and_cas_without_seeing_them(
    server: ServerProcess, keys: CurveKeys
) -> None:
    with _client(server, keys, "admin") as admin, _client(server, keys, "writer") as writer:
        sequence = writer.set("/nodes/web1", "10.0.0.5", wait=True)
        assert sequence > 0
        eventually(lambda: admin.get("/nodes/web1") == b"10.0.0.5", 5, "the admin sees it")
        entry = admin.entry("/nodes/web1")
        assert entry is not None and entry.sequence == sequence
        assert writer.set_async("/nodes/web2", "10.0.0.6").result(10) > sequence
        created = writer.set("/nodes/cas", "1", if_sequence=0)
        with pytest.raises(Conflict):
            writer.set("/nodes/cas", "2", if_sequence=0)
        assert writer.set("/nodes/cas", "2", if_sequence=created) > created
        assert writer.delete("/nodes/web2", wait=True) > 0
        eventually(lambda: admin.get("/nodes/cas") == b"2", 5, "the admin sees the CAS")
        # Never shown to the writer.
        assert writer.items("/nodes/") == [] and writer.get("/nodes/web1") is None
        status = writer.status()
        assert status.counters["writes_as_calls"] == 3
        assert (status.gaps, status.resyncs) == (0, 0)


def test_write_only_clients_take_turns_on_a_lock(server: ServerProcess, keys: CurveKeys) -> None:
    with _client(server, keys, "writer") as first, _client(server, keys, "writer2") as second:
        held = Lock(first, "/nodes/lk", ttl=2.0)
        assert held.acquire(timeout=10)
        waiter = Lock(second, "/nodes/lk", ttl=2.0)
        assert not waiter.acquire(timeout=0.5)  # told by the server: one is ahead
        held.release()
        assert waiter.acquire(timeout=10)
        assert waiter.held
        waiter.release()


def _clone_cli(
    server: ServerProcess, keys: CurveKeys, *argv: str
) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "clone.client.cli", "--heartbeat", "0.1",
         "--servers", endpoint(server), "--curve-secret", str(keys.secret("writer")),
         "--server-key", str(keys.pair_public), *argv],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )  # fmt: skip


def test_the_clone_command_sets_and_locks_in_a_write_only_prefix(
    server: ServerProcess, keys: CurveKeys
) -> None:
    done = _clone_cli(server, keys, "set", "/nodes/web1", "10.0.0.5")
    assert (done.returncode, done.stderr) == (0, "")
    locked = _clone_cli(server, keys, "lock", "/nodes/lk", "--", "echo", "hi")
    assert (locked.returncode, locked.stdout.strip()) == (0, "hi"), locked.stderr
    with _client(server, keys, "admin") as admin:
        assert admin.get("/nodes/web1") == b"10.0.0.5"
        eventually(lambda: admin.items("/nodes/lk/") == [], 5, "the lock's key gone")
