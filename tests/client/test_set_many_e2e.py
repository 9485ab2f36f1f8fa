"""``set-many`` (issue 29) end to end: a BulkWriter's batches against a real
durable pair killed mid-load, a restricted CURVE client's batch, and the
fall-back to a ``set`` per row against a server that does not know the call.

Every server is stopped by the fixture; every socket closed with linger 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clone import Clone
from clone.client.writeonly import BulkWriter
from clone.errors import CloneError
from clone.security.keys import load_curve_keys
from clone.wire.calls import (
    OP_SET_MANY,
    Reply,
    decode_call,
    decode_reply,
    encode_call,
    encode_reply,
    encode_set_many,
)
from clone.wire.codec import new_uuid
from clone.wire.protocol import HUGZ
from tests.support.clients import endpoint
from tests.support.curve import CurveKeys, curve_socket, wait_serving_curve
from tests.support.ports import free_base_port
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

_Settled = dict[bytes, "int | BaseException"]


def _load(
    writer: BulkWriter,
    rows: dict[str, bytes],
    *,
    window: int = 512,
    after: int | None = None,
    then: Any = None,
    ceiling: float = 180.0,
) -> tuple[dict[bytes, str], _Settled]:
    """Write every row with ``window`` outstanding; call ``then()`` once when
    ``after`` rows have been confirmed.  Returns (uuid -> key, uuid -> result)."""
    sent: dict[bytes, str] = {}
    settled: _Settled = {}
    fired = False

    def collect(results: list[tuple[bytes, int | BaseException]]) -> None:
        nonlocal fired
        settled.update(results)
        if not fired and after is not None and len(settled) >= after:
            fired = True
            then()

    for key, value in rows.items():
        while writer.outstanding >= window:
            collect(writer.poll(1.0))
        sent[writer.submit(key, value)] = key
    deadline = time.monotonic() + ceiling
    while writer.outstanding and time.monotonic() < deadline:
        collect(writer.poll(1.0))
    assert writer.outstanding == 0, f"{writer.outstanding} rows never settled"
    return sent, settled


@pytest.mark.slow
def test_a_batched_load_survives_a_failover_with_no_row_lost_or_applied_twice(
    servers: Servers,
) -> None:
    primary, backup = servers.pair()
    rows = {f"/load/node-{i:06d}/cpu": f"{i:06d}".encode() * 12 for i in range(20_000)}
    # A reader subscribed to a quiet subtree: its snapshot request after the
    # primary's death is the vote that promotes the backup, as a loader's
    # driver or any other client gives (a write-only client never votes).
    with Clone([endpoint(primary), endpoint(backup)], subtree="/quiet/") as voter:
        voter.wait_synced(30)
        writer = BulkWriter([endpoint(primary), endpoint(backup)], server_timeout=1.0,
                            dead_after=60.0, confirm_timeout=90.0, batch_rows=64)  # fmt: skip
        try:
            writer.wait_synced(30)
            sent, settled = _load(writer, rows, after=6_000, then=primary.kill9)
            again, given_up = writer.reconfirmed
        finally:
            writer.close()
    # The last writes the primary confirmed went to the backup again (it
    # applies those it never received); none was refused or lost there.
    assert again > 0 and given_up == 0
    assert not primary.alive
    failed = {sent[u]: r for u, r in settled.items() if isinstance(r, BaseException)}
    assert failed == {}, list(failed.items())[:3]
    assert set(settled) == set(sent)
    stats = read_stats(backup)
    # Every row is in the store once: 20,000 updates in all (a row applied
    # twice would take a second sequence), and each key holds its row.
    assert stats["sequence"] == len(rows), stats["sequence"]
    assert int(stats["set_many_calls"]) > 0  # type: ignore[call-overload]  # batches went there too
    with Clone([endpoint(backup)], subtree="/load/") as reader:
        reader.wait_synced(60)
        got = {k: bytes(v) for k, v in reader.items("/load/")}
    assert got == rows
    # Confirmed sequences are each row's own: distinct, none zero.
    sequences = [r for r in settled.values() if isinstance(r, int)]
    assert len(set(sequences)) == len(rows) and min(sequences) > 0


@pytest.fixture
def keys(tmp_path: Path) -> CurveKeys:
    keys = CurveKeys.make(tmp_path / "keys", admitted=("admin", "writer"))
    # The writer reads everything (a write-only client hears HUGZ only, which
    # a connection whose reads are restricted is never given) and may write
    # only under /nodes/.
    keys.write_acl({"admin": ([""], [""]), "writer": ([""], ["/nodes/"])})
    return keys


@pytest.fixture
def secure(servers: Servers, keys: CurveKeys) -> ServerProcess:
    server = servers.standalone(*keys.server_args(), "--in-memory", wait=False)
    wait_serving_curve(server, keys)
    return server


@pytest.mark.slow
def test_a_restricted_client_cannot_write_outside_its_prefix_through_a_batch(
    secure: ServerProcess, keys: CurveKeys
) -> None:
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = curve_socket(ctx, zmq.DEALER, keys, "writer")
    try:
        dealer.connect(endpoint(secure))
        # One key outside /nodes/, between two inside: the whole batch is refused.
        body = encode_set_many([(new_uuid(), b"/nodes/a", b"", b"1"),
                                (new_uuid(), b"/admin/password", b"", b"pwned"),
                                (new_uuid(), b"/nodes/b", b"", b"2")])  # fmt: skip
        call_id = new_uuid()
        dealer.send_multipart(encode_call(OP_SET_MANY, call_id, "", (), body))
        assert dealer.poll(30_000), "no reply to the set-many"
        reply = decode_reply(dealer.recv_multipart())
        assert (reply.uuid, reply.status, reply.reason) == (call_id, "refused", "acl")
        assert "/admin/password" in reply.detail
    finally:
        dealer.close(linger=0)
        ctx.term()
    # The BulkWriter, refused a batch, sends each row alone: the rows inside
    # its prefix are stored, the one outside is refused, by the server, alone.
    writer = BulkWriter([endpoint(secure)], batch_rows=64,
                        curve=load_curve_keys(keys.secret("writer"), keys.pair_public))  # fmt: skip
    rows = {f"/nodes/n{i:03d}": b"v" for i in range(100)}
    rows["/admin/password"] = b"pwned"
    try:
        writer.wait_synced(30)
        sent, settled = _load(writer, rows, window=256, ceiling=60.0)
    finally:
        writer.close()
    outcome = {sent[u]: r for u, r in settled.items()}
    refused = outcome.pop("/admin/password")
    assert isinstance(refused, CloneError) and "acl" in str(refused)
    assert all(isinstance(r, int) and r > 0 for r in outcome.values())
    with Clone([endpoint(secure)], **keys.client("admin")) as admin:
        admin.wait_synced(30)
        eventually(lambda: len(admin.items("/nodes/")) == 100, 30, "the allowed rows")
        assert admin.get("/admin/password") is None
    # The raw batch, the writer's batch, and its row alone.
    assert int(read_stats(secure)["calls_refused_acl"]) >= 3  # type: ignore[call-overload]


class _OlderServer:
    """A server of ours from before ``set-many``, on real sockets: HUGZ on
    its publisher, and on its snapshot port the old rule for a call it does
    not know (``malformed``, "unknown CALL? operation"); a ``set`` is ``ok``
    with the next sequence.  A thread of the test's own."""

    def __init__(self) -> None:
        self.port = free_base_port()
        self.sets: list[str] = []
        self.refused = 0
        self._ctx: zmq.Context[Any] = zmq.Context()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def _run(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        pub = self._ctx.socket(zmq.PUB)
        for sock in (router, pub):
            sock.linger = 0
        router.bind(f"tcp://127.0.0.1:{self.port}")
        pub.bind(f"tcp://127.0.0.1:{self.port + 1}")
        self._ready.set()
        try:
            while not self._stop.is_set():
                pub.send_multipart([HUGZ, bytes(8), b"", b"", b""])
                if not router.poll(50):
                    continue
                identity, *frames = router.recv_multipart()
                uuid = frames[2]
                if frames[1] == OP_SET_MANY.encode():
                    self.refused += 1
                    answer = Reply(uuid, "refused", reason="malformed",
                                   detail="unknown CALL? operation 'set-many'")  # fmt: skip
                else:
                    self.sets.append(decode_call(frames).key)
                    answer = Reply(uuid, "ok", len(self.sets))
                router.send_multipart([identity, *encode_reply(answer)])
        finally:
            router.close(linger=0)
            pub.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._ctx.term()


@pytest.fixture
def older() -> Iterator[_OlderServer]:
    server = _OlderServer()
    try:
        yield server
    finally:
        server.close()


def test_against_a_server_that_does_not_know_set_many_each_row_goes_alone(
    older: _OlderServer,
) -> None:
    writer = BulkWriter([f"tcp://127.0.0.1:{older.port}"], batch_rows=16)
    rows = {f"/old/k{i:03d}": b"v" for i in range(200)}
    try:
        writer.wait_synced(30)
        _sent, settled = _load(writer, rows, window=64, ceiling=60.0)
    finally:
        writer.close()
    assert all(isinstance(r, int) and r > 0 for r in settled.values())
    assert sorted(older.sets) == sorted(rows)  # each row once, as a set
    # Refused once or a few times (the batches already on their way), then never asked again.
    assert 1 <= older.refused <= 4
