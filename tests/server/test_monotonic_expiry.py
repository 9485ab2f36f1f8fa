"""Ephemeral keys and leases on the monotonic clock, with
the two clocks injected separately: ``wall`` is what ``time.time`` would say,
``mono`` what ``time.monotonic`` would.  A step of ``wall`` must change no
expiry; after a failover a key must live at least its granted time and at most
about one heartbeat more; a restart gives a key at least what it had left.

Each server has its own monotonic clock with its own origin, as real ones do:
the tests give the two cores clocks that differ by an arbitrary offset, and a
wall clock that differs again, so nothing can pass by comparing one server's
time with the other's.
"""

from __future__ import annotations

import math

import pytest

from clone.server.core import FollowOutcome, ServerCore
from clone.server.leases import LeaseTable
from clone.server.store import Store, entry_of
from clone.server.ttl import format_ttl_left, split_ttl_left, with_ttl_left
from clone.wire.batch import encode_kvbatch
from clone.wire.calls import OP_LEASE_GRANT, encode_call, lease_key
from clone.wire.codec import KVMsg, decode_properties, encode_kthxbai
from clone.wire.protocol import MAX_PROPERTIES_BYTES
from tests.server.test_server_core import _kvset, _snapshot_of
from tests.support.published import kvset, promote, tick

#: The heartbeat the rule allows as slack after a failover (the default, 1 s).
HEARTBEAT = 1.0
#: One-way delay of a message between the servers in these tests.
TRANSIT = 0.05

STEPS = [-60.0, +60.0]


def _due(core: ServerCore, wall: float, mono: float) -> list[bytes]:
    """The keys the core deletes at this moment (what tick() publishes)."""
    return [frames[0] for frames in tick(core, wall, mono)]


# -- pure helpers --------------------------------------------------------------


def test_ttl_left_is_rounded_up_to_the_millisecond_and_never_zero() -> None:
    assert format_ttl_left(1.0001) == "1.001"
    assert format_ttl_left(2.5) == "2.500"
    assert format_ttl_left(0.0) == "0.001"  # due, not yet deleted: still a deadline
    assert format_ttl_left(-3.0) == "0.001"


@pytest.mark.parametrize("stored", [b"ttl=20\nexpires=1.000\n", b"lease=ab\n", b"x=1\n"])
def test_ttl_left_is_appended_last_and_cut_off_to_the_same_bytes(stored: bytes) -> None:
    sent = with_ttl_left(stored, 12.3456)
    assert sent is not None and sent.startswith(stored)
    assert decode_properties(sent)[-1] == ("ttl-left", "12.346")
    props, left = split_ttl_left(sent)
    assert props == stored and left == pytest.approx(12.346)


@pytest.mark.parametrize(
    ("received", "props", "left"),
    [
        (b"ttl=5\n", b"ttl=5\n", None),  # none sent: the receiver counts ttl
        (b"", b"", None),
        (b"ttl=5\nttl-left=abc\n", b"ttl=5\n", None),  # garbage: cut off, not used
        (b"ttl=5\nttl-left=nan\n", b"ttl=5\n", None),
        (b"ttl=5\nttl-left=-1\n", b"ttl=5\n", None),
        (b"ttl-left=2\nttl=5\n", b"ttl-left=2\nttl=5\n", None),  # only the last one counts
        (b"ttl-left=2.5\n", b"", 2.5),
    ],
)
def test_split_ttl_left_takes_only_a_valid_last_property(
    received: bytes, props: bytes, left: float | None
) -> None:
    assert split_ttl_left(received) == (props, left)


def test_ttl_left_that_would_pass_the_properties_limit_is_not_sent() -> None:
    """The receiver then counts the whole ttl: later, never earlier."""
    big = b"ttl=5\nx=" + b"a" * (MAX_PROPERTIES_BYTES - 10) + b"\n"
    assert len(big) <= MAX_PROPERTIES_BYTES
    assert with_ttl_left(big, 1.0) is None


def test_lease_table_counts_only_the_clock_it_is_given() -> None:
    """Keepalives and expiry on one clock: nothing else moves a deadline."""
    table = LeaseTable(10)
    table.grant("a", 5.0, now=100.0)
    assert table.due(104.999, 10) == []
    table.keepalive("a", now=104.0)
    assert table.due(108.999, 10) == []
    assert table.due(109.0, 10) == ["a"]


# -- one server: a wall-clock step changes nothing ------------------------------


@pytest.mark.parametrize("step", STEPS)
def test_a_wall_clock_step_on_the_active_changes_no_key_expiry(step: float) -> None:
    core = ServerCore(standalone=True)
    wall, mono = 1_700_000_000.0, 500.0
    pub = kvset(core, _kvset("/k", props="ttl=20\n"), wall, mono)
    assert pub is not None
    # The shown expiry is the wall clock's; the deadline is the monotonic one.
    assert decode_properties(pub[3]) == (("ttl", "20"), ("expires", f"{wall + 20:.3f}"))
    assert core.store.deadline("/k") == mono + 20
    # The wall clock jumps; 19.999 s of real time pass: still there.
    assert _due(core, wall + step + 19.999, mono + 19.999) == []
    assert "/k" in core.store
    # 20 s of real time: gone, whatever the wall clock says.
    assert _due(core, wall + step + 20.0, mono + 20.0) == [b"/k"]


@pytest.mark.parametrize("step", STEPS)
def test_a_wall_clock_step_on_the_active_expires_no_lease_early(step: float) -> None:
    core = ServerCore(standalone=True)
    wall, mono = 1_700_000_000.0, 500.0
    reply, _ = core.on_call(
        encode_call(OP_LEASE_GRANT, bytes(range(16)), "", (("ttl", "5.0"),), b""), wall, mono
    )
    assert reply is not None and reply.ok
    own = lease_key(reply.lease).encode()
    core.journal.take()
    # The step first, then almost the whole ttl of real time: the lease holds.
    assert _due(core, wall + step, mono) == []
    assert _due(core, wall + step + 4.999, mono + 4.999) == []
    assert reply.lease in core.leases and core.store.entry(own) is not None
    # A full ttl of real time without a keepalive: revoked, its key deleted.
    assert _due(core, wall + step + 5.0, mono + 5.0) == [own]
    assert reply.lease not in core.leases


# -- a pair: what the passive counts, and a failover -----------------------------


class Pair:
    """An active and a passive core, each with its own monotonic and wall clock.

    ``t`` is real time; each server reads ``t`` plus its own offsets.  The
    passive's wall clock is ``skew`` ahead of the active's.
    """

    def __init__(self, skew: float = 0.0) -> None:
        self.active = ServerCore(standalone=True)
        self.passive = ServerCore()
        self.passive.become_passive()
        self.passive.start_sync()
        self.skew = skew

    # Arbitrary, different origins: monotonic clocks are per machine.
    def a_mono(self, t: float) -> float:
        return 1000.0 + t

    def b_mono(self, t: float) -> float:
        return 77_000.0 + t

    def a_wall(self, t: float) -> float:
        return 1_700_000_000.0 + t

    def b_wall(self, t: float) -> float:
        return 1_700_000_000.0 + self.skew + t

    def write(self, key: str, ttl: float, t: float, n: int = 1) -> list[bytes]:
        pub = kvset(
            self.active, _kvset(key, n=n, props=f"ttl={ttl}\n"), self.a_wall(t), self.a_mono(t)
        )
        assert pub is not None
        return pub

    def deliver(self, pub: list[bytes], t: float) -> None:
        """The KVPUB reaches the passive ``TRANSIT`` after ``t``."""
        at = t + TRANSIT
        outcome = self.passive.on_peer_update(pub, self.b_wall(at), self.b_mono(at))
        assert outcome is FollowOutcome.OK

    def sync(self, t: float, *, batch: bool = False) -> None:
        """A snapshot the active streams at ``t``, received ``TRANSIT`` later."""
        stream = self.active.open_snapshot(
            b"peer", "", batch=batch, applied=True, clock=lambda: self.a_mono(t)
        )
        outcome = FollowOutcome.OK
        while not stream.done:
            frames = stream.peek()
            if frames is not None:
                at = t + TRANSIT
                outcome = self.passive.on_snapshot_reply(
                    frames[1:], self.b_wall(at), self.b_mono(at)
                )
                stream.advance()
        assert outcome is FollowOutcome.SYNCED

    def promote(self, t: float) -> None:
        self.passive.become_active(self.b_wall(t), self.b_mono(t))

    def passive_lifetime(self, key: str, written: float) -> float:
        """How long after ``written`` (real time) the passive deletes ``key``."""
        deadline = self.passive.store.deadline(key)
        assert deadline is not None
        return deadline - self.b_mono(written)


@pytest.mark.parametrize("skew", [-10.0, 0.0, +10.0])
@pytest.mark.parametrize("via", ["kvpub", "snapshot", "kvbatch"])
def test_after_a_failover_a_key_lives_its_ttl_and_at_most_a_heartbeat_more(
    skew: float, via: str
) -> None:
    """The promoted passive deletes a 20 s key between 20 s and 20 s plus a
    heartbeat after the old active applied it, whatever its wall clock says
    (before: 10 s ahead, the key lived 10 s; 10 s behind, 30 s)."""
    pair = Pair(skew)
    pair.sync(0.0)  # an empty state: synced
    pub = pair.write("/k", 20, t=1.0)
    if via == "kvpub":
        pair.deliver(pub, 1.0)
    else:
        # The passive restarts its sync 7 s later: the entry comes in a snapshot.
        pair.passive.start_sync()
        pair.sync(8.0, batch=via == "kvbatch")
    # Stored as the active stores it, byte for byte (no ttl-left kept).
    assert pair.passive.store.entry(b"/k") == pair.active.store.entry(b"/k")
    pair.promote(15.0)
    lived = pair.passive_lifetime("/k", written=1.0)
    assert 20.0 <= lived <= 20.0 + HEARTBEAT, lived
    # And the promoted server deletes it then, on its own clock.
    t_end = 1.0 + lived
    assert _due(pair.passive, pair.b_wall(t_end - 0.001), pair.b_mono(t_end - 0.001)) == []
    assert _due(pair.passive, pair.b_wall(t_end), pair.b_mono(t_end)) == [b"/k"]


@pytest.mark.parametrize("step", STEPS)
def test_a_wall_clock_step_on_the_passive_changes_nothing_after_promotion(step: float) -> None:
    pair = Pair()
    pair.sync(0.0)
    pair.deliver(pair.write("/k", 20, t=1.0), 1.0)
    pair.skew = step  # the passive's wall clock steps before the failover
    pair.promote(5.0)
    assert 20.0 <= pair.passive_lifetime("/k", written=1.0) <= 20.0 + HEARTBEAT
    assert _due(pair.passive, pair.b_wall(20.9), pair.b_mono(20.9)) == []


@pytest.mark.parametrize("step", STEPS)
def test_after_a_failover_no_lease_ends_before_its_ttl(step: float) -> None:
    """Keepalives are not replicated: the promoted passive gives every lease a
    whole ttl from the promotion, so a lease never ends before a ttl after its
    last keepalive on the old active, whatever the new active's wall clock did."""
    pair = Pair()
    pair.sync(0.0)
    reply, _ = pair.active.on_call(
        encode_call(OP_LEASE_GRANT, bytes(range(16)), "", (("ttl", "5.0"),), b""),
        pair.a_wall(1.0),
        pair.a_mono(1.0),
    )
    assert reply is not None and reply.ok
    for op in pair.active.journal.take():
        for frames in op.updates:
            pair.deliver(list(frames), 1.0)
    assert pair.passive.store.entry(lease_key(reply.lease).encode()) is not None
    pair.skew = step
    pair.promote(4.0)  # the old active died 3 s into the lease
    assert reply.lease in pair.passive.leases
    # Not before 1 s + ttl (the truth on the old active), nor before 4 s + ttl.
    t = 4.0 + 5.0 - 0.001
    assert _due(pair.passive, pair.b_wall(t), pair.b_mono(t)) == []
    t = 4.0 + 5.0
    assert _due(pair.passive, pair.b_wall(t), pair.b_mono(t)) == [lease_key(reply.lease).encode()]


def test_a_catch_up_sends_the_time_left_of_a_key_still_held() -> None:
    """A passive that held the state up to a point asks only for what followed:
    an update of a key still held goes with what it has left, not its whole ttl."""
    pair = Pair()
    pair.sync(0.0)
    pair.deliver(pair.write("/a", 30, t=1.0, n=1), 1.0)
    pub = pair.write("/b", 20, t=2.0, n=2)  # lost on its way: the passive resyncs
    assert pub
    pair.passive.start_sync()
    since = pair.passive.catch_up_request()
    assert since is not None
    stream = pair.active.open_snapshot(
        b"peer", "", applied=True, since=since, clock=lambda: pair.a_mono(12.0)
    )
    while not stream.done:
        frames = stream.peek()
        if frames is not None:
            at = 12.0 + TRANSIT
            pair.passive.on_snapshot_reply(frames[1:], pair.b_wall(at), pair.b_mono(at))
            stream.advance()
    assert pair.passive.last_sync == "catch-up"
    assert pair.passive.store.entry(b"/b") == pair.active.store.entry(b"/b")
    assert 20.0 <= pair.passive_lifetime("/b", written=2.0) <= 20.0 + HEARTBEAT


def test_a_client_snapshot_sends_entries_as_stored() -> None:
    """Only a peer server that asks gets ttl-left; a client sees the stored
    ``ttl`` (as granted) and ``expires`` (the accepting server's wall clock)."""
    core = ServerCore(standalone=True)
    pub = kvset(core, _kvset("/k", props="ttl=20\n"), 1_700_000_000.0, 10.0)
    assert pub is not None
    client = _snapshot_of(core, applied=False)
    assert list(client[0]) == pub  # the KVPUB's frames: what is stored
    peer = core.open_snapshot(b"p", "", clock=lambda: 15.0).peek()
    assert peer is not None and peer[4].endswith(b"\nttl-left=15.000\n")


def test_an_old_update_of_a_key_since_rewritten_goes_as_it_is() -> None:
    store = Store()
    store.apply(KVMsg("/k", 0, b"u1", (("ttl", "20"),), b"v1"), now=0.0)
    old = store.entry(b"/k")
    assert old is not None
    store.apply(KVMsg("/k", 0, b"u2", (("ttl", "20"),), b"v2"), now=5.0)
    assert store.served(b"/k", old, now=6.0) == old
    new = store.served(b"/k", store.entry(b"/k") or old, now=6.0)
    assert split_ttl_left(new[2])[1] == pytest.approx(19.0)


def test_a_key_parked_on_the_passive_counts_its_ttl_from_arrival_on_the_monotonic_clock() -> None:
    core = ServerCore()
    core.become_passive()
    core.on_kvset(_kvset("/p", props="ttl=10\n"), 5_000.0, 100.0)
    # The wall clock steps back a minute before the promotion, 2 s later.
    out = promote(core, 5_000.0 - 60.0 + 2.0, 102.0)
    assert [frames[0] for frames in out] == [b"/p"]
    assert core.store.deadline("/p") == 110.0


# -- a restart: the deadline that survives ----------------------------------------


def test_a_state_loaded_from_disk_gives_each_key_its_stored_ttl_again() -> None:
    """Neither clock says how long a key has left after a restart (monotonic
    time starts over; the wall clock may have stepped): a key gets its stored
    ttl again from the load, never less than it had left."""
    stored = {
        b"/k": entry_of(KVMsg("/k", 3, b"u", (("ttl", "20"), ("expires", "1.000")), b"v")),
        b"/p": entry_of(KVMsg("/p", 4, b"w", (), b"v")),
    }
    core = ServerCore(standalone=True)
    core.load(stored, 4, [], now=9e9, mono=42.0)  # expires is far in the past
    assert core.store.deadline("/k") == 62.0
    assert core.store.deadline("/p") is None
    assert _due(core, 9e9, 61.999) == []
    assert _due(core, 9e9, 62.0) == [b"/k"]


def test_a_leased_key_survives_a_restart_for_a_whole_ttl() -> None:
    lease_entry = entry_of(KVMsg(lease_key("ab" * 16), 1, b"u", (), b"ttl=5.0"))
    core = ServerCore(standalone=True)
    core.load({lease_key("ab" * 16).encode(): lease_entry}, 1, [], now=9e9, mono=7.0)
    assert "ab" * 16 in core.leases
    assert _due(core, 0.0, 11.999) == []  # the wall clock went back a lot: nothing
    assert _due(core, 0.0, 12.0) == [lease_key("ab" * 16).encode()]


def test_batch_entries_lose_their_ttl_left_before_they_are_stored() -> None:
    core = ServerCore()
    core.become_passive()
    core.start_sync()
    entry = (
        (7).to_bytes(8, "big"),
        bytes(16),
        b"ttl=20\nexpires=5.000\nttl-left=3.500\n",
        b"v",
    )
    core.on_snapshot_reply(encode_kvbatch([b"/k"], [entry]), 0.0, 50.0)
    assert core.on_snapshot_reply(encode_kthxbai(7), 0.0, 51.0) is FollowOutcome.SYNCED
    assert core.store.entry(b"/k") == (entry[0], bytes(16), b"ttl=20\nexpires=5.000\n", b"v")
    assert math.isclose(core.store.deadline("/k") or 0.0, 53.5)
