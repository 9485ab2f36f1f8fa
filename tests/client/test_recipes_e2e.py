"""``clone.recipes.Lock`` against a real server pair: first come, first served.

Each contender is a thread with its own `Clone` client.  Arrival order is made
certain, not hoped for: a gate holds the lock, and each contender is started
only once the one before it has its key in the replica (the key's value names
its thread, ``host:pid:thread``).  The gate then lets go, and the contenders
must get the lock in exactly that order, one at a time.
"""

from __future__ import annotations

import threading
import time
from contextlib import ExitStack
from itertools import pairwise

import pytest

from clone import Clone
from clone.recipes import Election, Lock
from tests.support.clients import synced_client
from tests.support.servers import Servers, start_both
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

NAME = "/locks/fair"
CONTENDERS = 4
HOLD = 0.1  # seconds each holder keeps the lock


def _waiting(client: Clone) -> list[str]:
    """The thread names of the keys under the lock, in their queue order."""
    entries = sorted(client.entries(NAME + "/"), key=lambda e: e.sequence)
    return [(e.value or b"").decode().rsplit(":", 1)[-1] for e in entries]


def test_contenders_get_the_lock_in_arrival_order_one_at_a_time(servers: Servers) -> None:
    primary, backup = servers.pair()
    held: list[tuple[str, int, int]] = []  # (thread, entered ns, left ns)
    inside = threading.Lock()  # taken without blocking: a second holder fails
    errors: list[BaseException] = []

    def contend(client: Clone) -> None:
        try:
            with Lock(client, NAME, ttl=2.0) as lock:
                if not inside.acquire(blocking=False):
                    raise AssertionError("two holders at once")
                entered = time.monotonic_ns()
                time.sleep(HOLD)
                assert lock.held
                left = time.monotonic_ns()
                inside.release()
                held.append((threading.current_thread().name, entered, left))
        except BaseException as exc:
            errors.append(exc)

    with ExitStack() as stack:
        gate_client = stack.enter_context(synced_client(primary, backup))
        clients = [stack.enter_context(synced_client(primary, backup)) for _ in range(CONTENDERS)]
        gate = Lock(gate_client, NAME, ttl=2.0)
        assert gate.acquire(timeout=5)
        names = [f"contender-{i}" for i in range(CONTENDERS)]
        threads = [
            threading.Thread(target=contend, args=(c,), name=n, daemon=True)
            for c, n in zip(clients, names, strict=True)
        ]
        try:
            for i, thread in enumerate(threads):
                thread.start()
                queued = ["MainThread", *names[: i + 1]]
                eventually(lambda q=queued: _waiting(gate_client) == q, 10, f"{queued} queued")
            time.sleep(3 * HOLD)  # long enough for a wrong waiter to jump in
            assert held == [] and errors == []
            gate.release()
            for thread in threads:
                thread.join(15)
                assert not thread.is_alive(), f"{thread.name} never got the lock"
        finally:
            gate.release()
        assert errors == []
        assert [name for name, _, _ in held] == names
        for (_, _, left), (_, entered, _) in pairwise(held):
            assert left < entered, "a holder came in before the previous one left"
        eventually(lambda: gate_client.entries(NAME + "/") == [], 5, "every key gone")


def test_fencing_tokens_grow_from_holder_to_holder_across_failover_and_restart(
    servers: Servers,
) -> None:
    """Each new holder's token is higher: one after another, across a kill -9
    of the active while a holder holds (it releases on the promoted backup),
    and across a kill -9 and restart of both durable servers."""
    primary, backup = servers.pair()
    tokens: list[int] = []

    def hold_once(client: Clone) -> None:
        lock = Lock(client, "/locks/fenced", ttl=2.0)
        assert lock.token is None
        assert lock.acquire(timeout=10)
        assert lock.token is not None
        tokens.append(lock.token)
        lock.release()
        assert lock.token is None

    with synced_client(primary, backup) as a, synced_client(primary, backup) as b:
        hold_once(a)
        hold_once(b)
        holder = Lock(a, "/locks/fenced", ttl=2.0)
        assert holder.acquire(timeout=10) and holder.token is not None
        tokens.append(holder.token)
        waiter = Lock(b, "/locks/fenced", ttl=2.0)
        got: list[int | None] = []
        thread = threading.Thread(
            target=lambda: got.append(waiter.token if waiter.acquire(timeout=30) else None),
            daemon=True,
        )
        thread.start()
        eventually(lambda: len(b.entries("/locks/fenced/")) == 2, 10, "the waiter queued")
        primary.kill9()
        backup.wait_log("now ACTIVE", 15)
        eventually(lambda: holder.held, 10, "the holder still holds on the promoted backup")
        holder.release()
        thread.join(30)
        assert got and got[0] is not None, "the waiter never got the lock"
        tokens.append(got[0])
        waiter.release()
        with Election(a, "/elections/fenced", "a", ttl=2.0) as first:
            assert first.wait_leader(10) and first.token is not None
            tokens.append(first.token)
            with Election(b, "/elections/fenced", "b", ttl=2.0) as second:
                eventually(lambda: len(b.entries("/elections/fenced/")) == 2, 10, "b stands")
                first.resign()
                assert second.wait_leader(10) and second.token is not None
                tokens.append(second.token)
    backup.kill9()
    start_both(primary, backup)
    with synced_client(primary, backup) as c:
        hold_once(c)
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens
