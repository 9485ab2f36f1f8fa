"""A rolling restart must never revert a confirmed write.

The steps of an ordinary rolling upgrade, with real ``clone-server`` processes:
a writer keeps overwriting a few keys with confirmed writes; the passive server
is restarted; once it has synced, the active server is stopped and the restarted
one takes over.  Every key must then hold its last confirmed value or a later
one.  Before the fix the promoted server re-applied updates that the active had
already applied and superseded (they stayed in its pending list), and every key
went back to an old value.
"""

from __future__ import annotations

import signal
import threading

import pytest

from clone import Clone
from clone.errors import CloneError
from tests.support.clients import raw_peer, synced_client
from tests.support.servers import ServerProcess, Servers, active_and_passive, wait_role
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1
KEYS = 20



class _Overwriter:
    """Overwrites ``/r/0`` .. ``/r/{KEYS-1}`` with confirmed writes ``v<n>``, round
    robin, and remembers the last confirmed counter of every key."""

    def __init__(self, c: Clone) -> None:
        self.client = c
        self.confirmed: dict[str, int] = {}
        self.count = 0  # confirmed writes
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="overwriter", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            key = f"/r/{n % KEYS}"
            try:
                self.client.set(key, f"v{n}", wait=True, timeout=5.0)
            except CloneError:
                pass  # not confirmed during a takeover: the next round writes it again
            else:
                self.confirmed[key] = n
                self.count += 1
            n += 1

    def __enter__(self) -> _Overwriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the writer did not stop"




def _values(server: ServerProcess) -> dict[str, int]:
    """The ``/r/`` keys the server holds, as their write counters."""
    with raw_peer() as peer:
        peer.use_snapshot_server(server.port)
        snap = peer.snapshot(b"/r/", timeout=10.0)
    return {k.decode(): int(v.body.decode().removeprefix("v")) for k, v in snap.entries.items()}


def _preload(server: ServerProcess, count: int) -> None:
    """``count`` keys under ``/big/``, so that a sync takes a while."""
    with raw_peer() as peer:
        peer.connect(server.port, collectors=[server.port])
        for i in range(count):
            peer.kvset(b"/big/%d" % i, b"x" * 32)
        # The collector applies in order: once the marker is in, so is the rest.
        peer.kvset(b"/marker/done", b"1")
        eventually(
            lambda: b"/marker/done" in peer.snapshot(b"/marker/", timeout=10.0).entries,
            120,  # 200,000 writes: 47 s on a machine at load average 20
            "the preload",
        )


def _reverted(confirmed: dict[str, int], final: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Keys behind their last confirmed write: key -> (value held, confirmed)."""
    return {k: (final.get(k, -1), n) for k, n in confirmed.items() if final.get(k, -1) < n}


def _assert_no_revert(confirmed: dict[str, int], server: ServerProcess) -> None:
    """Every key at its last confirmed value or later, once the new active has
    taken in what was in flight to it when the old one died (docs/failover.md:
    a client's copy still inside the kernel or libzmq is applied as it lands)."""
    last: dict[str, tuple[int, int]] = {}

    def caught_up() -> bool:
        nonlocal last
        last = _reverted(confirmed, _values(server))
        return not last

    try:
        eventually(caught_up, 3.0, "every key at its last confirmed value")
    except AssertionError:
        raise AssertionError(f"keys behind their last confirmed write: {last}") from None


def _let_writes_flow(w: _Overwriter, count: int = 200, timeout: float = 20.0) -> None:
    start = w.count
    eventually(lambda: w.count - start >= count, timeout, f"{count} more confirmed writes")


def _stop_and_take_over(
    w: _Overwriter, a: ServerProcess, b: ServerProcess, sig: int
) -> tuple[ServerProcess, ServerProcess]:
    """Stop the active one of ``a`` and ``b`` with ``sig``; the passive must
    take over with every key at its last confirmed value or later.
    ``(stopped, survivor)``.

    Which one is active is asked, not assumed: on a busy machine both can
    starve past the pair's expiry (4 x 100 ms), the passive takes a client's
    vote and wins the split brain (docs/failover.md, "Fast failover on a lost
    connection"), and a test that stopped the server it expected to be active
    waited 60 s for a "now ACTIVE" the survivor had written before."""
    active, passive = active_and_passive(a, b)
    before = dict(w.confirmed)
    active.signal(sig)
    active.terminate(5)
    wait_role(passive, "active")
    _assert_no_revert(before, passive)
    _let_writes_flow(w)
    return active, passive


def _restart(server: ServerProcess, sig: int) -> None:
    """Stop ``server`` with ``sig`` (if running), start it, wait until it synced."""
    offset = server.log_size()
    server.signal(sig)
    server.terminate(5)
    server.start()
    server.wait_log("synced from", timeout=60, after=offset)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill9"])
def test_restart_passive_then_stop_active_keeps_confirmed_values(
    servers: Servers, sig: int
) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c, _Overwriter(c) as w:
        _let_writes_flow(w)
        # 1. restart the passive under load
        _restart(active_and_passive(primary, backup)[1], sig)
        _let_writes_flow(w)
        # 2. stop the active: the restarted passive takes over
        stopped, _ = _stop_and_take_over(w, primary, backup, sig)
        # 3. bring the old active back (it must follow) and stop the other role too
        _restart(stopped, sig)
        _let_writes_flow(w)
        _, survivor = _stop_and_take_over(w, primary, backup, sig)
    assert len(w.confirmed) == KEYS, f"only {len(w.confirmed)} keys were ever confirmed"
    _assert_no_revert(w.confirmed, survivor)


def test_restart_passive_during_a_large_snapshot_keeps_confirmed_values(
    servers: Servers,
) -> None:
    # In memory: a durable passive restarts from its disk and catches up
    # (KVDELTA) instead of taking a snapshot, and then no kill ever landed in
    # one (its log said "catch-up" every time); it also loaded 200,000 keys from
    # SQLite at each start.  In memory each start takes the whole state.
    primary, backup = servers.pair("--in-memory")
    _preload(primary, 200_000)
    with synced_client(primary, backup, heartbeat=HB) as c, _Overwriter(c) as w:
        _let_writes_flow(w)
        offset = backup.log_size()
        backup.kill9()
        backup.start()
        # Kill it again in the middle of its snapshot, then let it sync.
        backup.wait_log("asked", timeout=60, after=offset)
        _restart(backup, signal.SIGKILL)
        _let_writes_flow(w)
        _, survivor = _stop_and_take_over(w, primary, backup, signal.SIGKILL)
    _assert_no_revert(w.confirmed, survivor)
