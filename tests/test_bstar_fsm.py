"""Binary Star state machine and wire format: no sockets, a fake clock, table-driven.

The expectations below are written out by hand from docs/failover.md rather than
derived from ``bstar.fsm.TRANSITIONS``, so that a wrong table row fails a test.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bstar import (
    TRANSITIONS,
    BinaryStarError,
    BinaryStarFSM,
    Conflict,
    Event,
    IllegalTransitionError,
    PeerStateError,
    RoleConflictError,
    State,
    Vote,
    decode_state,
    encode_state,
    peer_event,
)

P, B, A, S = State.PRIMARY, State.BACKUP, State.ACTIVE, State.PASSIVE
PRI, BAK = True, False
HEARTBEAT, MISSED = 1.0, 2
EXPIRY = HEARTBEAT * MISSED  # every machine built by _reach() expires at this time
ALIVE_AT = 1.0  # a moment when the peer is still alive
JUST_BEFORE = math.nextafter(EXPIRY, 0.0)


class FakeClock:
    """Time that moves only when the test says so."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


def _reach(primary: bool, state: State) -> BinaryStarFSM:
    """A machine in ``state`` reached through the public API, peer last heard at 0.

    For the fresh start states no contact happened; the start time (0) stands in,
    so in every case the peer expires at EXPIRY.
    """
    fsm = BinaryStarFSM(primary, 0.0, heartbeat=HEARTBEAT, missed=MISSED)
    if state in (P, B):
        pass
    elif state is S:
        fsm.receive_peer_state(A, 0.0)
    elif primary:  # primary ACTIVE
        fsm.receive_peer_state(B, 0.0)
    else:  # backup ACTIVE: stand by, then fail over on a vote once the primary is dead
        fsm.receive_peer_state(A, 0.0)
        assert fsm.client_request(EXPIRY).accepted
        assert fsm.last_peer_contact == 0.0
    assert fsm.state is state
    return fsm


REACHABLE = [(PRI, P), (PRI, A), (PRI, S), (BAK, B), (BAK, A), (BAK, S)]
PEER_EVENTS = [Event.PEER_PRIMARY, Event.PEER_BACKUP, Event.PEER_ACTIVE, Event.PEER_PASSIVE]

# (role, state, peer event) -> (next state, conflict) or the error raised.
PEER_RULES: dict[tuple[bool, State, Event], tuple[State, Conflict | None] | type[Exception]] = {
    (PRI, P, Event.PEER_PRIMARY): RoleConflictError,
    (PRI, P, Event.PEER_BACKUP): (A, None),
    (PRI, P, Event.PEER_ACTIVE): (S, None),
    (PRI, P, Event.PEER_PASSIVE): (P, None),
    (PRI, A, Event.PEER_PRIMARY): RoleConflictError,
    (PRI, A, Event.PEER_BACKUP): (A, None),
    (PRI, A, Event.PEER_ACTIVE): (A, Conflict.SPLIT_BRAIN),
    (PRI, A, Event.PEER_PASSIVE): (A, None),
    (PRI, S, Event.PEER_PRIMARY): RoleConflictError,
    (PRI, S, Event.PEER_BACKUP): (A, None),
    (PRI, S, Event.PEER_ACTIVE): (S, None),
    (PRI, S, Event.PEER_PASSIVE): (A, Conflict.DUAL_PASSIVE),
    (BAK, B, Event.PEER_PRIMARY): (B, None),
    (BAK, B, Event.PEER_BACKUP): RoleConflictError,
    (BAK, B, Event.PEER_ACTIVE): (S, None),
    (BAK, B, Event.PEER_PASSIVE): (B, None),
    (BAK, A, Event.PEER_PRIMARY): (A, None),
    (BAK, A, Event.PEER_BACKUP): RoleConflictError,
    (BAK, A, Event.PEER_ACTIVE): (S, Conflict.SPLIT_BRAIN),
    (BAK, A, Event.PEER_PASSIVE): (A, None),
    (BAK, S, Event.PEER_PRIMARY): (A, None),
    (BAK, S, Event.PEER_BACKUP): RoleConflictError,
    (BAK, S, Event.PEER_ACTIVE): (S, None),
    (BAK, S, Event.PEER_PASSIVE): (S, Conflict.DUAL_PASSIVE),
}

# (role, state) -> (next state, vote) while the peer lives, then once it expired.
VOTE_RULES: dict[tuple[bool, State], tuple[tuple[State, Vote], tuple[State, Vote]]] = {
    (PRI, P): ((P, Vote.REFUSED), (A, Vote.ACCEPTED)),
    (PRI, A): ((A, Vote.ACCEPTED), (A, Vote.ACCEPTED)),
    (PRI, S): ((S, Vote.REFUSED), (A, Vote.ACCEPTED)),
    (BAK, B): ((B, Vote.REFUSED), (B, Vote.REFUSED)),
    (BAK, A): ((A, Vote.ACCEPTED), (A, Vote.ACCEPTED)),
    (BAK, S): ((S, Vote.REFUSED), (A, Vote.ACCEPTED)),
}


def _case_id(case: tuple[bool, State] | tuple[bool, State, Event]) -> str:
    role, state = case[0], case[1]
    names = [state.name, *(event.name for event in case[2:])]
    return "-".join(["primary" if role else "backup", *names])


def test_expectations_cover_every_reachable_state_event_pair() -> None:
    expected = {(r, s, e) for r, s in REACHABLE for e in PEER_EVENTS}
    assert set(PEER_RULES) == expected
    assert set(VOTE_RULES) == set(REACHABLE)
    assert len(expected) + len(VOTE_RULES) == len(REACHABLE) * len(Event)


def test_table_has_a_rule_for_every_pair_except_same_role_starts() -> None:
    missing = {key for key in itertools.product(State, Event) if key not in TRANSITIONS}
    assert missing == {(P, Event.PEER_PRIMARY), (B, Event.PEER_BACKUP)}


@pytest.mark.parametrize(
    "case", [(r, s, e) for r, s in REACHABLE for e in PEER_EVENTS], ids=_case_id
)
@pytest.mark.parametrize("now", [ALIVE_AT, JUST_BEFORE, EXPIRY, EXPIRY + 5.0])
def test_peer_event(case: tuple[bool, State, Event], now: float) -> None:
    role, state, event = case
    fsm = _reach(role, state)
    before = fsm.counters
    expected = PEER_RULES[case]
    if isinstance(expected, type):
        with pytest.raises(expected) as info:
            fsm.handle(event, now)
        assert isinstance(info.value, IllegalTransitionError)
        assert isinstance(info.value, BinaryStarError)
        assert (info.value.state, info.value.event) == (state, event)
        assert fsm.state is state
        assert fsm.counters.illegal_events == before.illegal_events + 1
        assert fsm.counters.transitions == before.transitions
        # Even a rejected message proves someone is alive at the peer endpoint.
        assert fsm.last_peer_contact == now
        return
    next_state, conflict = expected
    outcome = fsm.handle(event, now)
    assert (outcome.previous, outcome.state, outcome.event) == (state, next_state, event)
    assert fsm.state is next_state
    assert outcome.vote is None
    assert outcome.conflict is conflict
    assert outcome.why
    assert outcome.became_active == (state is not A and next_state is A)
    assert outcome.became_passive == (state is not S and next_state is S)
    assert outcome.split_brain_detected == (conflict is Conflict.SPLIT_BRAIN)
    assert fsm.last_peer_contact == now
    assert fsm.peer_state is State(event.value)
    assert fsm.peer_expiry == now + EXPIRY
    after = fsm.counters
    assert after.transitions == before.transitions + (next_state is not state)
    assert after.split_brain_count == before.split_brain_count + (conflict is Conflict.SPLIT_BRAIN)
    assert after.dual_passive_count == before.dual_passive_count + (
        conflict is Conflict.DUAL_PASSIVE
    )


@pytest.mark.parametrize("case", REACHABLE, ids=_case_id)
@pytest.mark.parametrize(
    ("now", "peer_dead"),
    [(ALIVE_AT, False), (JUST_BEFORE, False), (EXPIRY, True), (EXPIRY + 5.0, True)],
    ids=["alive", "just-before-expiry", "exactly-at-expiry", "long-dead"],
)
def test_client_request(case: tuple[bool, State], now: float, peer_dead: bool) -> None:
    role, state = case
    fsm = _reach(role, state)
    before = fsm.counters
    contact = fsm.last_peer_contact
    next_state, vote = VOTE_RULES[case][peer_dead]
    outcome = fsm.client_request(now)
    assert (outcome.previous, outcome.state, outcome.vote) == (state, next_state, vote)
    assert outcome.event is Event.CLIENT_REQUEST
    assert outcome.accepted == (vote is Vote.ACCEPTED)
    assert outcome.conflict is None
    assert outcome.became_active == (state is not A and next_state is A)
    assert not outcome.became_passive
    assert fsm.state is next_state
    assert fsm.last_peer_contact == contact, "a vote is not news from the peer"
    after = fsm.counters
    assert after.votes_accepted == before.votes_accepted + (vote is Vote.ACCEPTED)
    assert after.votes_refused == before.votes_refused + (vote is Vote.REFUSED)
    assert after.transitions == before.transitions + (next_state is not state)


# -- expiry ---------------------------------------------------------------------


@pytest.mark.parametrize(("heartbeat", "missed"), [(1.0, 2), (0.25, 3), (0.1, 2), (2.0, 1)])
def test_passive_fails_over_exactly_at_expiry(heartbeat: float, missed: int) -> None:
    clock = FakeClock(100.0)
    fsm = BinaryStarFSM(False, clock.now, heartbeat=heartbeat, missed=missed)
    fsm.receive_peer_state(A, clock.advance(0.5))
    expiry = clock.now + missed * heartbeat
    assert fsm.peer_expiry == expiry
    assert fsm.client_request(math.nextafter(expiry, 0.0)).vote is Vote.REFUSED
    assert fsm.state is S
    outcome = fsm.client_request(expiry)
    assert outcome.accepted and outcome.became_active


def test_fresh_primary_waits_one_expiry_period_from_its_start() -> None:
    clock = FakeClock(5.0)
    fsm = BinaryStarFSM(True, clock.now)
    assert fsm.last_peer_contact is None and fsm.peer_state is None
    assert fsm.peer_expiry == 7.0
    assert not fsm.client_request(clock.advance(1.9)).accepted
    assert fsm.state is P
    assert fsm.client_request(clock.advance(0.1)).became_active


def test_every_peer_message_pushes_expiry_back() -> None:
    clock = FakeClock()
    fsm = BinaryStarFSM(False, clock.now)
    fsm.receive_peer_state(A, clock.now)
    for _ in range(5):
        fsm.receive_peer_state(A, clock.advance(1.5))
        assert not fsm.client_request(clock.now + 1.9).accepted
    assert fsm.state is S
    assert fsm.counters.votes_refused == 5


def test_expiry_is_reported_once_and_never_changes_state() -> None:
    clock = FakeClock()
    fsm = BinaryStarFSM(False, clock.now)
    fsm.receive_peer_state(A, clock.now)
    assert not fsm.check_expiry(clock.advance(1.0))
    assert not fsm.check_expiry(JUST_BEFORE)
    assert fsm.check_expiry(clock.advance(1.0))
    assert not fsm.check_expiry(clock.advance(1.0))
    assert fsm.state is S, "only a vote may turn a silent peer into a failover"
    assert fsm.counters.peer_expirations == 1
    fsm.receive_peer_state(A, clock.now)  # back again, then silent again
    assert fsm.peer_alive(clock.now)
    assert fsm.check_expiry(clock.advance(2.0))
    assert fsm.counters.peer_expirations == 2
    assert fsm.counters.transitions == 1


def test_never_heard_peer_expires_after_the_grace_period() -> None:
    fsm = BinaryStarFSM(True, 0.0)
    assert not fsm.check_expiry(JUST_BEFORE)
    assert fsm.check_expiry(EXPIRY)
    assert fsm.state is P


# -- conflicts ------------------------------------------------------------------


def test_split_brain_is_counted_once_per_episode_on_the_primary() -> None:
    clock = FakeClock()
    fsm = _reach(PRI, A)
    first = fsm.receive_peer_state(A, clock.advance(0.5))
    assert first.split_brain_detected and fsm.state is A
    for _ in range(3):
        repeat = fsm.receive_peer_state(A, clock.advance(0.5))
        assert repeat.conflict is None and fsm.state is A
    assert fsm.counters.split_brain_count == 1
    fsm.receive_peer_state(S, clock.advance(0.5))  # the backup stepped down
    assert fsm.receive_peer_state(A, clock.advance(0.5)).split_brain_detected
    assert fsm.counters.split_brain_count == 2
    clock.advance(EXPIRY)  # the peer went silent; when it speaks again, it is news
    assert fsm.receive_peer_state(A, clock.now).split_brain_detected
    assert fsm.counters.split_brain_count == 3
    assert fsm.counters.transitions == 1


def test_split_brain_backup_steps_down_and_can_fail_over_again() -> None:
    fsm = _reach(BAK, A)
    outcome = fsm.receive_peer_state(A, 3.0)
    assert outcome.split_brain_detected and outcome.became_passive
    assert fsm.state is S
    assert not fsm.receive_peer_state(A, 3.5).split_brain_detected
    assert not fsm.client_request(5.4).accepted
    assert fsm.client_request(5.5).became_active


def test_dual_passive_primary_takes_over_backup_stays() -> None:
    primary, backup = _reach(PRI, S), _reach(BAK, S)
    outcome = primary.receive_peer_state(S, 1.0)
    assert outcome.conflict is Conflict.DUAL_PASSIVE and outcome.became_active
    assert backup.receive_peer_state(S, 1.0).conflict is Conflict.DUAL_PASSIVE
    assert backup.receive_peer_state(S, 1.1).conflict is None  # same episode
    assert backup.state is S
    assert backup.receive_peer_state(A, 1.2).conflict is None
    assert (primary.state, backup.state) == (A, S)
    assert backup.counters.dual_passive_count == 1


def test_rejected_event_leaves_machine_usable() -> None:
    fsm = BinaryStarFSM(True, 0.0)
    with pytest.raises(RoleConflictError, match="both servers are configured as primary"):
        fsm.receive_peer_state(P, 0.5)
    assert fsm.state is P
    assert fsm.receive_peer_state(B, 0.6).became_active


def test_peer_event_mapping_follows_the_guide_numbering() -> None:
    assert [peer_event(s) for s in State] == PEER_EVENTS
    assert [s.value for s in (P, B, A, S)] == [1, 2, 3, 4]
    assert Event.CLIENT_REQUEST.value == 5


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"heartbeat": 0.0}, ValueError),
        ({"heartbeat": -1.0}, ValueError),
        ({"heartbeat": math.nan}, ValueError),
        ({"missed": 0}, ValueError),
        ({"missed": 1.5}, ValueError),
        ({"missed": True}, ValueError),
    ],
)
def test_constructor_rejects_bad_configuration(kwargs: dict[str, float], error: type) -> None:
    with pytest.raises(error):
        BinaryStarFSM(True, 0.0, **kwargs)  # type: ignore[arg-type]


def test_constructor_rejects_non_bool_role() -> None:
    with pytest.raises(TypeError):
        BinaryStarFSM(1, 0.0)  # type: ignore[arg-type]


# -- two machines linked in memory ----------------------------------------------


@dataclass
class _Link:
    """One direction between the two servers: a queue of published states."""

    up: bool = True
    queue: deque[State] = field(default_factory=deque)


class _Pair:
    """A primary and a backup exchanging state messages through in-memory links.

    Publishing happens on demand (a heartbeat) and right after each transition,
    as the reactor does; messages in flight can be stale, as on a real network.
    """

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.fsm = {PRI: self._new(PRI), BAK: self._new(BAK)}
        self.link = {PRI: _Link(), BAK: _Link()}  # keyed by sender

    def _new(self, role: bool) -> BinaryStarFSM:
        return BinaryStarFSM(role, self.clock.now, heartbeat=HEARTBEAT, missed=MISSED)

    def restart(self, role: bool) -> None:
        self.fsm[role] = self._new(role)
        self.publish(role)

    def publish(self, role: bool) -> None:
        if self.link[role].up:
            self.link[role].queue.append(self.fsm[role].state)

    def deliver(self, sender: bool) -> None:
        queue = self.link[sender].queue
        if queue:
            receiver = not sender
            if self.fsm[receiver].receive_peer_state(queue.popleft(), self.clock.now).changed:
                self.publish(receiver)

    def vote(self, role: bool) -> bool:
        outcome = self.fsm[role].client_request(self.clock.now)
        if outcome.changed:
            self.publish(role)
        return outcome.accepted

    def heal_and_settle(self) -> None:
        for link in self.link.values():
            link.up = True
        for _ in range(3):  # heartbeats on both sides, each followed by delivery
            while any(link.queue for link in self.link.values()):
                self.deliver(PRI)
                self.deliver(BAK)
            self.publish(PRI)
            self.publish(BAK)
        while any(link.queue for link in self.link.values()):
            self.deliver(PRI)
            self.deliver(BAK)

    @property
    def states(self) -> tuple[State, State]:
        return self.fsm[PRI].state, self.fsm[BAK].state


def test_pair_start_failover_and_failback() -> None:
    pair = _Pair()
    pair.heal_and_settle()
    assert pair.states == (A, S)
    # The primary dies: the backup refuses votes until the primary has expired.
    pair.link[PRI].up = False
    assert not pair.vote(BAK)
    pair.clock.advance(JUST_BEFORE)
    assert not pair.vote(BAK)
    pair.clock.advance(EXPIRY - JUST_BEFORE)
    assert pair.vote(BAK)
    assert pair.states == (A, A)  # the dead primary's machine is stale, not serving
    # The primary restarts and comes up passive behind the active backup.
    pair.link[PRI].queue.clear()
    pair.restart(PRI)
    assert not pair.vote(PRI)
    pair.heal_and_settle()
    assert pair.states == (S, A)
    assert pair.fsm[BAK].counters.split_brain_count == 0


def test_pair_partition_split_brain_resolves_to_primary() -> None:
    pair = _Pair()
    pair.heal_and_settle()
    pair.link[PRI].up = pair.link[BAK].up = False
    pair.clock.advance(EXPIRY)
    assert pair.vote(BAK) and pair.vote(PRI)
    assert pair.states == (A, A)
    # Heal one direction at a time, so that each side sees the other active.
    pair.link[BAK].up = True
    pair.publish(BAK)
    pair.deliver(BAK)
    assert pair.states == (A, A)
    assert pair.fsm[PRI].counters.split_brain_count == 1
    pair.link[PRI].up = True
    pair.publish(PRI)
    pair.deliver(PRI)
    assert pair.states == (A, S)
    assert pair.fsm[BAK].counters.split_brain_count == 1
    pair.heal_and_settle()
    assert pair.states == (A, S)
    assert pair.fsm[PRI].counters.split_brain_count == 1


_ACTIONS = st.sampled_from(
    [
        "publish-primary",
        "publish-backup",
        "deliver-primary",
        "deliver-backup",
        "vote-primary",
        "vote-backup",
        "tick",
        "cut-primary",
        "cut-backup",
        "heal",
        "restart-primary",
        "restart-backup",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_ACTIONS, max_size=60))
def test_any_history_settles_to_one_active_and_one_passive(actions: list[str]) -> None:
    """Whatever happened (crashes, partitions, votes, stale messages), a well-configured
    pair never hits an illegal pair, and once the two hear each other again exactly
    one of them serves."""
    pair = _Pair()
    for action in actions:
        verb, _, who = action.partition("-")
        role = who == "primary"
        if verb == "publish":
            pair.publish(role)
        elif verb == "deliver":
            pair.deliver(role)
        elif verb == "vote":
            fsm = pair.fsm[role]
            was_active, expired = fsm.state is A, not fsm.peer_alive(pair.clock.now)
            if pair.vote(role):
                assert was_active or expired, "a vote made a server active while its peer lived"
        elif verb == "tick":
            pair.clock.advance(HEARTBEAT)
        elif verb == "cut":
            pair.link[role].up = False
        elif verb == "heal":
            pair.link[PRI].up = pair.link[BAK].up = True
        else:
            pair.restart(role)
    pair.heal_and_settle()
    assert pair.states == (A, S) or pair.states == (S, A)


# -- wire format ----------------------------------------------------------------


@pytest.mark.parametrize("state", list(State))
def test_state_message_round_trip(state: State) -> None:
    frames = encode_state(state)
    assert frames == [str(state.value).encode()]
    assert decode_state(frames) is state


def test_decode_accepts_c_string_terminator() -> None:
    assert decode_state([b"3\0"]) is A


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b""],
        [b"0"],
        [b"5"],
        [b"-1"],
        [b" 3"],
        [b"3", b"3"],
        [b"ACTIVE"],
        [b"\xff"],
        [b"9" * 50],
    ],
)
def test_decode_rejects_malformed_messages(frames: list[bytes]) -> None:
    with pytest.raises(PeerStateError, match="from tcp://peer"):
        decode_state(frames, "tcp://peer")


@given(st.lists(st.binary(max_size=12), max_size=3))
def test_decode_returns_a_state_or_raises_peer_state_error(frames: list[bytes]) -> None:
    try:
        result = decode_state(frames)
    except PeerStateError:
        return
    assert isinstance(result, State)
    assert len(frames) == 1
