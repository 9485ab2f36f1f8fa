"""The export's raw-CHP snapshot against real servers: exact at one sequence."""

from __future__ import annotations

import threading
import time

import pytest

from clone import Clone
from clone.pipeline.errors import InputError, ServersUnreachable
from clone.pipeline.snapshot import find_active, parse_servers, take_snapshot
from tests.ports import free_base_port
from tests.servers import ServerProcess, Servers, servers  # noqa: F401

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


def test_snapshot_is_exact_while_writes_go_on(servers: Servers) -> None:  # noqa: F811
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
                c.set(f"/w/{n}", f"v{n}", wait=True, timeout=5)
                c.set("/w/last", str(n), wait=True, timeout=5)
                written[0] = n

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        snaps = []
        deadline = time.monotonic() + 30
        while len(snaps) < 5:
            assert time.monotonic() < deadline and thread.is_alive(), "the writer is stuck"
            if written[0] > 20 * (len(snaps) + 1):
                snaps.append(take_snapshot(eps, "/w/", timeout=5))
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
        final = take_snapshot(eps, timeout=5)
        held = {e.key: (e.value, e.sequence) for e in c.entries()}
    assert {k: (m.body, m.sequence) for k, m in final.entries.items()} == held
