"""A relay that lost the pair refuses nothing silently.

A client that knows only the relay gets, while the relay is stale, a prompt
:class:`~clone.errors.WriteRefused` (reason ``stale``) for a confirmed write
and ``not-active`` for a call (our client then raises NotActive at its
deadline); the refused write is never applied, not even when the pair comes
back; readers keep the relay's last state.  Real processes on loopback with
100 ms heartbeats; every wait has a deadline; the fixture stops every server.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

from clone.errors import NotActive, WriteRefused
from clone.wire.calls import OP_SET, Reply, decode_reply, encode_call
from clone.wire.codec import Hugz, decode_update, new_uuid
from tests.support.clients import synced_client
from tests.support.servers import ServerProcess, Servers, read_stats
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def _stale(ctx: zmq.Context[Any], relay: ServerProcess) -> bool:
    """Whether the relay's next HUGZ says ``stale=1`` (False if none within 1 s)."""
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
    sub.connect(f"tcp://127.0.0.1:{relay.port + 1}")
    try:
        deadline = time.monotonic() + 1.0
        while (left := deadline - time.monotonic()) > 0:
            if sub.poll(int(left * 1000) + 1):
                msg = decode_update(sub.recv_multipart())
                if isinstance(msg, Hugz):
                    return msg.stale
        return False
    finally:
        sub.close(linger=0)


def _raw_cas(ctx: zmq.Context[Any], relay: ServerProcess) -> tuple[Reply, float]:
    """A compare-and-set on a raw DEALER: the relay's reply and how long it took."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{relay.port}")
    try:
        started = time.monotonic()
        sock.send_multipart(
            encode_call(OP_SET, new_uuid(), "/cas/raw", (("if_sequence", "0"),), b"x")
        )
        assert sock.poll(5000), "no reply from the relay"
        return decode_reply(sock.recv_multipart()), time.monotonic() - started
    finally:
        sock.close(linger=0)


def test_a_stale_relay_refuses_writes_at_once_and_never_applies_them_later(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    primary, backup = servers.pair()  # durable: the pair comes back with its state
    relay = servers.relay(primary, backup)
    with synced_client(relay) as client:
        client.set("/kept", "1", wait=True, timeout=10)
        primary.terminate()
        backup.terminate()
        eventually(lambda: _stale(ctx, relay), 10, "the relay stale")

        started = time.monotonic()
        with pytest.raises(WriteRefused) as refused:
            client.set("/refused", "x", wait=True, timeout=5)
        assert time.monotonic() - started < 1.0  # well under the 5 s confirm timeout
        assert (refused.value.reason, refused.value.key) == ("stale", "/refused")
        assert "lost the pair" in str(refused.value)
        client.set("/unconfirmed", "y")  # fire-and-forget: refused all the same

        # A call: the relay answers not-active at once; our client keeps asking
        # (a relay that regains the pair answers), then says NotActive.
        reply, took = _raw_cas(ctx, relay)
        assert (reply.status, reply.reason) == ("refused", "not-active"), reply
        assert reply.detail in ("relay has lost the pair", "relay has not synced with the pair")
        assert took < 1.0
        started = time.monotonic()
        with pytest.raises(NotActive):
            client.set("/cas", "z", if_sequence=0, timeout=1.0)
        assert time.monotonic() - started < 2.0

        # Readers keep the relay's last state: the live client, and a new one.
        assert client.get("/kept") == b"1"
        with synced_client(relay) as reader:
            assert reader.get("/kept") == b"1" and reader.get("/refused") is None

        offset = relay.log_size()
        primary.start()
        backup.start()
        relay.wait_log("synced from", timeout=20, after=offset)
        eventually(lambda: not _stale(ctx, relay), 10, "the relay fresh")
        # Forwarded after anything queued before it: once it is confirmed,
        # a write held back for the pair would have arrived too.
        client.set("/marker", "m", wait=True, timeout=10)
    with synced_client(primary, backup) as on_pair:
        assert on_pair.get("/marker") == b"m" and on_pair.get("/kept") == b"1"
        assert on_pair.get("/refused") is None and on_pair.get("/unconfirmed") is None
        assert on_pair.get("/cas") is None and on_pair.get("/cas/raw") is None
    stats = read_stats(relay)
    assert stats["kvset_refused_stale"] == 2, stats
    assert stats["calls_forward_not_synced"] >= 2, stats
    assert "refused a write: we have lost the pair (stale)" in relay.log_text()


def test_a_plain_relays_refusal_reaches_only_the_writer(
    servers: Servers, ctx: zmq.Context[Any]
) -> None:
    """Every subscriber of a plain relay gets its ``*`` notices; a client
    whose own confirmed write is not named goes on waiting for it."""
    primary, backup = servers.pair("--in-memory")
    relay = servers.relay(primary, backup)
    with synced_client(relay) as writer, synced_client(relay) as other:
        primary.kill9()
        backup.kill9()
        eventually(lambda: _stale(ctx, relay), 10, "the relay stale")
        with pytest.raises(WriteRefused):
            writer.set("/a", "1", wait=True, timeout=5)
        eventually(lambda: other.status().counters["refusals"] >= 1, 5, "the notice seen")
        assert other.status().counters["refused_writes"] == 0
        assert writer.status().counters["refused_writes"] == 1
