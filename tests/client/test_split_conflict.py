"""A client learns that its confirmed write became a split-brain conflict.

The agent's state machine with a fake clock (as tests/client/test_agent_fsm.py):
a write confirmed by server 0 (the island's active), then a ``conflict`` notice
from it after it stepped down, while the client already follows server 1.
"""

from __future__ import annotations

from clone.client.fsm import (
    AgentFSM,
    Confirmed,
    Refused,
    SendUpdate,
    SplitConflicted,
    State,
)
from clone.client.state import CONFIRMED_REMEMBERED
from clone.errors import SplitConflict, WriteRefused
from clone.wire.codec import Hugz, KVMsg, new_uuid
from clone.wire.control import Refusal
from tests.client.test_agent_fsm import MemoryServer, feed_snapshot, prove_collector, synced


def _synced() -> tuple[AgentFSM, MemoryServer]:
    fsm, srvs = synced(2)
    assert fsm.state is State.ACTIVE and fsm.current == 0
    return fsm, srvs[0]


def _notice(uuid: bytes) -> Refusal:
    return Refusal("*", uuid, "conflict")


def test_a_confirmed_write_that_became_a_conflict_is_an_event() -> None:
    fsm, srv = _synced()
    msg = KVMsg.build("/cfg/db/host", b"island", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=5.0)
    actions = fsm.update(0, srv.apply("/cfg/db/host", b"island", msg.uuid), 1.1)
    assert Confirmed(msg.uuid, 1) in actions
    # From server 1: not the one the client follows, and it still counts.
    assert fsm.update(1, _notice(msg.uuid), 5.0) == [SplitConflicted(msg.uuid, "/cfg/db/host")]
    assert fsm.counters.split_conflicts == 1
    assert fsm.update(1, _notice(msg.uuid), 5.1) == []  # told once


def test_a_write_confirmed_by_a_resync_snapshot_is_remembered_too() -> None:
    """Its KVPUB lost (a subscriber that joined late, a HUGZ ahead): the
    resync's snapshot confirms the write, and its conflict is still an event.
    (A loaded run's e2e test lost the notice this way.)"""
    fsm, srv = _synced()
    msg = KVMsg.build("/cfg/db/host", b"island", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=5.0)
    srv.apply("/cfg/db/host", b"island", msg.uuid)  # its KVPUB never arrives
    assert not any(isinstance(a, Confirmed) for a in fsm.update(0, Hugz(srv.seq), 1.1))
    actions = feed_snapshot(fsm, srv, 1.2)
    assert Confirmed(msg.uuid, srv.seq) in actions
    assert fsm.update(0, _notice(msg.uuid), 5.0) == [SplitConflicted(msg.uuid, "/cfg/db/host")]


def test_a_write_still_waited_on_fails_with_the_conflict() -> None:
    fsm, _ = _synced()
    msg = KVMsg.build("/lock", b"me", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=5.0)
    assert fsm.update(1, _notice(msg.uuid), 1.5) == [Refused(msg.uuid, "conflict", "/lock")]
    assert fsm.pending_writes == 0


def test_another_clients_conflict_is_not_ours() -> None:
    fsm, _ = _synced()
    assert fsm.update(0, _notice(new_uuid()), 1.0) == []
    assert fsm.counters.split_conflicts == 0


def test_only_the_latest_confirmed_writes_are_remembered() -> None:
    fsm, srv = _synced()
    first = None
    for i in range(CONFIRMED_REMEMBERED + 1):
        msg = KVMsg.build(f"/k/{i}", b"v", uuid=new_uuid())
        first = first or msg.uuid
        fsm.write(msg, 1.0, confirm_within=5.0)
        fsm.update(0, srv.apply(msg.key, b"v", msg.uuid), 1.0)
    assert fsm.update(0, _notice(first), 2.0) == []  # forgotten: the bound holds


def test_the_exception_is_a_write_refused_with_the_key() -> None:
    err = SplitConflict("/cfg/db/host", b"\x01" * 16)
    assert isinstance(err, WriteRefused)
    assert (err.reason, err.key, err.uuid) == ("conflict", "/cfg/db/host", b"\x01" * 16)
    assert "clone conflicts" in str(err)


def test_writes_wait_while_two_servers_show_themselves_active() -> None:
    fsm, srv = _synced()  # active on server 0 (CFG: heartbeat 1 s)
    prove_collector(fsm, srv, 0.5)
    # Server 1's HUGZ says it is active too: a split brain is healing.
    fsm.update(1, Hugz(500, 0.25), 1.0)
    msg = KVMsg.build("/k", b"v", uuid=new_uuid())
    assert fsm.write(msg, 1.1, confirm_within=5.0) == []  # held, sent nowhere
    fsm.update(0, Hugz(srv.seq, 1.0), 1.5)  # our server is alive
    assert not any(isinstance(a, SendUpdate) for a in fsm.tick(2.0))
    # Server 1 goes quiet (it stepped down): two of its heartbeats later
    # (CFG's 1 s), the write goes out.
    fsm.update(0, Hugz(srv.seq, 1.0), 2.5)
    assert SendUpdate(msg) in fsm.tick(3.0)
    assert fsm.counters.split_held_writes == 1
    # Confirmed as usual.
    published = srv.apply("/k", b"v", msg.uuid)
    assert Confirmed(msg.uuid, published.sequence) in fsm.update(0, published, 3.1)


def test_two_actives_never_hold_writes_for_long() -> None:
    fsm, srv = _synced()
    for t in range(12):  # server 1 keeps saying it is active, every 0.5 s
        fsm.update(1, Hugz(9, 0.25), 1.0 + t * 0.5)
        fsm.update(0, Hugz(srv.seq, 1.0), 1.0 + t * 0.5)
    msg = KVMsg.build("/k", b"v", uuid=new_uuid())
    # Seen for more than SPLIT_HOLD_MAX: writes go out again (this client sees
    # both sides of a split that is not healing).
    assert fsm.write(msg, 6.6, confirm_within=5.0) == [SendUpdate(msg)]


def test_a_server_that_comes_back_holds_writes_until_it_says_what_it_is() -> None:
    fsm, srv = _synced()
    assert fsm.server_reconnected(1, 1.0) == []  # server 1's publisher is back
    msg = KVMsg.build("/k", b"v", uuid=new_uuid())
    assert fsm.write(msg, 1.1, confirm_within=5.0) == []  # held: is it active?
    fsm.update(0, Hugz(srv.seq, 1.0), 2.0)
    # It never showed itself active (a passive sends no HUGZ): the write goes.
    assert SendUpdate(msg) in fsm.tick(3.1)
