"""A relay's pure rules: when to give up an upstream, when to say stale, its
flags and config, and the ``stale`` HUGZ property (docs/operations.md, "Relays")."""

from __future__ import annotations

import pytest

from clone.security.acl import Rights
from clone.server.access import call_refusal
from clone.server.cli import build_parser, config_from_args
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import FollowOutcome, Role, ServerCore, SyncState
from clone.server.inflight import InFlight
from clone.server.relayrules import forward_refusal, relay_stale, upstream_lost
from clone.wire.calls import OP_LEASE_GRANT, OP_LEASE_KEEPALIVE, OP_SET, encode_call
from clone.wire.codec import Hugz, KVMsg, decode_update, encode_hugz, encode_kv, new_uuid


def _lost(now: float, *, syncing: bool) -> bool:
    return upstream_lost(
        now=now,
        syncing=syncing,
        sync_started=10.0,
        sync_timeout=2.0,
        heard=10.0,
        heartbeat=0.25,
        missed=4,
    )


@pytest.mark.parametrize(
    ("now", "syncing", "lost"),
    [
        (10.9, False, False),  # synced: silent for less than 4 heartbeats
        (11.0, False, True),  # synced: silent for 4 heartbeats
        (11.5, True, False),  # syncing: the sync timeout decides, not silence
        (12.0, True, True),  # syncing: no answer within the sync timeout
    ],
)
def test_when_a_relay_gives_up_its_upstream(now: float, syncing: bool, lost: bool) -> None:
    assert _lost(now, syncing=syncing) is lost


@pytest.mark.parametrize(
    ("now", "synced_once", "upstream_stale", "stale"),
    [
        (10.5, True, False, False),
        (11.0, True, False, True),  # silent upstream
        (10.5, False, False, True),  # never synced: nothing to vouch for
        (10.5, True, True, True),  # a stale relay upstream
    ],
)
def test_when_a_relay_is_stale(
    now: float, synced_once: bool, upstream_stale: bool, stale: bool
) -> None:
    got = relay_stale(
        now=now,
        synced_once=synced_once,
        heard=10.0,
        heartbeat=0.25,
        missed=4,
        upstream_stale=upstream_stale,
    )
    assert got is stale


@pytest.mark.parametrize(
    ("stale", "queued", "why"),
    [
        (False, True, None),  # forwarded
        (False, False, "overloaded"),  # the PUB's queue was full (XPUB_NODROP)
        (True, False, "stale"),  # nothing is even offered to the PUB
        (True, True, "stale"),
    ],
)
def test_when_a_relay_refuses_a_write(stale: bool, queued: bool, why: str | None) -> None:
    assert forward_refusal(stale=stale, queued=queued) == why


def test_the_stale_property_round_trips() -> None:
    assert decode_update(encode_hugz(7, 250, stale=True)) == Hugz(7, 0.25, True)
    assert decode_update(encode_hugz(7, 250)) == Hugz(7, 0.25, False)
    assert decode_update([b"HUGZ", (1).to_bytes(8, "big"), b"", b"stale=0\n", b""]) == Hugz(1)


def _relay_args(*extra: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(["--relay", *extra]))


def test_relay_flags() -> None:
    cfg = _relay_args("--port", "7000", "--upstream", "h1:5556, h2:5566")
    assert cfg.mode is ServerMode.RELAY
    assert cfg.upstream == ("h1:5556", "h2:5566")
    assert cfg.data_dir is None  # in memory: it resyncs from the pair at start


@pytest.mark.parametrize(
    "extra",
    [
        (),  # no upstream
        ("--upstream", "h:5556", "--data-dir", "x"),
        ("--upstream", "h:5556", "--peer", "h:5566"),
        ("--upstream", "h:5556", "--ha-port", "5003"),
    ],
)
def test_relay_flags_refused(extra: tuple[str, ...]) -> None:
    with pytest.raises(ValueError):
        _relay_args(*extra)


def test_upstream_without_relay_is_refused() -> None:
    with pytest.raises(ValueError, match="relay"):
        config_from_args(build_parser().parse_args(["--standalone", "--upstream", "h:5556"]))


def test_relay_curve_flags_each_side() -> None:
    # Downstream (its own server key, clients, ACL) and upstream (its own
    # client key, the pair's public key) are independent.
    down = _relay_args(
        "--upstream", "h:5556", "--curve-secret", "r.key_secret", "--clients", "c", "--acl", "a"
    )
    assert (down.curve_secret, down.clients_dir, down.acl) == ("r.key_secret", "c", "a")
    assert down.upstream_curve_secret is None
    up = _relay_args(
        "--upstream", "h:5556",
        "--upstream-curve-secret", "relay.key_secret",
        "--upstream-server-key", "pair.key",
    )  # fmt: skip
    assert (up.upstream_curve_secret, up.upstream_server_key) == ("relay.key_secret", "pair.key")
    assert up.curve_secret is None


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--relay", "--upstream", "h:5556", "--upstream-curve-secret", "s"], "go together"),
        (["--relay", "--upstream", "h:5556", "--upstream-server-key", "k"], "go together"),
        (["--standalone", "--upstream-curve-secret", "s", "--upstream-server-key", "k"], "relay"),
        (["--relay", "--upstream", "h:5556", "--curve-secret", "s"], "go together"),
    ],
)
def test_relay_curve_flags_refused(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        config_from_args(build_parser().parse_args(argv))


def test_upstream_keys_are_for_relays_only() -> None:
    with pytest.raises(ValueError, match="relay"):
        ServerConfig(port=7000, upstream_curve_secret="s", upstream_server_key="k")


def test_in_flight_routes_each_uuid_to_whoever_asked_last() -> None:
    calls: InFlight[bytes] = InFlight(limit=2, ttl=10.0)
    assert not calls.add(b"u1", b"client-a", 0.0)
    assert not calls.add(b"u1", b"client-b", 1.0)  # a retry from a new socket
    assert calls.take(b"u1", 2.0) == b"client-b"
    assert calls.take(b"u1", 2.0) is None  # answered once
    assert calls.take(b"nobody", 2.0) is None


def test_in_flight_is_bounded_and_ages_out() -> None:
    calls: InFlight[str] = InFlight(limit=2, ttl=10.0)
    calls.add(b"u1", "a", 0.0)
    calls.add(b"u2", "b", 1.0)
    assert calls.add(b"u3", "c", 2.0)  # full: u1, the oldest, is forgotten
    assert calls.take(b"u1", 3.0) is None
    assert len(calls) == 2
    assert calls.take(b"u2", 11.0) is None  # answered after its ttl: too late
    assert calls.expire(11.9) == 0
    assert calls.expire(12.0) == 1  # u3
    assert len(calls) == 0


@pytest.mark.parametrize(("limit", "ttl"), [(0, 1.0), (1, 0.0)])
def test_in_flight_refuses_nonsense(limit: int, ttl: float) -> None:
    with pytest.raises(ValueError):
        InFlight(limit, ttl)


def test_relay_core_follows_and_records_what_it_applies() -> None:
    core = ServerCore(relay=True)
    assert core.role is Role.RELAY
    core.start_sync()
    end = [b"KTHXBAI", (0).to_bytes(8, "big"), b"", b"", b""]
    assert core.on_snapshot_reply(end, 0.0) is FollowOutcome.SYNCED
    assert core.sync_state is SyncState.SYNCED
    core.journal.take()
    update = encode_kv(KVMsg("/k", 1, b"", (), b"v"))
    assert core.on_peer_update(update, 0.0) is FollowOutcome.OK
    assert core.store.sequence == 1
    # What it applied is in the journal: the relay publishes it as received.
    assert [op.updates for op in core.journal.take()] == [[update]]


def _worker_rights(name: str | None) -> Rights:
    """A CURVE relay's ACL: "worker" may write under /jobs/ only."""
    return Rights(read=(b"",), write=(b"/jobs/",))


@pytest.mark.parametrize(
    ("op", "key", "props", "refused"),
    [
        (OP_LEASE_GRANT, "/locks/x/c1", (("ttl", "2"),), True),  # named, outside
        (OP_LEASE_GRANT, "/jobs/locks/c1", (("ttl", "2"),), False),  # named, inside
        (OP_LEASE_GRANT, "", (("ttl", "2"),), False),  # unnamed: writes somewhere
        (OP_SET, "/locks/x/c1", (), True),
        (OP_SET, "/jobs/a", (), False),
        (OP_LEASE_KEEPALIVE, "", (("lease", "a" * 32),), False),
    ],
)
def test_a_relay_judges_a_call_by_its_acl_key(
    op: str, key: str, props: tuple[tuple[str, str], ...], refused: bool
) -> None:
    """The relay applies the active server's rule (clone.wire.calls.acl_refusal):
    a lock's named grant outside the caller's prefixes never goes upstream."""
    body = b"v" if op == OP_SET else b""
    frames = encode_call(op, new_uuid(), key, props, body)
    why = call_refusal(
        frames, "worker", write_all=(), admitted={"worker"}, rights_of=_worker_rights
    )
    assert (why is not None) is refused
    if refused:
        assert key in str(why)
