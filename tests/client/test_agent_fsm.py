"""Unit tests of the client agent's state machine: no sockets, a fake clock.

``MemoryServer`` plays a CHP server in memory: it holds a map and a sequence, and
hands the FSM the KVSYNC/KTHXBAI/KVPUB/HUGZ messages a real one would send.
"""

from __future__ import annotations

import itertools
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import clone.client.fsm as fsm_module
from clone.client.fsm import (
    TRANSITIONS,
    Action,
    AgentConfig,
    AgentFSM,
    Changed,
    Confirmed,
    Event,
    IllegalTransitionError,
    Malformed,
    Refused,
    RequestSnapshot,
    SendUpdate,
    State,
    StateChanged,
    normalize_subtrees,
)
from clone.errors import CloneError, ProtocolError
from clone.server.store import entry_of
from clone.wire.batch import encode_kvbatch
from clone.wire.codec import (
    Hugz,
    KVMsg,
    SnapshotEnd,
    decode_snapshot_reply,
    encode_kthxbai,
    encode_kv,
    new_uuid,
)
from clone.wire.control import ViewHeartbeat
from clone.wire.delta import is_kvdelta, update_digest

ACTION_TYPES = (RequestSnapshot, SendUpdate, Changed, Confirmed, StateChanged, Malformed, Refused)
CFG = AgentConfig(heartbeat=1.0, server_timeout=2.5, resend_interval=0.5)


class MemoryServer:
    """An in-memory CHP server: a map, a sequence, and the messages it would send."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.seq = 0
        self.map: dict[str, KVMsg] = {}

    def apply(self, key: str, body: bytes, uuid: bytes = b"") -> KVMsg:
        self.seq += 1
        msg = KVMsg(key, self.seq, uuid, (), body)
        if body:
            self.map[key] = msg
        else:
            self.map.pop(key, None)
        return msg

    def snapshot(self, subtree: str = "") -> list[KVMsg | SnapshotEnd]:
        out: list[KVMsg | SnapshotEnd] = [
            m for k, m in sorted(self.map.items()) if k.startswith(subtree)
        ]
        out.append(SnapshotEnd(self.seq, subtree))
        return out


def catch_up_of(msg: KVMsg) -> tuple[int, bytes]:
    """What a request names when ``msg`` is the last update the client applied."""
    return msg.sequence, update_digest(encode_kv(msg))


def raw(msg: KVMsg | SnapshotEnd) -> list[bytes]:
    if isinstance(msg, SnapshotEnd):
        return encode_kthxbai(msg.sequence, msg.subtree)
    return encode_kv(msg)


def snapshot_reply(
    fsm: AgentFSM, server: int, msg: KVMsg | SnapshotEnd, now: float
) -> list[Action]:
    """One snapshot reply, as the agent hands it over: raw, in a batch of one."""
    return fsm.snapshot_batch(server, [raw(msg)], now)


def feed_snapshot(fsm: AgentFSM, srv: MemoryServer, now: float, subtree: str = "") -> list:
    actions: list = []
    for msg in srv.snapshot(subtree):
        actions += snapshot_reply(fsm, srv.index, msg, now)
    return actions


def feed_batches(
    fsm: AgentFSM, srv: MemoryServer, now: float, subtree: str = "", size: int = 3
) -> list:
    """The snapshot as the agent hands it over: raw frames, ``size`` per event."""
    frames = [raw(m) for m in srv.snapshot(subtree)]
    actions: list = []
    for i in range(0, len(frames), size):
        actions += fsm.snapshot_batch(srv.index, frames[i : i + size], now)
    return actions


def synced(servers: int = 2, subtrees: str | list[str] | None = None) -> tuple:
    fsm = AgentFSM(subtrees, CFG, now=0.0)
    srvs = [MemoryServer(i) for i in range(servers)]
    for i in range(servers):
        fsm.connect(f"tcp://127.0.0.1:{5556 + 10 * i}", 0.0)
    for sub in fsm.subtrees:
        feed_snapshot(fsm, srvs[0], 0.0, sub)
    assert fsm.state is State.ACTIVE
    return fsm, srvs


def prove_collector(fsm: AgentFSM, srv: MemoryServer, now: float) -> KVMsg:
    """A first write after the sync goes alone, as a probe; its update from
    ``srv`` shows our PUB reaches that server's collector, and the writes
    after it go out at once."""
    probe = KVMsg.build("probe", b"p", uuid=new_uuid())
    assert fsm.write(probe, now, confirm_within=None) == [SendUpdate(probe)]
    published = srv.apply("probe", b"p", probe.uuid)
    fsm.update(srv.index, published, now)
    assert fsm.tick(now) == [] and fsm.held_writes == 0
    return published


def test_table_covers_every_state_and_event() -> None:
    for state, event in itertools.product(State, Event):
        assert (state, event) in TRANSITIONS, (state, event)


@pytest.mark.parametrize(("state", "event"), list(TRANSITIONS))
def test_every_transition_runs(state: State, event: Event) -> None:
    """Each table entry takes a plausible payload, answers with actions only,
    lands in the state it should, and announces a change of state."""
    fsm = AgentFSM(None, CFG, now=0.0)
    if state is not State.INITIAL:
        fsm.connect("tcp://a:1", 0.0)
    if state is State.ACTIVE:
        snapshot_reply(fsm, 0, SnapshotEnd(0), 0.0)
    assert fsm.state is state
    payload = {
        Event.CONNECT: "tcp://b:2",
        Event.SNAPSHOT_BATCH: [encode_kv(KVMsg("k", 1, b"", (), b"v")), [b"bad"]],
        Event.UPDATE: KVMsg("k", 1, b"", (), b"v"),
        Event.HEARTBEAT: Hugz(0),
        Event.VIEW_HEARTBEAT: ViewHeartbeat("0123456789ab", 0, 0.25, 0),
        Event.SILENCE: None,
        Event.REASK: None,
        Event.SERVER_DISCONNECTED: None,
        Event.ACTIVE_ELSEWHERE: Hugz(0, 0.25),
    }[event]
    server = 1 if event is Event.CONNECT else 0
    if state is State.INITIAL and event is not Event.CONNECT:
        fsm.current = 0  # reach the handler rather than the foreign-server filter
    actions = fsm.handle(event, server, payload, 1.0)
    assert all(isinstance(a, ACTION_TYPES) for a in actions), actions
    leaves = {(State.INITIAL, Event.CONNECT), (State.ACTIVE, Event.SILENCE)}
    leaves.add((State.ACTIVE, Event.SERVER_DISCONNECTED))
    # An unrestricted client that gets a view heartbeat: its rights changed.
    leaves.add((State.ACTIVE, Event.VIEW_HEARTBEAT))
    expected = State.SYNCING if (state, event) in leaves else state
    assert fsm.state is expected
    # A state change is announced, once, and only a change.
    changes = [a for a in actions if isinstance(a, StateChanged)]
    assert changes == ([] if expected is state else [StateChanged(expected, fsm.current)])


def test_missing_pair_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    table = {k: v for k, v in TRANSITIONS.items() if k != (State.SYNCING, Event.HEARTBEAT)}
    monkeypatch.setattr(fsm_module, "TRANSITIONS", MappingProxyType(table))
    with pytest.raises(IllegalTransitionError) as info:
        fsm.update(0, Hugz(0), 0.0)
    assert isinstance(info.value, CloneError)
    assert "HEARTBEAT" in str(info.value) and "SYNCING" in str(info.value)


def test_the_table_is_read_only() -> None:
    with pytest.raises(TypeError):
        TRANSITIONS[(State.SYNCING, Event.HEARTBEAT)] = AgentFSM._ignore  # type: ignore[index]


def test_connect_requests_a_snapshot_from_the_first_server_only() -> None:
    fsm = AgentFSM("/a/", CFG)
    assert fsm.connect("tcp://a:1", 0.0) == [
        StateChanged(State.SYNCING, 0),
        RequestSnapshot(0, ("/a/",)),
    ]
    assert fsm.connect("tcp://b:1", 0.0) == []
    assert fsm.state is State.SYNCING


def test_snapshot_then_updates() -> None:
    fsm = AgentFSM(None, CFG)
    srv = MemoryServer(0)
    srv.apply("a", b"1")
    srv.apply("b", b"2")
    fsm.connect("tcp://a:1", 0.0)
    actions = feed_snapshot(fsm, srv, 0.1)
    assert StateChanged(State.ACTIVE, 0) in actions
    assert {a.key for a in actions if isinstance(a, Changed)} == {"a", "b"}
    assert fsm.last_sequence == 2
    actions = fsm.update(0, srv.apply("a", b"3"), 0.2)
    assert actions == [Changed("a", srv.map["a"])]
    fsm.update(0, srv.apply("b", b""), 0.3)
    assert fsm.get("b") is None
    assert [m.key for m in fsm.items()] == ["a"]


def test_stale_updates_are_discarded() -> None:
    fsm, (srv, _) = synced()
    m1 = srv.apply("a", b"1")
    fsm.update(0, m1, 0.1)
    assert fsm.update(0, KVMsg("a", 1, b"", (), b"old"), 0.2) == []
    assert fsm.get("a") == m1
    assert fsm.counters.stale == 1


def test_gap_in_kvpub_forces_a_resync_on_the_same_server() -> None:
    fsm, (srv, _) = synced()
    srv.apply("a", b"1")  # lost on the way
    actions = fsm.update(0, srv.apply("b", b"2"), 0.1)
    assert RequestSnapshot(0, ("",)) in actions
    assert fsm.state is State.SYNCING
    assert fsm.counters.gaps == 1
    feed_snapshot(fsm, srv, 0.2)
    assert fsm.get("a") is not None and fsm.get("b") is not None


def test_hugz_is_not_an_update_but_reveals_a_missed_tail() -> None:
    fsm, (srv, _) = synced()
    assert fsm.update(0, Hugz(0), 0.1) == []
    assert fsm.last_sequence == 0
    srv.apply("a", b"1")  # lost
    actions = fsm.update(0, Hugz(srv.seq), 0.2)
    assert RequestSnapshot(0, ("",)) in actions
    assert fsm.counters.gaps == 1


def _requests(actions: list) -> list[int]:
    return [a.server for a in actions if isinstance(a, RequestSnapshot)]


def test_unanswered_request_is_repeated_a_bounded_number_of_times_then_fails_over() -> None:
    """Every 0.25 heartbeat, at most 10 requests per round, next server at 2.5;
    a round after one that got nothing is twice as long and asks half as often
    (clone.client.backoff; ``draw`` 0.5: no jitter)."""
    fsm = AgentFSM(None, CFG, now=0.0, draw=lambda: 0.5)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:1", 0.0)
    assert fsm.next_deadline() == pytest.approx(0.25)
    assert fsm.tick(0.24) == []
    asked = [0.0]
    t = 0.0
    while (deadline := fsm.next_deadline()) is not None and deadline < 2.5:
        t = deadline
        assert fsm.tick(t) == [RequestSnapshot(0, ("",))]
        asked.append(t)
    assert len(asked) == CFG.requests_per_server == 10
    assert asked[-1] == pytest.approx(2.25)
    assert fsm.counters.retries == 9 and fsm.counters.failovers == 0
    assert fsm.tick(2.49) == []
    assert fsm.tick(2.5) == [RequestSnapshot(1, ("",))]  # next server, a new round
    assert fsm.current == 1 and fsm.counters.failovers == 1
    assert fsm.next_deadline() == pytest.approx(3.0)
    assert fsm.tick(3.0) == [RequestSnapshot(1, ("",))]
    for t in (3.5, 4.0, 4.5, 5.0, 5.5, 6.0, 6.5, 7.0):
        assert fsm.tick(t) == [RequestSnapshot(1, ("",))]
    assert fsm.tick(7.49) == []
    assert fsm.tick(7.5) == [RequestSnapshot(0, ("",))]  # 2.5 + 2 x 2.5
    assert fsm.counters.failovers == 2 and fsm.counters.retries == 18


def test_hugz_from_a_server_that_refuses_us_do_not_hold_the_sync() -> None:
    """A server that heartbeats but never answers the request is left at 2.5."""
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:1", 0.0)
    for t in (0.5, 1.0, 1.5, 2.0, 2.4):
        fsm.update(0, Hugz(0), t)
        fsm.update(0, KVMsg("k", int(t * 10), b"", (), b"v"), t)
    actions = fsm.tick(2.5)
    assert _requests(actions) == [1] and fsm.counters.failovers == 1


def test_snapshot_data_stops_the_reasks() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    snapshot_reply(fsm, 0, KVMsg("k", 1, b"", (), b"v"), 0.1)
    assert fsm.next_deadline() == pytest.approx(2.6)  # silence only; no re-ask
    assert fsm.tick(2.0) == []
    fsm.update(0, Hugz(1), 2.0)  # after snapshot data, HUGZ count as life again
    assert fsm.tick(2.6) == [] and fsm.counters.retries == 0


def test_an_answer_that_stops_before_its_end_is_asked_again_on_the_same_server() -> None:
    """The server's HUGZ keep coming but our stream does not (it replaced it
    with a late copy of an older request of ours, whose socket we had
    closed): after STALL_HEARTBEATS of them and the round's window with no
    data, we ask again, there.  Before, the HUGZ held the sync open for good."""
    fsm, (primary, _backup) = synced()
    m = primary.apply("a", b"1")
    fsm.update(0, m, 0.5)
    fsm.update(0, Hugz(primary.seq + 1), 1.0)  # a lost update: resync from it
    assert fsm.state is State.SYNCING and fsm.current == 0
    snapshot_reply(fsm, 0, KVMsg("a", 1, b"", (), b"1"), 1.1)  # the start, then nothing
    for i in range(1, 25):  # HUGZ every 0.1 s up to 3.5: the window (2.5 s) not yet over
        t = 1.1 + 0.1 * i
        assert _requests(fsm.update(0, Hugz(primary.seq), t) + fsm.tick(t)) == [], t
    assert _requests(fsm.update(0, Hugz(primary.seq), 3.6)) == [0]  # the same server
    c = fsm.counters
    assert (c.stalled_syncs, c.retries, c.failovers) == (1, 1, 0)
    feed_snapshot(fsm, primary, 3.7)
    assert fsm.state is State.ACTIVE and fsm.get("a") is not None


def test_a_slow_answer_on_a_starved_machine_is_not_asked_again() -> None:
    """Time alone is no stall: a client or server starved for seconds hears
    few HUGZ, and the stream's next data is queued behind them."""
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    snapshot_reply(fsm, 0, KVMsg("k", 1, b"", (), b"v"), 0.1)
    for t in (2.0, 4.0, 6.0):  # one HUGZ every 2 s (of the server's 1 s heartbeat)
        assert _requests(fsm.update(0, Hugz(1), t) + fsm.tick(t)) == []
    for i in range(1, 20):  # many HUGZ, with data among them
        t = 6.0 + 0.1 * i
        actions = fsm.update(0, Hugz(1), t)
        if i % 5 == 0:
            snapshot_reply(fsm, 0, KVMsg(f"k{i}", 1 + i, b"", (), b"v"), t)
        assert _requests(actions + fsm.tick(t)) == []
    assert fsm.counters.stalled_syncs == 0 and fsm.state is State.SYNCING


def test_server_that_ignores_the_first_requests_is_synced_without_failover() -> None:
    """The backup refuses votes until it notices the primary's death, then answers."""
    fsm, (primary, backup) = synced()
    last = primary.apply("a", b"1")
    fsm.update(0, last, 0.5)
    backup.map, backup.seq = dict(primary.map), primary.seq
    actions = fsm.server_disconnected(0, 1.0)
    assert _requests(actions) == [1]
    for t in (1.25, 1.5, 1.75):  # refused: nothing comes back
        assert fsm.tick(t) == [RequestSnapshot(1, ("",), catch_up_of(last))]
    feed_snapshot(fsm, backup, 1.8)  # the answer to the fourth request
    assert fsm.state is State.ACTIVE and fsm.current == 1
    assert fsm.get("a") is not None
    c = fsm.counters
    assert (c.failovers, c.disconnect_failovers, c.retries) == (1, 1, 3)
    assert c.last_failover_gap_ms == 1300  # last heard at 0.5, synced at 1.8
    assert fsm.next_deadline() == pytest.approx(1.8 + 2.5)  # no re-ask left behind


def test_lost_connection_to_the_active_server_fails_over_at_once() -> None:
    fsm, (_primary, backup) = synced()
    fsm.update(0, Hugz(0), 1.0)
    actions = fsm.server_disconnected(0, 1.2)  # long before server_timeout (3.5)
    assert actions == [StateChanged(State.SYNCING, 1), RequestSnapshot(1, ("",))]
    assert fsm.current == 1
    c = fsm.counters
    assert (c.disconnects, c.disconnect_failovers, c.failovers) == (1, 1, 1)
    feed_snapshot(fsm, backup, 1.3)
    assert fsm.state is State.ACTIVE and fsm.counters.last_failover_gap_ms == 300


def test_lost_connection_while_syncing_moves_to_the_next_server() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:1", 0.0)
    actions = fsm.server_disconnected(0, 0.1)
    assert actions == [RequestSnapshot(1, ("",))]
    assert fsm.counters.disconnect_failovers == 1


def test_lost_connection_to_another_server_is_only_counted() -> None:
    fsm, _ = synced()
    assert fsm.server_disconnected(1, 1.0) == []
    assert fsm.current == 0 and fsm.state is State.ACTIVE
    c = fsm.counters
    assert (c.disconnects, c.disconnect_failovers, c.failovers, c.foreign) == (1, 0, 0, 0)
    before = AgentFSM(None, CFG)
    assert before.server_disconnected(0, 0.0) == []  # no server yet


def two_servers() -> AgentFSM:
    """A client syncing from server 0, which has not answered; server 1 known."""
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    fsm.connect("tcp://b:1", 0.0)
    return fsm


def test_a_server_that_shows_itself_active_is_asked_at_once() -> None:
    """The failback case: server 0 came back passive and holds our request; the
    first HUGZ of the active server 1 (ours say their heartbeat) moves us to it,
    within one of its heartbeats instead of server_timeout."""
    fsm = two_servers()
    srv = MemoryServer(1)
    srv.apply("a", b"1")
    assert fsm.tick(0.25) == [RequestSnapshot(0, ("",))]  # refused, asked again
    actions = fsm.update(1, Hugz(srv.seq, 0.25), 0.3)
    assert actions == [RequestSnapshot(1, ("",))]
    assert fsm.current == 1 and fsm.state is State.SYNCING
    c = fsm.counters
    assert (c.failovers, c.hint_failovers, c.disconnect_failovers) == (1, 1, 0)
    assert fsm.next_deadline() == pytest.approx(0.3 + 0.25)  # a new round on 1
    actions = feed_snapshot(fsm, srv, 0.35)
    assert StateChanged(State.ACTIVE, 1) in actions
    assert fsm.get("a") is not None
    # It said its heartbeat: judged by it from now on.
    assert fsm.silence_timeout() == pytest.approx(4 * 0.25)


def test_a_kvpub_shows_a_server_active_but_a_bare_hugz_does_not() -> None:
    """The Guide's passive servers send HUGZ too (without a heartbeat): those
    prove nothing.  Only the active server publishes updates."""
    fsm = two_servers()
    assert fsm.update(1, Hugz(0), 0.1) == []
    assert fsm.current == 0 and fsm.counters.foreign == 1
    srv = MemoryServer(1)
    kvpub = srv.apply("a", b"1")
    assert fsm.update(1, kvpub, 0.2) == [RequestSnapshot(1, ("",))]
    assert fsm.current == 1 and fsm.counters.hint_failovers == 1
    feed_snapshot(fsm, srv, 0.3)  # the snapshot holds the KVPUB already
    assert fsm.state is State.ACTIVE and fsm.get("a") == kvpub
    assert fsm.last_sequence == 1 and fsm.counters.gaps == 0


def test_a_server_that_answers_or_shows_itself_active_is_not_left() -> None:
    # Snapshot data is flowing from server 0: another active one does not matter.
    fsm = two_servers()
    snapshot_reply(fsm, 0, KVMsg("k", 1, b"", (), b"v"), 0.1)
    assert fsm.update(1, Hugz(1, 0.25), 0.2) == []
    assert fsm.current == 0
    # Server 0 heartbeats too (two actives): it is only slower to answer.
    fsm = two_servers()
    fsm.update(0, Hugz(0, 0.25), 0.05)
    assert fsm.update(1, Hugz(0, 0.25), 0.1) == []
    assert fsm.current == 0 and fsm.counters.hint_failovers == 0


def test_two_actives_do_not_make_the_client_flap() -> None:
    """Split brain: both servers heartbeat and neither answers for a while.
    The client switches at most once per round, and a server it switched to
    keeps it for a whole server_timeout; once served it stays."""
    fsm = two_servers()
    current_at: list[tuple[float, int]] = [(0.0, 0)]
    t = 0.0
    while t < 10.0:
        t = round(t + 0.05, 2)
        if round(t * 100) % 25 == 10:  # server 1 first in every heartbeat
            fsm.update(1, Hugz(0, 0.25), t)
        if round(t * 100) % 25 == 15:
            fsm.update(0, Hugz(0, 0.25), t)
        fsm.tick(t)
        if fsm.current != current_at[-1][1]:
            assert fsm.current is not None
            current_at.append((t, fsm.current))
    # 0 -> 1 by the first HUGZ of 1; rounds then end by timeout, and a round
    # reached by timeout may end early by one HUGZ of the other server, whose
    # round is then whole: of two consecutive stays, one lasts a full round.
    # Rounds after ones that got nothing are longer (clone.client.backoff):
    # 0.1-2.6 on 1, 2.6-7.6 on 0, 7.6 on 1, 7.65 on 0 by its HUGZ.  The last
    # stay, cut by the end of the loop, is left out.
    assert current_at[1] == (0.1, 1)
    stays = [b[0] - a[0] for a, b in itertools.pairwise(current_at)]
    assert all(max(a, b) >= CFG.server_timeout - 1e-9 for a, b in itertools.pairwise(stays))
    c = fsm.counters
    assert c.hint_failovers <= c.failovers - c.hint_failovers + 1
    assert len(current_at) <= 2 * (10.0 / CFG.server_timeout) + 1
    # Served by the current one: HUGZ from the other active one are ignored.
    served = fsm.current
    assert served is not None
    feed_snapshot(fsm, MemoryServer(served), t + 0.02)
    assert fsm.state is State.ACTIVE
    for k in range(1, 20):
        assert fsm.update(1 - served, Hugz(0, 0.25), t + 0.1 * k) == []
        fsm.update(served, Hugz(0, 0.25), t + 0.1 * k)
    assert fsm.current == served and fsm.state is State.ACTIVE


def test_a_server_that_heartbeats_active_but_never_serves_cannot_hold_the_client() -> None:
    """A broken or hostile server says it is active in every HUGZ and never
    answers a request.  Left by timeout, it must not take the client back by
    its next HUGZ before the other server had a whole round: under load the
    good server answered later than one hostile heartbeat, the client went
    back each time, its rounds grew, and a loaded e2e run never synced in 10 s."""
    fsm = two_servers()  # on server 0 (the hostile one); server 1 answers slowly
    t = 0.0
    while fsm.current == 0:
        t = round(t + 0.05, 2)
        fsm.update(0, Hugz(0, 0.05), t)  # active, says it: never left for a hint
        fsm.tick(t)
        assert t < 5.0, "never left the server that does not answer"
    assert fsm.current == 1 and fsm.state is State.SYNCING
    left = t
    while t < left + CFG.server_timeout - 0.1:
        t = round(t + 0.05, 2)
        assert fsm.update(0, Hugz(0, 0.05), t) == []  # no pull back
        fsm.tick(t)
        assert fsm.current == 1
    assert fsm.counters.unserving_hints >= 1
    good = MemoryServer(1)
    good.apply("a", b"1")
    feed_snapshot(fsm, good, t)  # a slow answer, within its round
    assert fsm.state is State.ACTIVE and fsm.current == 1


def test_a_server_left_for_not_serving_moves_the_client_again_once_it_had_its_turn() -> None:
    """The mark lasts until the server's next ordinary round: a real active
    that was only slow once is still found by its hint afterwards."""
    fsm = two_servers()
    fsm.update(0, Hugz(0, 0.25), 0.1)  # shown active, never answers
    assert _requests(fsm.tick(CFG.server_timeout + 0.01)) == [1]
    t = CFG.server_timeout + 0.01
    # Server 1 does not answer either; its round ends, server 0 has its turn.
    while fsm.current == 1:
        t = round(t + 0.05, 2)
        fsm.tick(t)
    assert fsm.current == 0
    while fsm.current == 0:  # silent this time: left without a mark
        t = round(t + 0.05, 2)
        fsm.tick(t)
    assert fsm.current == 1
    assert fsm.update(0, Hugz(0, 0.25), t + 0.01) == [RequestSnapshot(0, ("",))]


def test_a_frozen_active_that_resumes_before_the_takeover_is_asked_again() -> None:
    """We left a silent server for a backup that refuses (its peer still looks
    alive to it); the old active's next HUGZ shows it is still the one."""
    fsm, (primary, _backup) = synced()
    fsm.update(0, Hugz(0, 0.25), 1.0)
    assert _requests(fsm.tick(2.0)) == [1]  # 4 heartbeats of silence
    assert fsm.tick(2.25) == [RequestSnapshot(1, ("",))]  # refused
    assert fsm.update(0, Hugz(0, 0.25), 2.4) == [RequestSnapshot(0, ("",))]
    feed_snapshot(fsm, primary, 2.45)
    assert fsm.state is State.ACTIVE and fsm.current == 0
    c = fsm.counters
    assert (c.failovers, c.hint_failovers) == (2, 1)


def test_a_dead_active_still_fails_over_to_a_backup_that_answers_late() -> None:
    """The crash case is unchanged: nothing comes from a dead server, so the
    backup is asked again until it takes over, and its HUGZ are its own."""
    fsm, (primary, backup) = synced()
    fsm.update(0, Hugz(0, 0.25), 0.5)
    backup.map, backup.seq = dict(primary.map), primary.seq
    assert _requests(fsm.server_disconnected(0, 0.6)) == [1]
    for t in (0.85, 1.1, 1.35):
        assert fsm.tick(t) == [RequestSnapshot(1, ("",))]
    assert fsm.update(1, Hugz(backup.seq, 0.25), 1.5) == []  # promoted: current, not a hint
    feed_snapshot(fsm, backup, 1.55)
    assert fsm.state is State.ACTIVE and fsm.current == 1
    c = fsm.counters
    assert (c.failovers, c.disconnect_failovers, c.hint_failovers) == (1, 1, 0)


def test_frozen_server_is_still_found_by_silence_alone() -> None:
    """No lost connection (SIGSTOP keeps it): fail over after server_timeout."""
    fsm, _ = synced()
    fsm.update(0, Hugz(0), 1.0)
    assert fsm.tick(3.49) == []
    assert _requests(fsm.tick(3.5)) == [1]
    assert fsm.counters.disconnect_failovers == 0 and fsm.counters.failovers == 1


def test_a_server_that_says_its_heartbeat_is_judged_by_it() -> None:
    """Our servers put ``heartbeat=250`` in HUGZ: silent for 4 of them (1 s) is
    gone, not the 2.5 s we assume of a server that does not say."""
    fsm, _ = synced()
    assert fsm.silence_timeout() == pytest.approx(2.5)
    fsm.update(0, Hugz(0, 0.25), 1.0)
    assert fsm.silence_timeout() == pytest.approx(4 * 0.25)
    assert fsm.tick(1.99) == []
    assert _requests(fsm.tick(2.0)) == [1]
    # Waiting for a snapshot from the next server: the configured timeout again,
    # since a passive server may hold our request until it gives up on its peer.
    assert fsm.state is State.SYNCING
    assert fsm.silence_timeout() == pytest.approx(2.5)


def test_a_server_that_stops_saying_its_heartbeat_falls_back_to_the_config() -> None:
    fsm, _ = synced()
    fsm.update(0, Hugz(0, 0.1), 1.0)
    fsm.update(0, Hugz(0), 1.1)  # a Guide server now answers at that address
    assert fsm.silence_timeout() == pytest.approx(2.5)
    assert fsm.tick(3.59) == []
    assert _requests(fsm.tick(3.6)) == [1]


def test_missed_heartbeats_is_configurable_and_checked() -> None:
    fsm = AgentFSM(None, AgentConfig(missed_heartbeats=2), now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    snapshot_reply(fsm, 0, SnapshotEnd(0), 0.0)
    fsm.update(0, Hugz(0, 0.5), 0.1)
    assert fsm.silence_timeout() == pytest.approx(1.0)
    with pytest.raises(ValueError, match="missed_heartbeats"):
        AgentConfig(missed_heartbeats=0)


def test_missed_heartbeats_none_ignores_what_servers_say() -> None:
    """How the frontend honours an explicit ``server_timeout``."""
    fsm = AgentFSM(None, AgentConfig(server_timeout=0.7, missed_heartbeats=None), now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    snapshot_reply(fsm, 0, SnapshotEnd(0), 0.0)
    fsm.update(0, Hugz(0, 0.05), 0.1)
    assert fsm.silence_timeout() == pytest.approx(0.7)
    assert fsm.tick(0.79) == []
    assert _requests(fsm.tick(0.8)) == [0]  # the only server, asked again


def test_streaming_snapshot_keeps_the_server_alive() -> None:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://a:1", 0.0)
    for i in range(10):
        snapshot_reply(fsm, 0, KVMsg(f"k{i}", i + 1, b"", (), b"v"), 2.0 * i)
        assert fsm.tick(2.0 * i + 1) == []
    assert fsm.counters.retries == 0


def test_silence_while_active_fails_over_with_a_fresh_map() -> None:
    fsm, (primary, backup) = synced()
    for key in ("a", "b", "c"):
        m = primary.apply(key, b"1")
        backup.map[key] = m
        fsm.update(0, m, 0.5)
    fsm.update(0, Hugz(primary.seq), 1.0)
    # primary dies; on the backup "b" gets deleted and "d" appears
    backup.seq = primary.seq
    backup.apply("b", b"")
    backup.apply("d", b"new")
    assert fsm.tick(3.4) == []
    actions = fsm.tick(3.5)
    assert StateChanged(State.SYNCING, 1) in actions
    # A catch-up from "c", which this backup cannot give: it sends a snapshot.
    assert RequestSnapshot(1, ("",), catch_up_of(backup.map["c"])) in actions
    # The old map stays readable while the new snapshot streams in.
    assert fsm.get("b") is not None
    actions = feed_snapshot(fsm, backup, 3.6)
    assert fsm.get("b") is None
    assert fsm.get("d") is not None
    changes = {a.key: a.entry for a in actions if isinstance(a, Changed)}
    assert set(changes) == {"b", "d"} and changes["b"] is None
    assert fsm.counters.failovers == 1 and fsm.counters.resyncs == 1


def test_updates_during_sync_are_buffered_and_replayed_after_kthxbai() -> None:
    fsm = AgentFSM(None, CFG)
    srv = MemoryServer(0)
    srv.apply("a", b"1")
    fsm.connect("tcp://a:1", 0.0)
    snap = srv.snapshot()  # [a@1, KTHXBAI(1)]
    published = [srv.apply("a", b"2"), srv.apply("b", b"old"), srv.apply("b", b"new")]
    for msg in published:  # they arrive while the snapshot streams
        assert fsm.update(0, msg, 0.1) == []
    assert fsm.state is State.SYNCING
    snapshot_reply(fsm, 0, snap[0], 0.2)
    snapshot_reply(fsm, 0, srv.map["b"], 0.2)  # fuzzy: b@4 is newer than KTHXBAI(1)
    actions = snapshot_reply(fsm, 0, snap[-1], 0.3)
    assert fsm.state is State.ACTIVE
    assert {m.key: m.body for m in fsm.items()} == {"a": b"2", "b": b"new"}
    assert fsm.last_sequence == 4
    assert {a.key for a in actions if isinstance(a, Changed)} == {"a", "b"}


def test_a_resyncs_changes_say_so_and_live_ones_do_not() -> None:
    """A watcher must know which changes skipped updates, in order with the
    changes: a counter read later cannot say (the chaos run's watchers)."""
    fsm, (srv, _) = synced()
    live = fsm.update(0, srv.apply("k", b"1"), 0.1)
    assert live == [Changed("k", srv.map["k"])] and not live[0].resync
    srv.apply("k", b"2")  # lost on the way: the resync skips it
    srv.apply("gone", b"x")
    fsm.update(0, srv.apply("k", b"3"), 0.2)  # a gap: resync
    srv.apply("gone", b"")
    assert fsm.state is State.SYNCING
    changes = [a for a in feed_snapshot(fsm, srv, 0.3) if isinstance(a, Changed)]
    assert [(c.key, c.entry and c.entry.body, c.resync) for c in changes] == [("k", b"3", True)]
    after = fsm.update(0, srv.apply("k", b"4"), 0.4)
    assert after == [Changed("k", srv.map["k"])] and not after[0].resync


def test_gap_inside_the_sync_buffer_resyncs() -> None:
    fsm = AgentFSM(None, CFG)
    srv = MemoryServer(0)
    fsm.connect("tcp://a:1", 0.0)
    srv.apply("a", b"1")  # missed: subscription not yet in place
    fsm.update(0, srv.apply("b", b"2"), 0.1)
    actions = feed_snapshot(fsm, MemoryServer(0), 0.2)  # a snapshot from before both
    assert RequestSnapshot(0, ("",)) in actions
    assert fsm.state is State.SYNCING and fsm.counters.gaps == 1


def test_messages_from_other_servers_are_ignored() -> None:
    fsm, (_srv, other) = synced()
    other.apply("x", b"1")
    assert fsm.update(1, other.map["x"], 0.1) == []
    assert snapshot_reply(fsm, 1, SnapshotEnd(5), 0.1) == []
    assert fsm.get("x") is None
    assert fsm.counters.foreign == 2


def test_subtrees_filter_and_each_gets_its_own_snapshot() -> None:
    srv = MemoryServer(0)
    srv.apply("/a/1", b"x")
    srv.apply("/b/1", b"y")
    srv.apply("/c/1", b"z")
    fsm = AgentFSM(["/b/", "/a/", "/a/deep/"], CFG)
    assert fsm.subtrees == ("/a/", "/b/")
    actions = fsm.connect("tcp://a:1", 0.0)
    assert RequestSnapshot(0, ("/a/", "/b/")) in actions
    feed_snapshot(fsm, srv, 0.1, "/a/")
    assert fsm.state is State.SYNCING
    feed_snapshot(fsm, srv, 0.1, "/b/")
    assert fsm.state is State.ACTIVE
    assert [m.key for m in fsm.items()] == ["/a/1", "/b/1"]
    # updates outside the subtrees advance the sequence but are not stored
    fsm.update(0, srv.apply("/c/2", b"q"), 0.2)
    fsm.update(0, srv.apply("/a/2", b"r"), 0.2)
    assert fsm.counters.gaps == 0
    assert [m.key for m in fsm.items("/a/")] == ["/a/1", "/a/2"]


def test_normalize_subtrees() -> None:
    assert normalize_subtrees(None) == ("",)
    assert normalize_subtrees([]) == ("",)
    assert normalize_subtrees(["/a/", ""]) == ("",)
    with pytest.raises(Exception, match="segment"):
        normalize_subtrees("a/")
    with pytest.raises(TypeError):
        normalize_subtrees([b"/a/"])  # type: ignore[list-item]


def test_confirmed_write_is_confirmed_when_its_uuid_comes_back() -> None:
    fsm, (srv, _) = synced()
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    assert fsm.write(msg, 1.0, confirm_within=5.0) == [SendUpdate(msg)]
    actions = fsm.update(0, srv.apply("k", b"v", msg.uuid), 1.1)
    assert actions[-1] == Confirmed(msg.uuid, srv.seq)  # with the sequence it got
    assert fsm.get("k") is not None  # applied before confirmed
    assert fsm.pending_writes == 0


def test_unconfirmed_write_is_resent_then_given_up() -> None:
    fsm, (srv, _) = synced()
    prove_collector(fsm, srv, 0.5)
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    fsm.write(msg, 1.0, confirm_within=2.0)
    fsm.update(0, Hugz(srv.seq), 1.2)
    assert fsm.tick(1.4) == []
    assert fsm.tick(1.5) == [SendUpdate(msg)]
    assert fsm.tick(2.0) == [SendUpdate(msg)]
    fsm.update(0, Hugz(srv.seq), 2.5)
    assert fsm.tick(3.0) == []
    assert fsm.pending_writes == 0 and fsm.counters.expired_writes == 1


def test_confirmed_write_survives_failover() -> None:
    fsm, (_primary, backup) = synced()
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    fsm.write(msg, 0.5, confirm_within=10.0)
    # neither server publishes it; the primary dies
    actions = fsm.tick(2.5)
    assert RequestSnapshot(1, ("",)) in actions
    actions = feed_snapshot(fsm, backup, 2.6)
    assert SendUpdate(msg) in actions  # resent to the new server, same uuid
    actions = fsm.update(1, backup.apply("k", b"v", msg.uuid), 2.7)
    assert Confirmed(msg.uuid, backup.seq) in actions


def test_write_published_during_sync_is_confirmed_at_the_swap() -> None:
    fsm = AgentFSM(None, CFG)
    srv = MemoryServer(0)
    fsm.connect("tcp://a:1", 0.0)
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    fsm.write(msg, 0.0, confirm_within=5.0)
    snap = srv.snapshot()
    pub = srv.apply("k", b"v", msg.uuid)
    assert fsm.update(0, pub, 0.1) == []  # buffered, not confirmed yet
    actions = []
    for m in snap:
        actions += snapshot_reply(fsm, 0, m, 0.2)
    assert Confirmed(msg.uuid, pub.sequence) in actions
    assert fsm.get("k") is not None


def test_write_seen_in_a_gap_is_confirmed_after_the_resync() -> None:
    fsm, (srv, _) = synced()
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    fsm.write(msg, 0.0, confirm_within=5.0)
    srv.apply("x", b"lost")
    seen = srv.apply("k", b"v", msg.uuid)
    fsm.update(0, seen, 0.1)  # gap -> resync
    srv.apply("k", b"overwritten")  # so the snapshot no longer carries our uuid
    actions = feed_snapshot(fsm, srv, 0.2)
    assert Confirmed(msg.uuid, seen.sequence) in actions
    assert not any(isinstance(a, SendUpdate) for a in actions)


def test_config_from_heartbeat() -> None:
    cfg = AgentConfig.from_heartbeat(0.1)
    assert cfg.server_timeout == pytest.approx(0.25)
    assert cfg.resend_interval == pytest.approx(0.05)
    assert cfg.reask_interval == pytest.approx(0.025)
    with pytest.raises(ValueError):
        AgentConfig(reask_interval=0)
    with pytest.raises(ValueError):
        AgentConfig.from_heartbeat(0)
    with pytest.raises(ValueError):
        AgentConfig(requests_per_server=0)


_ops = st.lists(
    st.tuples(st.sampled_from(["a", "b", "c", "d"]), st.sampled_from([b"", b"1", b"2"])),
    max_size=30,
)


@settings(max_examples=200, deadline=None)
@given(before=_ops, during=_ops, after=_ops, cut=st.integers(0, 30))
def test_client_converges_to_the_server_state(
    before: list[tuple[str, bytes]],
    during: list[tuple[str, bytes]],
    after: list[tuple[str, bytes]],
    cut: int,
) -> None:
    """Whatever happens around a fuzzy snapshot, the client ends equal to the server.

    The snapshot is taken at some point, its entries are read while updates keep
    coming (so some entries are newer than KTHXBAI), and every update is also
    published to the subscriber.
    """
    srv = MemoryServer(0)
    for k, v in before:
        srv.apply(k, v)
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    snap_seq = srv.seq
    published = [srv.apply(k, v) for k, v in during]
    # fuzzy: entries as of a later point (cut into the 'during' updates)
    fuzzy_state: dict[str, KVMsg] = {}
    replay = MemoryServer(0)
    for k, v in before:
        replay.apply(k, v)
    for k, v in during[: min(cut, len(during))]:
        replay.apply(k, v)
    fuzzy_state = dict(replay.map)
    for update in published:
        fsm.update(0, update, 0.1)
    for m in sorted(fuzzy_state.values(), key=lambda m: m.key):
        snapshot_reply(fsm, 0, m, 0.2)
    snapshot_reply(fsm, 0, SnapshotEnd(snap_seq), 0.2)
    for k, v in after:
        fsm.update(0, srv.apply(k, v), 0.3)
    assert fsm.state is State.ACTIVE
    assert {m.key: m.body for m in fsm.items()} == {k: m.body for k, m in srv.map.items()}


def test_new_uuid_is_sixteen_bytes() -> None:
    assert len(new_uuid()) == 16


def test_writes_after_the_snapshot_wait_until_the_collector_republishes_one() -> None:
    """CI: a dump lacked /pipe/0000..0177, writes a server never received.  A
    snapshot comes on another connection than our PUB's, and a PUB drops
    every message until the collector's subscription reaches it: the first
    fire-and-forget writes after the sync were lost.  Now the first goes
    alone, again every resend_interval, and the rest follow it, in order,
    once the server republished it."""
    fsm, (srv, _) = synced()
    first, second, third, fourth = (
        KVMsg.build(f"/pipe/{i:04d}", b"x", uuid=new_uuid()) for i in range(4)
    )
    assert fsm.write(first, 1.0, confirm_within=None) == [SendUpdate(first)]  # the probe
    assert fsm.write(second, 1.0, confirm_within=None) == []
    assert fsm.write(third, 1.01, confirm_within=None) == []
    assert fsm.held_writes == 3
    assert fsm.next_deadline() == 1.0 + CFG.resend_interval
    assert fsm.tick(1.2) == []
    # The PUB dropped it (nothing came back): the probe again, alone.
    assert fsm.tick(1.5) == [SendUpdate(first)]
    assert fsm.counters.collector_probes == 2
    fsm.update(0, srv.apply(first.key, b"x", first.uuid), 1.6)
    assert fsm.next_deadline() == 0.0
    assert fsm.tick(1.6) == [SendUpdate(second), SendUpdate(third)]  # not the probe again
    assert fsm.write(fourth, 1.7, confirm_within=None) == [SendUpdate(fourth)]
    # Our PUB reconnects to that server's collector: a new link, proven again.
    fsm.server_disconnected(1, 1.8)  # not the collector we proved: nothing changes
    assert fsm.write(KVMsg.build("/a", b"1", uuid=new_uuid()), 1.8, confirm_within=None) != []
    fsm.server_reconnected(0, 1.9)
    fifth = KVMsg.build("/b", b"1", uuid=new_uuid())
    sixth = KVMsg.build("/c", b"1", uuid=new_uuid())
    assert fsm.write(fifth, 1.9, confirm_within=None) == [SendUpdate(fifth)]
    assert fsm.write(sixth, 1.9, confirm_within=None) == []


def test_a_probe_never_republished_stops_holding_writes_after_the_server_timeout() -> None:
    """A resent probe the server deduplicated is never republished (we missed
    the first copy's update): the writes go unproven rather than never."""
    fsm, (srv, _) = synced()
    probe, held = (KVMsg.build(k, b"x", uuid=new_uuid()) for k in ("/p", "/q"))
    assert fsm.write(probe, 1.0, confirm_within=None) == [SendUpdate(probe)]
    assert fsm.write(held, 1.0, confirm_within=None) == []
    now = 1.0
    while now < 1.0 + CFG.server_timeout - 0.5:
        now += 0.5
        fsm.update(0, Hugz(srv.seq), now)  # alive, but our probe never shows
        assert fsm.tick(now) == [SendUpdate(probe)]
    fsm.update(0, Hugz(srv.seq), 1.0 + CFG.server_timeout)
    assert fsm.tick(1.0 + CFG.server_timeout) == [SendUpdate(probe), SendUpdate(held)]
    assert fsm.counters.collector_unproven == 1 and fsm.held_writes == 0


def test_writes_before_the_first_snapshot_are_held_until_it_completes() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    early = KVMsg.build("a", b"1", uuid=new_uuid())
    confirmed = KVMsg.build("b", b"2", uuid=new_uuid())
    assert fsm.write(early, 0.0, confirm_within=None) == []
    assert fsm.write(confirmed, 0.0, confirm_within=5.0) == []
    assert not any(isinstance(a, SendUpdate) for a in fsm.tick(1.0))  # no resend while held
    actions = snapshot_reply(fsm, 0, SnapshotEnd(0), 1.1)
    # The first goes alone, as the probe of our PUB's link to the collector.
    sends = [a.msg for a in actions if isinstance(a, SendUpdate)]
    assert sends == [early]
    later = KVMsg.build("c", b"3", uuid=new_uuid())
    assert fsm.write(later, 1.2, confirm_within=None) == []  # behind the probe
    fsm.update(0, KVMsg("a", 1, early.uuid, (), b"1"), 1.3)
    assert fsm.next_deadline() == 0.0  # the rest go at once
    assert fsm.tick(1.3) == [SendUpdate(confirmed), SendUpdate(later)]
    assert fsm.write(KVMsg.build("d", b"4", uuid=new_uuid()), 1.4, confirm_within=None) != []


# --------------------------------------------------------------------------
# Snapshot batches: raw frames, one event per batch


def _snapshot_source(*extra: tuple[str, bytes]) -> tuple[MemoryServer, KVMsg]:
    """A server with /a/0../a/6 (uuids), ``extra`` keys, /a/3 deleted again, and
    an ephemeral key with properties for the caller to place."""
    srv = MemoryServer(0)
    for i in range(7):
        srv.apply(f"/a/{i}", b"v%d" % i, new_uuid())
    for key, body in extra:
        srv.apply(key, body)
    srv.apply("/a/3", b"")  # deleted before the snapshot
    ttl = KVMsg("/a/ttl", 99, new_uuid(), (("ttl", "5"), ("expires", "1.5")), b"t")
    return srv, ttl


@pytest.mark.parametrize("size", [1, 2, 1000])
def test_batched_snapshot_equals_the_decoded_one(size: int) -> None:
    srv, ttl = _snapshot_source(("/b/x", b"other"))
    one, many = AgentFSM("/a/", CFG), AgentFSM("/a/", CFG)
    for fsm in (one, many):
        fsm.connect("tcp://a:1", 0.0)
        snapshot_reply(fsm, 0, ttl, 0.0)
    feed_snapshot(one, srv, 0.1, "/a/")
    actions = feed_batches(many, srv, 0.1, "/a/", size)
    assert StateChanged(State.ACTIVE, 0) in actions
    assert many.items() == one.items()
    assert many.last_sequence == one.last_sequence == srv.seq
    got = many.get("/a/ttl")
    assert got == ttl and got is not None and got.prop("expires") == "1.5"
    assert many.get("/a/1") == srv.map["/a/1"]
    assert many.rows("/a/1") == [("/a/1", (2, srv.map["/a/1"].uuid, (), b"v1"))]


GARBAGE: list[list[bytes]] = [
    [b"only one frame"],
    [b"k", b"short", b"", b"", b"v"],
    [b"k", bytes(8), b"bad uuid", b"", b"v"],
    [b"\xff\xfe", bytes(8), b"", b"", b"v"],
    [b"k", bytes(8), b"", b"no-equals-sign\n", b"v"],
    [b"k", bytes(8), b"", b"a=1\na=2\n", b"v"],
    [b"", bytes(8), b"", b"", b"v"],
    [b"HUGZ", bytes(8), b"", b"", b"v"],
    [b"k" * 1025, bytes(8), b"", b"", b"v"],
    [b"k", bytes(8), b"", b"", b"v" * (1024 * 1024 + 1)],
    [b"KTHXBAI", b"\x01"],
    [b"KTHXBAI", bytes(8), b"", b"", b"not/a/subtree"],
    [b"k", bytes(8), b"", b"", b"v", b"sixth"],
]


def test_malformed_entries_in_a_batch_are_counted_and_dropped() -> None:
    for frames in GARBAGE:  # the codec refuses each one
        with pytest.raises(ProtocolError):
            decode_snapshot_reply(frames)
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    good = encode_kv(KVMsg("good", 1, b"", (), b"v"))
    actions = fsm.snapshot_batch(0, [*GARBAGE, good, encode_kthxbai(1)], 0.1)
    assert fsm.counters.protocol_errors == len(GARBAGE)
    dropped = [a for a in actions if isinstance(a, Malformed)]
    assert len(dropped) == len(GARBAGE) and all(a.server == 0 for a in dropped)
    assert "frames" in dropped[0].error  # the codec's own reason
    assert fsm.state is State.ACTIVE
    assert [m.key for m in fsm.items()] == ["good"]


def test_a_batch_of_garbage_alone_is_not_an_answer() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(0, GARBAGE, 0.1)
    # Still re-asking: garbage does not prove the server serves us.
    assert [a for a in fsm.tick(0.3) if isinstance(a, RequestSnapshot)]


def test_replies_after_the_kthxbai_in_a_batch_are_late_and_still_checked() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    late = encode_kv(KVMsg("late", 5, b"", (), b"v"))
    fsm.snapshot_batch(0, [encode_kthxbai(0), late, [b"bad"]], 0.1)
    assert fsm.state is State.ACTIVE
    assert fsm.get("late") is None
    assert fsm.counters.protocol_errors == 1


def test_a_batch_stops_when_its_kthxbai_starts_a_new_request() -> None:
    srv = MemoryServer(0)
    srv.apply("a", b"1")
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    fsm.update(0, KVMsg("x", 5, b"", (), b"v"), 0.05)  # buffered: a gap after seq 1
    batch = [raw(m) for m in srv.snapshot()] + [encode_kv(KVMsg("stale", 1, b"", (), b"v"))]
    actions = fsm.snapshot_batch(0, batch, 0.1)
    assert RequestSnapshot(0, ("",)) in actions
    assert fsm.state is State.SYNCING and fsm.counters.gaps == 1
    feed_batches(fsm, srv, 0.2)
    assert [m.key for m in fsm.items()] == ["a"]  # "stale" answered the old request


def test_batches_with_several_subtrees() -> None:
    srv = MemoryServer(0)
    for key in ("/a/1", "/b/1", "/c/1"):
        srv.apply(key, b"v")
    fsm = AgentFSM(["/a/", "/b/"], CFG)
    fsm.connect("tcp://a:1", 0.0)
    both = [raw(m) for m in srv.snapshot("/a/") + srv.snapshot("/b/")]
    fsm.snapshot_batch(0, both, 0.1)
    assert fsm.state is State.ACTIVE
    assert [m.key for m in fsm.items()] == ["/a/1", "/b/1"]


def test_a_batch_from_another_server_is_foreign() -> None:
    fsm, _ = synced()
    assert fsm.snapshot_batch(1, [[b"x"], [b"y"]], 1.0) == []
    assert fsm.counters.foreign == 2 and fsm.counters.protocol_errors == 0


def test_swap_confirms_a_pending_write_found_in_the_new_map() -> None:
    fsm, srvs = synced()
    uuid = new_uuid()
    fsm.write(KVMsg("k", 0, uuid, (), b"v"), 1.0, confirm_within=10.0)
    srvs[1].apply("k", b"v", uuid)
    fsm.server_disconnected(0, 1.1)  # fail over to server 1
    actions = feed_batches(fsm, srvs[1], 1.2)
    assert Confirmed(uuid, srvs[1].map["k"].sequence) in actions and fsm.pending_writes == 0


_frame = st.binary(max_size=20) | st.sampled_from(
    [b"KTHXBAI", b"HUGZ", bytes(8), b"a=1\n", b"\xff", b"/a/", bytes(16)]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_frame, min_size=0, max_size=6), max_size=12))
def test_batch_accepts_exactly_what_the_codec_accepts(batch: list[list[bytes]]) -> None:
    """A batch at once does what its replies do one by one, decoded by the codec
    (whose fast path is checked against it in tests/wire/test_codec.py)."""
    fast, slow = AgentFSM(None, CFG), AgentFSM(None, CFG)
    for fsm in (fast, slow):
        fsm.connect("tcp://a:1", 0.0)
    fast.snapshot_batch(0, batch, 0.1)
    for frames in batch:
        if slow.state is not State.SYNCING:
            break
        if frames and is_kvdelta(frames):
            # Never asked for (nor the first reply): refused, and the rest,
            # which answer the abandoned request, are not read.
            slow.snapshot_batch(0, [frames], 0.1)
            break
        try:
            msg = decode_snapshot_reply(frames)
        except ProtocolError:
            slow.protocol_error(0)
            continue
        snapshot_reply(slow, 0, msg, 0.1)
    if slow.state is State.SYNCING:
        assert fast.counters.protocol_errors == slow.counters.protocol_errors
    assert fast.state is slow.state
    assert fast.items() == slow.items()


# --------------------------------------------------------------------------
# KVBATCH (our extension): many entries per message, accepted or dropped whole


def kvbatch(msgs: list[KVMsg]) -> list[bytes]:
    return encode_kvbatch([m.key.encode() for m in msgs], [entry_of(m) for m in msgs])


def kvbatches(srv: MemoryServer, subtree: str = "", size: int = 3) -> list[list[bytes]]:
    """The snapshot as our server sends it to a client that asked for batches."""
    *entries, end = srv.snapshot(subtree)
    msgs = [m for m in entries if isinstance(m, KVMsg)]
    out = [kvbatch(msgs[i : i + size]) for i in range(0, len(msgs), size)]
    return [*out, raw(end)]


@pytest.mark.parametrize(("per_batch", "per_event"), [(1, 1), (3, 2), (1000, 1000)])
def test_kvbatch_snapshot_equals_the_decoded_one(per_batch: int, per_event: int) -> None:
    srv, ttl = _snapshot_source(("/a/é", b"\x00"))
    srv.map["/a/ttl"] = ttl
    one, many = AgentFSM("/a/", CFG), AgentFSM("/a/", CFG)
    for fsm in (one, many):
        fsm.connect("tcp://a:1", 0.0)
    feed_snapshot(one, srv, 0.1, "/a/")
    frames = kvbatches(srv, "/a/", per_batch)
    actions = []
    for i in range(0, len(frames), per_event):
        actions += many.snapshot_batch(0, frames[i : i + per_event], 0.1)
    assert StateChanged(State.ACTIVE, 0) in actions
    assert many.items() == one.items() and len(many) == 8
    assert many.get("/a/ttl") == ttl
    assert many.rows("/a/1") == [("/a/1", (2, srv.map["/a/1"].uuid, (), b"v1"))]
    assert many.counters.protocol_errors == 0


def test_kvbatch_entries_that_are_deletes_or_outside_the_subtrees_are_skipped() -> None:
    fsm = AgentFSM(["/a/", "/b/"], CFG)
    fsm.connect("tcp://a:1", 0.0)
    batch = kvbatch(
        [
            KVMsg("/a/1", 1, b"", (), b"v"),
            KVMsg("/a/gone", 2, b"", (), b""),  # an empty body is a delete
            KVMsg("/c/1", 3, b"", (), b"v"),  # not ours
            KVMsg("/b/1", 4, b"", (), b"w"),
        ]
    )
    fsm.snapshot_batch(0, [batch, encode_kthxbai(4, "/a/"), encode_kthxbai(4, "/b/")], 0.1)
    assert fsm.state is State.ACTIVE
    assert [(m.key, m.body) for m in fsm.items()] == [("/a/1", b"v"), ("/b/1", b"w")]


def test_kvbatch_and_kvsyncs_mix_in_one_event() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(
        0,
        [
            encode_kv(KVMsg("a", 1, b"", (), b"1")),
            kvbatch([KVMsg("b", 2, b"", (), b"2"), KVMsg("c", 3, b"", (), b"3")]),
            encode_kv(KVMsg("d", 4, b"", (), b"4")),
            encode_kthxbai(4),
        ],
        0.1,
    )
    assert [m.key for m in fsm.items()] == ["a", "b", "c", "d"]


def test_a_malformed_kvbatch_is_dropped_whole_and_counted() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    good = kvbatch([KVMsg("a", 1, b"", (), b"1"), KVMsg("b", 2, b"", (), b"2")])
    bad_key = kvbatch([KVMsg("c", 3, b"", (), b"3"), KVMsg("d", 4, b"", (), b"4")])
    bad_key[2] = b"c\xff"  # entry 1's key is not UTF-8; entry 0 is fine but goes too
    short = [*good[:9], good[9][:-1]]  # bodies shorter than their lengths say
    actions = fsm.snapshot_batch(0, [bad_key, short, good, encode_kthxbai(2)], 0.1)
    dropped = [a for a in actions if isinstance(a, Malformed)]
    assert [(a.what, a.server) for a in dropped] == [("snapshot batch", 0)] * 2
    assert "entry 1: key is not UTF-8" in dropped[0].error
    assert "body lengths add up to 2 bytes but the frame has 1" in dropped[1].error
    assert fsm.counters.protocol_errors == 2
    assert fsm.state is State.ACTIVE
    assert [m.key for m in fsm.items()] == ["a", "b"]


def test_a_malformed_kvbatch_alone_is_not_an_answer() -> None:
    fsm = AgentFSM(None, CFG)
    fsm.connect("tcp://a:1", 0.0)
    fsm.snapshot_batch(0, [[b"KVBATCH", *[b""] * 9]], 0.1)
    assert fsm.counters.protocol_errors == 1
    assert [a for a in fsm.tick(0.3) if isinstance(a, RequestSnapshot)]


def test_late_kvbatches_are_checked_but_not_stored() -> None:
    fsm, _ = synced()
    late = kvbatch([KVMsg("late", 5, b"", (), b"v")])
    bad = [*late[:3], b"\x00" * 7, *late[4:]]  # sequences of the wrong size
    fsm.snapshot_batch(0, [late, bad], 1.0)
    assert fsm.get("late") is None
    assert fsm.counters.protocol_errors == 1
    assert fsm.snapshot_batch(1, [late], 1.0) == []  # another server's: foreign
    assert fsm.counters.foreign == 1


def test_a_freeze_of_our_own_process_resyncs_from_the_same_server() -> None:
    """A tick long after the last (our process was stopped) is not the server's
    silence: no failover, a resync from the same server, said and counted."""
    fsm = AgentFSM(None, AgentConfig(server_timeout=1.0, freeze_gap=1.5), now=0.0)
    server = MemoryServer(0)
    fsm.connect("tcp://127.0.0.1:5556", 0.0)
    fsm.connect("tcp://127.0.0.1:5566", 0.0)
    feed_snapshot(fsm, server, 0.0, "")
    assert fsm.state is State.ACTIVE and fsm.current == 0
    fsm.tick(0.5)
    actions = fsm.tick(10.0)  # 9.5 s without a tick: we were frozen
    assert fsm.current == 0 and fsm.state is State.SYNCING
    assert any(isinstance(a, RequestSnapshot) and a.server == 0 for a in actions)
    assert fsm.counters.self_freezes == 1 and fsm.counters.failovers == 0
    # Without freeze_gap (a fake clock that jumps) the same gap is silence.
    other = AgentFSM(None, AgentConfig(server_timeout=1.0), now=0.0)
    other.connect("tcp://127.0.0.1:5556", 0.0)
    other.connect("tcp://127.0.0.1:5566", 0.0)
    feed_snapshot(other, MemoryServer(0), 0.0, "")
    other.tick(0.5)
    other.tick(10.0)
    assert other.counters.self_freezes == 0 and other.counters.failovers == 1


def test_a_writes_frames_are_sent_as_the_frontend_built_them() -> None:
    """Encoded once, in the frontend: the first send carries those very frames;
    a resend (rare) encodes the message again."""
    fsm, _ = synced()
    msg = KVMsg.build("k", b"v", uuid=new_uuid())
    frames = encode_kv(msg)
    (first,) = fsm.write_confirmed(msg, 1.0, within=5.0, frames=frames)
    assert isinstance(first, SendUpdate) and first.frames is frames
    (again,) = fsm.tick(1.5)
    assert isinstance(again, SendUpdate) and again.msg == msg and again.frames is None
    (oneway,) = fsm.write(msg, 2.0, confirm_within=None, frames=frames)
    assert isinstance(oneway, SendUpdate) and oneway.frames is frames


def test_an_update_older_than_the_fuzzy_snapshots_entry_arriving_after_it_is_skipped() -> None:
    """The subscription lagged the snapshot (a connection TCP backed off
    through a partition delivers late): updates between KTHXBAI's sequence and
    a fuzzy entry's arrive after the sync, and must not take the key back."""
    fsm = AgentFSM(None, CFG)
    srv = MemoryServer(0)
    srv.apply("a", b"1")
    fsm.connect("tcp://a:1", 0.0)
    snap = srv.snapshot()  # [a@1, KTHXBAI(1)]
    late = [srv.apply("a", b"2"), srv.apply("a", b"3")]
    snapshot_reply(fsm, 0, srv.map["a"], 0.1)  # fuzzy: a@3
    snapshot_reply(fsm, 0, snap[-1], 0.1)
    assert fsm.state is State.ACTIVE and fsm.get("a") == srv.map["a"]
    assert fsm.update(0, late[0], 0.2) == []  # a@2: older than the a@3 held
    assert fsm.get("a") == srv.map["a"] and fsm.last_sequence == 2
    assert fsm.update(0, late[1], 0.2) == []  # a@3 itself: nothing changes
    changed = fsm.update(0, srv.apply("a", b"4"), 0.3)
    assert [(a.key, a.entry.body if a.entry else None) for a in changed
            if isinstance(a, Changed)] == [("a", b"4")]


def test_every_write_is_a_change_even_one_that_keeps_the_value() -> None:
    """A watcher waits for writes (a rewrite is news: a heartbeat key, a
    re-registration), as etcd's watchers and the history feed see them; a
    delete of a key we never had is not a change."""
    fsm, (srv, _) = synced(2)
    fsm.emit_changes = True
    changes: list[tuple[str, bytes | None, int]] = []
    for key, body in [("a", b"1"), ("a", b"1"), ("a", b"1"), ("a", b""), ("gone", b"")]:
        for a in fsm.update(0, srv.apply(key, body), 0.1):
            if isinstance(a, Changed):
                assert a.entry is not None
                changes.append((a.key, a.entry.body or None, a.entry.sequence))
    assert changes == [("a", b"1", 1), ("a", b"1", 2), ("a", b"1", 3), ("a", None, 4)]


@settings(max_examples=200, deadline=None)
@given(before=_ops, during=_ops, after=_ops, cut=st.integers(0, 30), lag=st.integers(0, 30))
def test_no_key_goes_back_whatever_the_subscription_lags(
    before: list[tuple[str, bytes]],
    during: list[tuple[str, bytes]],
    after: list[tuple[str, bytes]],
    cut: int,
    lag: int,
) -> None:
    """A fuzzy snapshot (entries as of ``cut`` updates past KTHXBAI), and the
    updates published meanwhile reaching the client partly before the end of
    the sync and partly (``lag`` of them, the last) after it: every change the
    client reports moves its key forward, and it ends equal to the server."""
    srv = MemoryServer(0)
    for k, v in before:
        srv.apply(k, v)
    fsm = AgentFSM(None, CFG)
    fsm.emit_changes = True
    fsm.connect("tcp://a:1", 0.0)
    snap_seq = srv.seq
    published = [srv.apply(k, v) for k, v in during]
    replay = MemoryServer(0)
    for k, v in [*before, *during[: min(cut, len(during))]]:
        replay.apply(k, v)
    split = max(0, len(published) - lag)
    seen: dict[str, int] = {}
    actions: list[object] = []
    for update in published[:split]:
        actions += fsm.update(0, update, 0.1)
    for m in sorted(replay.map.values(), key=lambda m: m.key):
        actions += snapshot_reply(fsm, 0, m, 0.2)
    actions += snapshot_reply(fsm, 0, SnapshotEnd(snap_seq), 0.2)
    for update in [*published[split:], *(srv.apply(k, v) for k, v in after)]:
        actions += fsm.update(0, update, 0.3)
    for a in actions:
        if isinstance(a, Changed) and a.entry is not None:
            assert a.entry.sequence >= seen.get(a.key, 0), (a.key, a.entry.sequence, seen)
            seen[a.key] = a.entry.sequence
    assert fsm.state is State.ACTIVE
    assert {m.key: m.body for m in fsm.items()} == {k: m.body for k, m in srv.map.items()}
