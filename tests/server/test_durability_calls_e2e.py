"""A confirmed call survives SIGKILL of both servers, right after its reply.

A call's reply (a compare-and-set's ``ok``) is its confirmation, as a KVPUB is
a KVSET's: it must not reach the caller before the update it names is
committed on the active server's disk.  A chaos run lost one: a CAS answered
``ok`` with sequence 7, both servers killed -9 half a second later, and both
restarted at sequence 6 (the commit mark said 6 too, so that commit had never
returned).  The client had resent the call while the server was busy, and a
retry's ``ok`` (a duplicate by uuid, which changes nothing) was sent at once,
while the first one's update still waited for its commit.

Here the active's commit is held up at will: another connection takes the
database's write lock (SQLite's, as a checkpoint on a slow disk does), so
the commit waits in ``BEGIN IMMEDIATE``.  A call and its retry are sent
meanwhile; no reply may come until the lock is released, and the moment the
reply comes both servers are killed.  On restart the update is there.  The
second test does the same with the client library, round after round.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq

from clone.errors import CloneError
from clone.wire.callnames import IF_SEQUENCE_PROPERTY
from clone.wire.calls import OP_SET, Reply, decode_reply, encode_call
from clone.wire.codec import new_uuid
from tests.server.test_durability_e2e import _snapshot, _start_both
from tests.support.clients import synced_client
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

KEY = "/cas/counter"
HB = 0.1


@contextmanager
def _commits_held(servers: Servers, server: ServerProcess) -> Iterator[sqlite3.Connection]:
    """Hold ``server``'s database write lock from another connection: its
    commits wait for it (the storage retries a busy ``BEGIN`` for up to 30 s)."""
    conn = sqlite3.connect(servers.data_dir(server.name) / "clone.db", isolation_level=None,
                           timeout=10)  # fmt: skip
    try:
        conn.execute("BEGIN IMMEDIATE")
        yield conn
    finally:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        conn.close()


def _reply(sock: zmq.Socket[bytes], timeout: float) -> Reply | None:
    if not sock.poll(int(timeout * 1000)):
        return None
    return decode_reply(sock.recv_multipart())


def _value_at(server: ServerProcess) -> tuple[bytes | None, int]:
    """``KEY``'s value and the sequence ``server`` serves."""
    with_key, _ = _snapshot(server, b"/cas/")
    _, sequence = _snapshot(server, b"/--none--/")
    return with_key.get(KEY.encode()), sequence


def _assert_kept(active: ServerProcess, reply: Reply, why: str = "") -> None:
    """``active``, restarted after both were killed, serves the value ``b"2"``
    the confirmed compare-and-set wrote, at its confirmed sequence."""
    value, sequence = _value_at(active)
    assert (value, sequence) == (b"2", reply.sequence), (
        f"a compare-and-set confirmed with sequence {reply.sequence} was lost when both"
        f" servers were killed right after its reply: {active.name} serves {value!r}"
        f" at sequence {sequence}{why}"
    )


def test_a_retried_call_is_confirmed_only_once_on_disk_and_survives_kill9_of_both(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{primary.port}")
    early: Reply | None = None
    try:
        sock.send_multipart(encode_call(OP_SET, new_uuid(), KEY, ((IF_SEQUENCE_PROPERTY, "0"),),
                                        b"1"))  # fmt: skip
        created = _reply(sock, 10)
        assert created is not None and created.ok, created
        before = read_stats(primary)
        with _commits_held(servers, primary):
            condition = ((IF_SEQUENCE_PROPERTY, str(created.sequence)),)
            frames = encode_call(OP_SET, new_uuid(), KEY, condition, b"2")
            sock.send_multipart(frames)
            sock.send_multipart(frames)  # the client's resend, same uuid

            def both_read() -> bool:
                stats = read_stats(primary)
                return stats["calls_duplicate"] > before["calls_duplicate"]  # type: ignore[operator]

            eventually(both_read, 15, "the call and its retry read by the active")
            # The update is applied but cannot be committed: nothing may confirm it.
            early = _reply(sock, 0.5)
            if early is not None:
                # Confirmed before its commit: show what that costs.
                primary.kill9()
                backup.kill9()
        reply = early if early is not None else _reply(sock, 15)
        assert reply is not None, "no reply once the commit could land"
        primary.kill9()  # the moment the reply came
        backup.kill9()
    finally:
        sock.close()
        ctx.term()
    assert reply.ok and reply.sequence == created.sequence + 1, reply
    active, _ = _start_both(primary, backup)
    why = " (it was confirmed while its commit could not land)" if early else ""
    _assert_kept(active, reply, why)
    assert early is None, f"a retry was confirmed before its commit landed: {early}"


def test_a_call_and_its_retry_queued_behind_a_held_commit_are_confirmed_once_on_disk(
    servers: Servers,
) -> None:
    """The chaos run's order: a commit in flight (held), a call and its
    retry waiting behind it.  When it lands, the look at the snapshot port's
    backlog after its confirmation reads the call and its retry in one go:
    the retry's ``ok`` must wait for the call's own commit.  (Before the
    retry waited, this order lost the call in 4 of 9 runs: its ``ok`` went
    at once, and the kill came before its commit, or not, as they raced.)"""
    primary, backup = servers.pair()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    sock.connect(f"tcp://127.0.0.1:{primary.port}")
    call_uuid = new_uuid()
    try:
        sock.send_multipart(encode_call(OP_SET, new_uuid(), "/cas/other", (), b"0"))
        assert _reply(sock, 10) is not None
        before = read_stats(primary)
        with _commits_held(servers, primary):
            sock.send_multipart(encode_call(OP_SET, new_uuid(), "/cas/other", (), b"1"))

            def first_applied() -> bool:
                return read_stats(primary)["calls_ok"] > before["calls_ok"]  # type: ignore[operator]

            eventually(first_applied, 15, "the first write applied, its commit held")
            frames = encode_call(OP_SET, call_uuid, KEY, ((IF_SEQUENCE_PROPERTY, "0"),), b"2")
            sock.send_multipart(frames)
            sock.send_multipart(frames)  # the client's resend, same uuid
            assert _reply(sock, 0.3) is None, "a reply before any commit could land"
        reply = None
        while reply is None:
            got = _reply(sock, 15)
            assert got is not None, "no reply once the commits could land"
            if got.uuid == call_uuid:
                reply = got
        primary.kill9()  # the moment the compare-and-set was confirmed
        backup.kill9()
    finally:
        sock.close()
        ctx.term()
    assert reply.ok, reply
    active, _ = _start_both(primary, backup)
    _assert_kept(active, reply)


@pytest.mark.parametrize("rounds", [3])
def test_cas_loops_killed_right_after_a_confirmation_lose_nothing(
    servers: Servers, rounds: int
) -> None:
    """The client library's compare-and-set in a loop; both servers killed -9
    right after a confirmation, restarted together; the key holds the last
    confirmed value and sequence.  Round after round, so a restart's data
    (either server's, the ranks decide) is written to and killed again."""
    primary, backup = servers.pair()
    value, sequence = 0, 0
    for round_ in range(rounds):
        with synced_client(primary, backup, heartbeat=HB) as c:
            for _ in range(15):
                try:
                    sequence = c.set(KEY, str(value + 1), if_sequence=sequence, timeout=5.0)
                except CloneError as exc:
                    pytest.fail(f"round {round_}: a compare-and-set on a healthy pair: {exc!r}")
                value += 1
            primary.kill9()  # right after the last confirmation
            backup.kill9()
        active, _ = _start_both(primary, backup)
        held, served = _value_at(active)
        assert (held, served) == (str(value).encode(), sequence), (
            f"round {round_}: confirmed {value} at sequence {sequence}, {active.name}"
            f" serves {held!r} at sequence {served} after kill -9 of both"
        )
