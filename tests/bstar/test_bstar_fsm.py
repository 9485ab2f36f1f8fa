"""Binary Star state machine and wire format: no sockets, a fake clock, table-driven.

The expectations below are written out by hand from docs/failover.md rather than
derived from ``bstar.fsm.TRANSITIONS``, so that a wrong table row fails a test.
Every machine built by ``_reach`` carries realistic election epochs: an active peer
announces epoch 1, and a server becomes active with one more than it has seen.
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
    MAX_EPOCH,
    TRANSITIONS,
    BinaryStarError,
    BinaryStarFSM,
    Conflict,
    Event,
    IllegalTransitionError,
    Outcome,
    PeerNumberOutOfRange,
    PeerReport,
    PeerStateError,
    RoleConflictError,
    State,
    TieBreak,
    Vote,
    decode_state,
    encode_state,
    peer_event,
    yields_to_peer,
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
    so in every case the peer expires at EXPIRY. Epochs (own, highest peer):
    PRIMARY/BACKUP (0, 0), PASSIVE (0, 1), primary ACTIVE (1, 0), backup ACTIVE (2, 1).
    """
    fsm = BinaryStarFSM(primary, 0.0, heartbeat=HEARTBEAT, missed=MISSED)
    if state in (P, B):
        pass
    elif state is S:
        fsm.receive_peer_state(A, 0.0, epoch=1)
    elif primary:  # primary ACTIVE
        fsm.receive_peer_state(B, 0.0)
    else:  # backup ACTIVE: stand by, then fail over on a vote once the primary is dead
        fsm.receive_peer_state(A, 0.0, epoch=1)
        assert fsm.client_request(EXPIRY).accepted
        assert fsm.last_peer_contact == 0.0
    assert fsm.state is state
    return fsm


#: The peer's epoch relative to ours, for the one rule that looks at epochs.
LOWER, EQUAL, HIGHER = "peer-epoch-lower", "peer-epoch-equal", "peer-epoch-higher"
_EPOCH_DELTA = {LOWER: -1, EQUAL: 0, HIGHER: 1}


REACHABLE = [(PRI, P), (PRI, A), (PRI, S), (BAK, B), (BAK, A), (BAK, S)]
PEER_EVENTS = [Event.PEER_PRIMARY, Event.PEER_BACKUP, Event.PEER_ACTIVE, Event.PEER_PASSIVE]

_Expected = tuple[State, Conflict | None]
# (role, state, peer event) -> (next state, conflict), the error raised, or, for
# split brain, the (next state, conflict) for each epoch of the peer relative to ours.
PEER_RULES: dict[tuple[bool, State, Event], _Expected | type[Exception] | dict[str, _Expected]] = {
    (PRI, P, Event.PEER_PRIMARY): RoleConflictError,
    (PRI, P, Event.PEER_BACKUP): (A, None),
    (PRI, P, Event.PEER_ACTIVE): (S, None),
    (PRI, P, Event.PEER_PASSIVE): (P, None),
    (PRI, A, Event.PEER_PRIMARY): RoleConflictError,
    (PRI, A, Event.PEER_BACKUP): (A, None),
    (PRI, A, Event.PEER_ACTIVE): {
        LOWER: (A, Conflict.SPLIT_BRAIN),
        EQUAL: (A, Conflict.SPLIT_BRAIN),  # the tie-break: the primary wins
        HIGHER: (S, Conflict.SPLIT_BRAIN),  # e.g. we were frozen while the backup took over
    },
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
    (BAK, A, Event.PEER_ACTIVE): {
        LOWER: (A, Conflict.SPLIT_BRAIN),  # e.g. a primary thawing from a freeze
        EQUAL: (S, Conflict.SPLIT_BRAIN),
        HIGHER: (S, Conflict.SPLIT_BRAIN),
    },
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
@pytest.mark.parametrize("relation", [LOWER, EQUAL, HIGHER])
def test_peer_event(case: tuple[bool, State, Event], now: float, relation: str) -> None:
    role, state, event = case
    fsm = _reach(role, state)
    before = fsm.counters
    epoch_before, peer_epoch_before = fsm.epoch, fsm.peer_epoch
    peer_epoch = max(0, fsm.epoch + _EPOCH_DELTA[relation])
    expected = PEER_RULES[case]
    if isinstance(expected, dict):
        expected = expected[relation]
    if isinstance(expected, type):
        with pytest.raises(expected) as info:
            fsm.handle(event, now, peer_epoch)
        assert isinstance(info.value, IllegalTransitionError)
        assert isinstance(info.value, BinaryStarError)
        assert (info.value.state, info.value.event) == (state, event)
        assert fsm.state is state
        assert fsm.counters.illegal_events == before.illegal_events + 1
        assert fsm.counters.transitions == before.transitions
        # Even a rejected message proves someone is alive at the peer endpoint.
        assert fsm.last_peer_contact == now
        assert fsm.epoch == epoch_before
        return
    next_state, conflict = expected
    outcome = fsm.handle(event, now, peer_epoch)
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
    assert fsm.peer_epoch == max(peer_epoch_before, peer_epoch)
    assert outcome.peer_epoch == peer_epoch
    if outcome.became_active:  # a new election outbids every epoch known
        assert fsm.epoch == max(epoch_before, peer_epoch_before, peer_epoch) + 1
    else:
        assert fsm.epoch == epoch_before
    assert outcome.epoch == fsm.epoch
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
    epoch, peer_epoch = fsm.epoch, fsm.peer_epoch
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
    assert fsm.peer_epoch == peer_epoch and outcome.peer_epoch is None
    assert fsm.epoch == (max(epoch, peer_epoch) + 1 if outcome.became_active else epoch)
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


# -- lost connection (fast failover) ----------------------------------------------


@pytest.mark.parametrize("case", REACHABLE, ids=_case_id)
def test_vote_after_a_lost_connection_is_decided_as_if_the_peer_expired(
    case: tuple[bool, State],
) -> None:
    """The disconnect row of the vote table: every state answers as when expired."""
    role, state = case
    fsm = _reach(role, state)
    before = fsm.counters
    assert fsm.peer_alive(ALIVE_AT)
    assert fsm.peer_disconnected(ALIVE_AT)
    assert fsm.state is state, "a lost connection alone never changes the state"
    assert fsm.counters == before
    assert fsm.peer_expiry == ALIVE_AT and fsm.peer_lost_at == ALIVE_AT
    assert not fsm.peer_alive(ALIVE_AT)
    next_state, vote = VOTE_RULES[case][True]
    outcome = fsm.client_request(ALIVE_AT)
    assert (outcome.state, outcome.vote) == (next_state, vote)


def test_passive_accepts_a_vote_at_once_after_the_connection_is_lost() -> None:
    clock = FakeClock(100.0)
    fsm = BinaryStarFSM(False, clock.now)
    fsm.receive_peer_state(A, clock.now, epoch=1)
    clock.advance(0.3)
    assert not fsm.client_request(clock.now).accepted
    assert fsm.peer_disconnected(clock.advance(0.01))
    assert fsm.last_peer_contact == 100.0, "a disconnect is not contact"
    outcome = fsm.client_request(clock.now)
    assert outcome.accepted and outcome.became_active
    assert fsm.epoch == 2
    assert clock.now < 100.0 + EXPIRY, "well before the heartbeat would have told"


def test_a_message_after_the_loss_restores_heartbeat_expiry() -> None:
    clock = FakeClock()
    fsm = BinaryStarFSM(False, clock.now)
    fsm.receive_peer_state(A, clock.now)
    fsm.peer_disconnected(clock.advance(0.5))
    assert not fsm.peer_alive(clock.now)
    # The peer is back (restarted, or the connection was only reset).
    fsm.receive_peer_state(A, clock.advance(0.5))
    assert fsm.peer_lost_at is None
    assert fsm.peer_expiry == clock.now + EXPIRY
    assert not fsm.client_request(clock.advance(1.9)).accepted
    assert fsm.client_request(clock.advance(0.1)).accepted


def test_a_rejected_message_after_the_loss_still_counts_as_contact() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.receive_peer_state(A, 0.0)
    fsm.peer_disconnected(0.5)
    with pytest.raises(RoleConflictError):
        fsm.receive_peer_state(B, 0.6)
    assert fsm.peer_lost_at is None and fsm.peer_alive(0.6)


def test_reconnection_without_a_message_falls_back_on_the_heartbeat() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.receive_peer_state(A, 0.0)
    assert fsm.peer_disconnected(0.5)
    assert fsm.check_expiry(0.5), "the loss is the expiry, reported once"
    fsm.peer_connected(0.6)
    assert fsm.peer_lost_at is None
    assert fsm.peer_expiry == EXPIRY and fsm.peer_alive(0.6)
    assert not fsm.client_request(0.6).accepted
    # Alive again, so the next expiry is reported again.
    assert not fsm.check_expiry(JUST_BEFORE)
    assert fsm.check_expiry(EXPIRY)
    assert fsm.counters.peer_expirations == 2
    fsm.peer_connected(EXPIRY + 1.0)  # no loss recorded: nothing to undo
    assert not fsm.peer_alive(EXPIRY + 1.0), "a connection is not contact"


def test_reconnection_long_after_the_last_message_leaves_the_peer_dead() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.receive_peer_state(A, 0.0)
    fsm.peer_disconnected(0.5)
    assert fsm.check_expiry(0.5)
    fsm.peer_connected(EXPIRY + 3.0)
    assert not fsm.peer_alive(EXPIRY + 3.0)
    assert not fsm.check_expiry(EXPIRY + 3.0), "still the same silence: reported already"
    assert fsm.client_request(EXPIRY + 3.0).accepted


def test_primary_that_loses_the_peer_before_hearing_it_skips_the_start_grace() -> None:
    """The backup was reachable (connected) but never heard, then its connection
    closed: it is gone, so the start-up grace period has nothing left to wait for."""
    fsm = BinaryStarFSM(True, 10.0)
    assert fsm.last_peer_contact is None
    assert not fsm.client_request(10.5).accepted
    assert fsm.peer_disconnected(10.6)
    assert fsm.peer_expiry == 10.6
    outcome = fsm.client_request(10.6)
    assert outcome.accepted and outcome.became_active and fsm.epoch == 1


def test_backup_before_hearing_the_primary_refuses_votes_even_after_a_loss() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.peer_disconnected(0.1)
    assert not fsm.client_request(0.1).accepted
    assert not fsm.client_request(EXPIRY + 10.0).accepted
    assert fsm.state is B


def test_loss_never_delays_expiry_and_keeps_the_earliest_moment() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.receive_peer_state(A, 0.0)
    assert not fsm.peer_disconnected(EXPIRY + 1.0), "already dead: nothing new"
    assert fsm.peer_expiry == EXPIRY, "a late loss does not push expiry back"
    fsm.receive_peer_state(A, 5.0)
    assert fsm.peer_disconnected(5.5)
    assert not fsm.peer_disconnected(5.8), "a second loss adds nothing"
    assert fsm.peer_lost_at == 5.5


def test_a_loss_older_than_the_last_message_is_stale() -> None:
    fsm = BinaryStarFSM(False, 0.0)
    fsm.receive_peer_state(A, 1.0)
    assert not fsm.peer_disconnected(0.9)
    assert fsm.peer_lost_at is None and fsm.peer_alive(1.0)
    assert fsm.peer_disconnected(1.0), "the same instant: the loss came after the message"


def test_loss_while_active_keeps_serving() -> None:
    fsm = _reach(PRI, A)
    assert fsm.peer_disconnected(ALIVE_AT)
    assert fsm.client_request(ALIVE_AT).accepted
    assert fsm.state is A and fsm.epoch == 1, "no new election"


# -- conflicts ------------------------------------------------------------------


# (own epoch, peer epoch, primary) -> does this server yield to its active peer?
YIELD_RULES = {
    (1, 2, PRI): True,  # a thawed primary meets the backup elected while it was frozen
    (2, 1, BAK): False,  # ... and the backup keeps serving
    (2, 1, PRI): False,
    (1, 2, BAK): True,
    (1, 1, PRI): False,  # equal epochs: the old role rule breaks the tie
    (1, 1, BAK): True,
    (0, 0, PRI): False,
    (0, 0, BAK): True,
    (7, 0, BAK): False,  # a Guide peer announces no epoch, i.e. 0
    (0, 7, PRI): True,
}


@pytest.mark.parametrize(("own", "peer", "primary"), list(YIELD_RULES))
def test_yields_to_peer(own: int, peer: int, primary: bool) -> None:
    assert yields_to_peer(own, peer, primary) is YIELD_RULES[(own, peer, primary)]


@given(st.integers(0, MAX_EPOCH), st.integers(0, MAX_EPOCH))
def test_exactly_one_side_of_a_split_brain_yields(primary_epoch: int, backup_epoch: int) -> None:
    primary_yields = yields_to_peer(primary_epoch, backup_epoch, True)
    backup_yields = yields_to_peer(backup_epoch, primary_epoch, False)
    assert primary_yields != backup_yields


def test_only_split_brain_is_settled_by_epoch() -> None:
    by_epoch = {key for key, rule in TRANSITIONS.items() if rule.tie_break is TieBreak.EPOCH}
    assert by_epoch == {(A, Event.PEER_ACTIVE)}
    split = TRANSITIONS[(A, Event.PEER_ACTIVE)]
    assert split.target(True, 1, 2) is S and split.target(False, 2, 1) is A
    dual = TRANSITIONS[(S, Event.PEER_PASSIVE)]
    assert dual.target(True, 0, 9) is A and dual.target(False, 9, 0) is S


@pytest.mark.parametrize("peer_epoch", [0, 1], ids=["lower-epoch", "equal-epoch"])
def test_split_brain_is_counted_once_per_episode_on_the_winner(peer_epoch: int) -> None:
    clock = FakeClock()
    fsm = _reach(PRI, A)  # epoch 1
    first = fsm.receive_peer_state(A, clock.advance(0.5), peer_epoch)
    assert first.split_brain_detected and fsm.state is A
    for _ in range(3):
        repeat = fsm.receive_peer_state(A, clock.advance(0.5), peer_epoch)
        assert repeat.conflict is None and fsm.state is A
    assert fsm.counters.split_brain_count == 1
    fsm.receive_peer_state(S, clock.advance(0.5), peer_epoch)  # the backup stepped down
    assert fsm.receive_peer_state(A, clock.advance(0.5), peer_epoch).split_brain_detected
    assert fsm.counters.split_brain_count == 2
    clock.advance(EXPIRY)  # the peer went silent; when it speaks again, it is news
    assert fsm.receive_peer_state(A, clock.now, peer_epoch).split_brain_detected
    assert fsm.counters.split_brain_count == 3
    assert fsm.counters.transitions == 1
    assert fsm.epoch == 1, "winning a split brain is not an election"


@pytest.mark.parametrize(
    ("role", "peer_epoch"),
    [(BAK, 2), (BAK, 3), (PRI, 2)],
    ids=["backup-equal-epoch", "backup-lower-epoch", "primary-lower-epoch"],
)
def test_split_brain_loser_steps_down_and_can_fail_over_again(role: bool, peer_epoch: int) -> None:
    fsm = _reach(role, A)
    outcome = fsm.receive_peer_state(A, 3.0, peer_epoch)
    assert outcome.split_brain_detected and outcome.became_passive
    assert fsm.state is S
    assert fsm.counters.split_brain_count == 1
    assert not fsm.receive_peer_state(A, 3.5, peer_epoch).split_brain_detected
    assert not fsm.client_request(5.4).accepted
    assert fsm.client_request(5.5).became_active
    assert fsm.epoch == peer_epoch + 1


def test_dual_passive_primary_takes_over_backup_stays() -> None:
    primary, backup = _reach(PRI, S), _reach(BAK, S)
    outcome = primary.receive_peer_state(S, 1.0)
    assert outcome.conflict is Conflict.DUAL_PASSIVE and outcome.became_active
    assert primary.epoch == 2, "it outbids the epoch of the active it last heard"
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
    """One direction between the two servers: a queue of published (state, epoch)."""

    up: bool = True
    queue: deque[tuple[State, int]] = field(default_factory=deque)


class _Pair:
    """A primary and a backup exchanging state messages through in-memory links.

    Publishing happens on demand (a heartbeat) and right after each transition,
    as the reactor does; messages in flight can be stale, as on a real network.
    Every outcome is kept per server, so tests can count what would have fired.
    """

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.fsm = {PRI: self._new(PRI), BAK: self._new(BAK)}
        self.link = {PRI: _Link(), BAK: _Link()}  # keyed by sender
        self.outcomes: dict[bool, list[Outcome]] = {PRI: [], BAK: []}

    def _new(self, role: bool) -> BinaryStarFSM:
        return BinaryStarFSM(role, self.clock.now, heartbeat=HEARTBEAT, missed=MISSED)

    def restart(self, role: bool) -> None:
        self.fsm[role] = self._new(role)
        self.publish(role)

    def publish(self, role: bool) -> None:
        if self.link[role].up:
            self.link[role].queue.append((self.fsm[role].state, self.fsm[role].epoch))

    def deliver(self, sender: bool) -> None:
        queue = self.link[sender].queue
        if queue:
            receiver = not sender
            state, epoch = queue.popleft()
            outcome = self.fsm[receiver].receive_peer_state(state, self.clock.now, epoch)
            self.outcomes[receiver].append(outcome)
            if outcome.changed:
                self.publish(receiver)

    def drain(self, sender: bool) -> None:
        while self.link[sender].queue:
            self.deliver(sender)

    def drop(self, sender: bool) -> None:
        """The receiver sees its connection to ``sender``'s publisher close."""
        self.fsm[not sender].peer_disconnected(self.clock.now)

    def vote(self, role: bool) -> bool:
        outcome = self.fsm[role].client_request(self.clock.now)
        self.outcomes[role].append(outcome)
        if outcome.changed:
            self.publish(role)
        return outcome.accepted

    def fired(self, role: bool) -> list[str]:
        """The callbacks the reactor would have fired for ``role``, in order."""
        names = []
        for outcome in self.outcomes[role]:
            if outcome.split_brain_detected:
                names.append("split")
            if outcome.became_active:
                names.append("active")
            elif outcome.became_passive:
                names.append("passive")
        return names

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

    @property
    def epochs(self) -> tuple[int, int]:
        return self.fsm[PRI].epoch, self.fsm[BAK].epoch


def _settled_pair() -> _Pair:
    pair = _Pair()
    pair.heal_and_settle()
    assert pair.states == (A, S) and pair.epochs == (1, 0)
    assert pair.fsm[BAK].peer_epoch == 1
    return pair


def test_pair_start_failover_and_failback() -> None:
    pair = _settled_pair()
    # The primary dies: the backup refuses votes until the primary has expired.
    pair.link[PRI].up = False
    assert not pair.vote(BAK)
    pair.clock.advance(JUST_BEFORE)
    assert not pair.vote(BAK)
    pair.clock.advance(EXPIRY - JUST_BEFORE)
    assert pair.vote(BAK)
    assert pair.states == (A, A)  # the dead primary's machine is stale, not serving
    assert pair.fsm[BAK].epoch == 2
    # The primary restarts and comes up passive behind the active backup.
    pair.link[PRI].queue.clear()
    pair.restart(PRI)
    assert not pair.vote(PRI)
    pair.heal_and_settle()
    assert pair.states == (S, A)
    assert pair.epochs == (0, 2) and pair.fsm[PRI].peer_epoch == 2
    assert pair.fsm[BAK].counters.split_brain_count == 0


def test_pair_primary_crash_fails_over_on_the_connection_loss() -> None:
    """The drill ``kill-active``: the backup needs no heartbeat to accept the vote."""
    pair = _settled_pair()
    pair.clock.advance(0.4)
    pair.link[PRI].up = False  # dead: publishes nothing more
    pair.link[PRI].queue.clear()
    assert not pair.vote(BAK)
    pair.clock.advance(0.05)
    pair.drop(PRI)  # its kernel closed the connection
    assert pair.vote(BAK)
    assert pair.states == (A, A) and pair.epochs == (1, 2)  # the primary's machine is dead
    pair.link[PRI].queue.clear()
    pair.restart(PRI)
    pair.heal_and_settle()
    assert pair.states == (S, A)
    assert pair.fsm[BAK].peer_lost_at is None
    assert pair.fired(BAK) == ["passive", "active"]


def test_pair_frozen_primary_thaws_and_steps_down() -> None:
    """The drill ``freeze-active``: the thawed primary must not serve as a second active."""
    pair = _settled_pair()
    # The primary freezes: it publishes nothing and reads nothing. The backup
    # keeps heartbeating into the primary's (unread) queue.
    pair.link[PRI].up = False
    pair.link[PRI].queue.clear()
    pair.outcomes = {PRI: [], BAK: []}
    for _ in range(MISSED):
        pair.clock.advance(HEARTBEAT)
        pair.publish(BAK)
    assert pair.vote(BAK), "the primary expired; a client voted for the backup"
    assert pair.states == (A, A) and pair.epochs == (1, 2)
    pair.publish(BAK)  # a heartbeat of the new active, also unread for now
    # The primary thaws, still believing it is ACTIVE at epoch 1: its timer fires
    # first and announces that, then it reads what piled up while it was frozen.
    pair.clock.advance(5.0)
    pair.link[PRI].up = True
    pair.publish(PRI)
    pair.drain(PRI)
    assert pair.fsm[BAK].state is A, "the backup (epoch 2) beats the stale primary (epoch 1)"
    pair.drain(BAK)
    assert pair.states == (S, A)
    pair.heal_and_settle()
    assert pair.states == (S, A) and pair.epochs == (1, 2)
    assert pair.fired(PRI) == ["split", "passive"]
    assert pair.fired(BAK) == ["active", "split"]
    for role in (PRI, BAK):
        assert pair.fsm[role].counters.split_brain_count == 1
    assert not pair.vote(PRI) and pair.vote(BAK)


def test_pair_partition_both_voted_later_election_wins() -> None:
    """Both sides took votes while cut off: the one elected later (higher epoch) wins."""
    pair = _settled_pair()
    pair.link[PRI].up = pair.link[BAK].up = False
    pair.clock.advance(EXPIRY)
    assert pair.vote(PRI), "already active: the primary serves, no new election"
    assert pair.vote(BAK)
    assert pair.states == (A, A) and pair.epochs == (1, 2)
    # Heal one direction at a time, so that each side sees the other active.
    pair.link[PRI].up = True
    pair.publish(PRI)
    pair.deliver(PRI)
    assert pair.states == (A, A)
    assert pair.fsm[BAK].counters.split_brain_count == 1
    pair.link[BAK].up = True
    pair.publish(BAK)
    pair.deliver(BAK)
    assert pair.states == (S, A)
    pair.heal_and_settle()
    assert pair.states == (S, A)
    assert pair.fired(PRI) == ["active", "split", "passive"]
    assert pair.fired(BAK) == ["passive", "active", "split"]


def test_pair_partition_equal_epochs_primary_wins() -> None:
    """Two elections from the same knowledge give equal epochs: the primary wins.

    During a rolling upgrade the backup stood by behind the old primary, which
    announced no epoch (0). The upgraded primary comes back cut off from the
    backup; clients vote for each of them, so both are elected at epoch 1.
    """
    pair = _Pair()
    pair.link[PRI].up = pair.link[BAK].up = False
    old_primary = decode_state([b"3"])
    assert pair.fsm[BAK].receive_peer_state(old_primary.state, 0.0, old_primary.epoch).changed
    pair.clock.advance(EXPIRY)
    assert pair.vote(PRI) and pair.vote(BAK)
    assert pair.states == (A, A) and pair.epochs == (1, 1)
    pair.heal_and_settle()
    assert pair.states == (A, S)
    assert pair.fired(PRI) == ["active", "split"]
    assert pair.fired(BAK) == ["active", "split", "passive"]


def test_guide_peer_without_epoch_still_pairs() -> None:
    """A Guide bstar peer sends one frame, the bare state number: epoch 0."""
    fsm = BinaryStarFSM(False, 0.0, heartbeat=HEARTBEAT, missed=MISSED)

    def hear(frame: bytes, now: float) -> Outcome:
        report = decode_state([frame])
        assert report.epoch == 0
        return fsm.receive_peer_state(report.state, now, report.epoch)

    assert hear(b"3", 0.0).became_passive
    assert fsm.peer_epoch == 0
    assert fsm.client_request(EXPIRY).became_active  # the Guide primary died
    assert fsm.epoch == 1
    assert hear(b"1\0", 3.0).state is A  # it restarts and will go passive
    assert hear(b"4", 3.5).state is A
    # A Guide peer that goes active anyway is at epoch 0 and loses; the Guide's own
    # rule makes it abort on dual actives, so someone is left serving either way.
    outcome = hear(b"3", 4.0)
    assert outcome.split_brain_detected and fsm.state is A
    assert encode_state(fsm.state, fsm.epoch) == [b"3:1"]
    assert int(encode_state(fsm.state, fsm.epoch)[0].split(b":")[0]) == 3  # what atoi sees


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
        "drop-primary",
        "drop-backup",
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
        elif verb == "drop":
            pair.drop(role)
        else:
            pair.restart(role)
    pair.heal_and_settle()
    assert pair.states == (A, S) or pair.states == (S, A)
    active = pair.fsm[PRI] if pair.states[0] is A else pair.fsm[BAK]
    assert active.epoch >= 1, "every server that became active was elected"


# -- wire format ----------------------------------------------------------------


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("epoch", [0, 1, 17, MAX_EPOCH])
def test_state_message_round_trip(state: State, epoch: int) -> None:
    frames = encode_state(state, epoch)
    assert frames == [f"{state.value}:{epoch}".encode()]
    assert decode_state(frames) == PeerReport(state, epoch)


@given(st.sampled_from(State), st.integers(0, MAX_EPOCH))
def test_any_state_and_epoch_round_trip(state: State, epoch: int) -> None:
    assert decode_state(encode_state(state, epoch)) == PeerReport(state, epoch)


def test_encode_always_sends_an_epoch() -> None:
    assert encode_state(A) == [b"3:0"]


@pytest.mark.parametrize("state", list(State))
def test_decode_guide_format_means_epoch_zero(state: State) -> None:
    assert decode_state([b"%d" % state.value]) == PeerReport(state, 0)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [(b"3\0", PeerReport(A, 0)), (b"3:17\0", PeerReport(A, 17)), (b"4:007", PeerReport(S, 7))],
)
def test_decode_accepts_c_string_terminator_and_leading_zeros(
    frame: bytes, expected: PeerReport
) -> None:
    assert decode_state([frame]) == expected


@pytest.mark.parametrize(
    ("epoch", "error"), [(-1, ValueError), (MAX_EPOCH + 1, ValueError), (True, TypeError)]
)
def test_encode_rejects_bad_epochs(epoch: int, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_state(A, epoch)


@pytest.mark.parametrize("epoch", [-1, 1.0, True])
def test_fsm_rejects_bad_epochs(epoch: int) -> None:
    fsm = BinaryStarFSM(False, 0.0)
    with pytest.raises((ValueError, TypeError)):
        fsm.receive_peer_state(A, 0.0, epoch)
    assert fsm.state is B and fsm.last_peer_contact is None


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
        [b"3:"],
        [b":3"],
        [b":"],
        [b"3:-1"],
        [b"3:+1"],
        [b"3: 1"],
        [b"3:1 "],
        [b"3:1:2"],
        [b"3:x"],
        [b"3:1.5"],
        ["3:\uff11".encode()],  # a fullwidth digit is not ASCII
        [b"3:" + b"1" * 21],
        [b"5:1"],
        [b"3:17", b""],
    ],
)
def test_decode_rejects_malformed_messages(frames: list[bytes]) -> None:
    with pytest.raises(PeerStateError, match="from tcp://peer"):
        decode_state(frames, "tcp://peer")


@given(
    st.one_of(
        st.lists(st.binary(max_size=40), max_size=3),
        st.lists(st.from_regex(rb"\A[0-9]{1,3}(:[-+ 0-9:]{0,24})?\x00{0,9}\Z"), max_size=2),
    )
)
def test_decode_returns_a_report_or_raises_peer_state_error(frames: list[bytes]) -> None:
    try:
        result = decode_state(frames)
    except PeerStateError:
        return
    assert isinstance(result, PeerReport)
    assert isinstance(result.state, State)
    assert 0 <= result.epoch <= MAX_EPOCH
    assert len(frames) == 1


# -- bounds -----------------------------------------------------------------------


def test_the_epoch_bound_fits_sqlite_and_the_wire() -> None:
    assert MAX_EPOCH == 2**62 < 2**63 - 1 < 10**20
    assert encode_state(A, MAX_EPOCH, (MAX_EPOCH, MAX_EPOCH)) == [b"3" + b":%d" % MAX_EPOCH * 3]


@pytest.mark.parametrize(
    "frame",
    [
        b"3:99999999999999999999",
        b"3:%d" % (MAX_EPOCH + 1),
        b"3:%d" % (2**63),
        b"1:0:%d:5" % (MAX_EPOCH + 1),
        b"1:0:5:%d" % (MAX_EPOCH + 1),
        b"3:999999999999999999999",  # 21 digits
    ],
)
def test_numbers_above_the_bound_are_refused_at_the_wire(frame: bytes) -> None:
    with pytest.raises(PeerNumberOutOfRange) as refused:
        decode_state([frame], "tcp://rogue:1")
    assert isinstance(refused.value, PeerStateError)
    assert "tcp://rogue:1" in str(refused.value)


def test_an_election_after_a_peer_at_the_bound_saturates_there() -> None:
    clock = FakeClock()
    fsm = BinaryStarFSM(True, clock.now, epoch=MAX_EPOCH - 1)
    assert fsm.receive_peer_state(B, clock.now, MAX_EPOCH).became_active
    assert fsm.epoch == MAX_EPOCH
    assert encode_state(fsm.state, fsm.epoch)  # still announceable
    for bad in (MAX_EPOCH + 1, 10**20):
        with pytest.raises(ValueError):
            BinaryStarFSM(True, 0.0, epoch=bad)
        with pytest.raises(ValueError):
            fsm.receive_peer_state(A, clock.now, bad)


def test_the_peers_announced_epoch_is_its_last_message_s_and_peer_epoch_the_highest() -> None:
    """A split brain's loser, passive again, still announces the epoch it was
    elected at (clone's winner reads it: docs/failover.md, "Late copies"); a
    restarted peer announces 0, though ``peer_epoch`` keeps the highest."""
    fsm = _reach(BAK, A)  # the backup took over at epoch 2; the primary had 1
    assert fsm.peer_announced_epoch == 1
    fsm.receive_peer_state(S, 2.5, epoch=1)  # the loser stepped down
    assert (fsm.peer_state, fsm.peer_announced_epoch, fsm.epoch) == (S, 1, 2)
    fsm.receive_peer_state(P, 3.0, epoch=0)  # it restarted
    assert (fsm.peer_announced_epoch, fsm.peer_epoch) == (0, 1)
