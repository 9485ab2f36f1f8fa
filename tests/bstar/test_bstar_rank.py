"""Data ranks and the start wait: who serves when both servers of a pair start.

No sockets and a fake clock, as in test_bstar_fsm.py. The expectations are
written out by hand (older data yields; on equal data two starting servers
follow their roles, a passive server keeps the data it holds) rather than
derived from ``bstar.fsm.TRANSITIONS``, so that a wrong row fails a test.
"""

from __future__ import annotations

import math
from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bstar import (
    MAX_RANK_PART,
    NO_RANK,
    TRANSITIONS,
    BinaryStarFSM,
    Event,
    Outcome,
    PeerReport,
    PeerStateError,
    Rank,
    State,
    TieBreak,
    Vote,
    decode_state,
    encode_state,
    yields_on_rank,
)
from bstar.wire import MAX_STATE_FRAME

P, B, A, S = State.PRIMARY, State.BACKUP, State.ACTIVE, State.PASSIVE
PRI, BAK = True, False
HEARTBEAT, MISSED = 1.0, 2
EXPIRY = HEARTBEAT * MISSED

OLD, MID, NEW = (5, 120), (5, 130), (6, 3)  # lexicographic: the term counts first
RANKS = st.tuples(st.integers(0, 3), st.integers(0, 3))


def _fsm(
    primary: bool,
    rank: Rank = NO_RANK,
    start_wait: float = 0.0,
    *,
    epoch: int = 0,
    behind_peer: bool = False,
) -> BinaryStarFSM:
    return BinaryStarFSM(
        primary,
        0.0,
        heartbeat=HEARTBEAT,
        missed=MISSED,
        rank=rank,
        start_wait=start_wait,
        epoch=epoch,
        behind_peer=behind_peer,
    )


def _reach(primary: bool, state: State, rank: Rank) -> BinaryStarFSM:
    """A machine in a start state or PASSIVE (behind an active peer) at ``rank``."""
    fsm = _fsm(primary, rank)
    if state is S:
        fsm.receive_peer_state(A, 0.0, epoch=1)
    assert fsm.state is state
    return fsm


# -- the ranks themselves ---------------------------------------------------------


@pytest.mark.parametrize(
    ("own", "peer", "primary", "expected"),
    [
        (OLD, NEW, PRI, True),
        (OLD, NEW, BAK, True),
        (NEW, OLD, PRI, False),
        (NEW, OLD, BAK, False),
        (OLD, MID, PRI, True),  # same term, fewer writes
        ((6, 0), (5, 999), BAK, False),  # a later term beats any sequence of an earlier one
        (MID, MID, PRI, False),
        (MID, MID, BAK, True),
        (NO_RANK, NO_RANK, PRI, False),
        (NO_RANK, NO_RANK, BAK, True),
    ],
)
def test_yields_on_rank(own: Rank, peer: Rank, primary: bool, expected: bool) -> None:
    assert yields_on_rank(own, peer, primary) is expected


@given(RANKS, RANKS)
def test_exactly_one_side_yields_on_rank(primary_rank: Rank, backup_rank: Rank) -> None:
    primary_yields = yields_on_rank(primary_rank, backup_rank, True)
    backup_yields = yields_on_rank(backup_rank, primary_rank, False)
    assert primary_yields != backup_yields


# -- the table rows that compare ranks --------------------------------------------

#: (state, peer event) -> (tie-break, where we go for a peer rank older / equal / newer).
RANK_ROWS: dict[tuple[State, Event], tuple[TieBreak, dict[bool, tuple[State, State, State]]]] = {
    (P, Event.PEER_BACKUP): (TieBreak.RANK, {PRI: (A, A, S)}),
    (B, Event.PEER_PRIMARY): (TieBreak.RANK, {BAK: (A, B, B)}),
    # A starting server facing a passive peer serves only with strictly newer data:
    # the passive one holds the data in memory and serves on a tie.
    (P, Event.PEER_PASSIVE): (TieBreak.RANK_NEEDS_NEWER, {PRI: (A, P, P)}),
    (B, Event.PEER_PASSIVE): (TieBreak.RANK_NEEDS_NEWER, {BAK: (A, B, B)}),
    (S, Event.PEER_PRIMARY): (TieBreak.RANK_YIELDS_TO_NEWER, {BAK: (A, A, S)}),
    (S, Event.PEER_BACKUP): (TieBreak.RANK_YIELDS_TO_NEWER, {PRI: (A, A, S)}),
}


RANK_TIE_BREAKS = {TieBreak.RANK, TieBreak.RANK_NEEDS_NEWER, TieBreak.RANK_YIELDS_TO_NEWER}


def _rank_cases() -> list[tuple[State, Event, bool, int]]:
    return [
        (state, event, role, which)
        for (state, event), (_, roles) in RANK_ROWS.items()
        for role in roles
        for which in range(3)
    ]


def test_only_the_start_up_rows_compare_ranks() -> None:
    rank_rows = {key for key, rule in TRANSITIONS.items() if rule.tie_break in RANK_TIE_BREAKS}
    assert rank_rows == set(RANK_ROWS)
    for key, (tie_break, _) in RANK_ROWS.items():
        rule = TRANSITIONS[key]
        assert rule.tie_break is tie_break
        assert rule.conflict is None, "a cold start is not a conflict"
        assert rule.next_state is A


@pytest.mark.parametrize(
    ("state", "event", "role", "which"),
    _rank_cases(),
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_rank_row(state: State, event: Event, role: bool, which: int) -> None:
    tie_break, roles = RANK_ROWS[(state, event)]
    expected = roles[role][which]
    peer_rank = (OLD, MID, NEW)[which]
    fsm = _reach(role, state, MID)
    epoch_before = fsm.epoch
    outcome = fsm.handle(event, 1.0, 0, peer_rank)
    assert outcome.state is expected and fsm.state is expected
    assert outcome.conflict is None
    assert outcome.tie_break is tie_break
    assert outcome.yielded == (expected is not A)
    assert (outcome.rank, outcome.peer_rank) == (MID, peer_rank)
    assert fsm.peer_rank == peer_rank
    if expected is A:  # a new election, outbidding the active it stood behind, if any
        assert fsm.epoch == max(epoch_before, fsm.peer_epoch) + 1
    else:
        assert fsm.epoch == epoch_before


@pytest.mark.parametrize(
    ("state", "event", "role"),
    [(state, event, role) for (state, event), (_, roles) in RANK_ROWS.items() for role in roles],
)
def test_without_ranks_the_rows_behave_as_the_guides(
    state: State, event: Event, role: bool
) -> None:
    """In-memory servers and Guide peers announce (0, 0): nothing changes for them."""
    guide = {
        (P, Event.PEER_BACKUP): A,  # the primary serves
        (B, Event.PEER_PRIMARY): B,  # the backup waits for it
        (P, Event.PEER_PASSIVE): P,  # the passive peer takes over from our restart
        (B, Event.PEER_PASSIVE): B,
        (S, Event.PEER_PRIMARY): A,  # the active peer restarted and lost its state
        (S, Event.PEER_BACKUP): A,
    }
    fsm = _reach(role, state, NO_RANK)
    assert fsm.receive_peer_state(State(event.value), 1.0).state is guide[(state, event)]


def test_other_rows_ignore_ranks() -> None:
    """Once a server serves or stands by behind an active, ranks play no part."""
    active = _fsm(PRI, NO_RANK)
    active.receive_peer_state(B, 0.0)
    assert active.state is A
    assert active.receive_peer_state(B, 1.0, 0, NEW).state is A
    passive = _fsm(BAK, NEW)
    assert passive.receive_peer_state(A, 0.0, 1, OLD).state is S
    assert passive.receive_peer_state(A, 1.0, 1, OLD).state is S
    split = TRANSITIONS[(A, Event.PEER_ACTIVE)]
    assert split.tie_break is TieBreak.EPOCH
    assert TRANSITIONS[(S, Event.PEER_PASSIVE)].tie_break is TieBreak.ROLE


# -- a cold start of both servers ------------------------------------------------

START_PAIRS = [(P, B), (P, S), (S, B)]  # (primary's state, backup's state)


def _decide(primary: BinaryStarFSM, backup: BinaryStarFSM) -> tuple[State, State]:
    """Each side processes the other's current state message, from the same snapshot."""
    p_state, p_epoch, p_rank = primary.state, primary.epoch, primary.rank
    primary.receive_peer_state(backup.state, 1.0, backup.epoch, backup.rank)
    backup.receive_peer_state(p_state, 1.0, p_epoch, p_rank)
    return primary.state, backup.state


@settings(max_examples=300)
@given(RANKS, RANKS, st.sampled_from(START_PAIRS))
def test_exactly_one_side_goes_active_and_it_has_the_newer_data(
    primary_rank: Rank, backup_rank: Rank, states: tuple[State, State]
) -> None:
    primary = _reach(PRI, states[0], primary_rank)
    backup = _reach(BAK, states[1], backup_rank)
    after = _decide(primary, backup)
    assert after.count(A) == 1, after
    if primary_rank > backup_rank:
        assert after[0] is A
    elif backup_rank > primary_rank:
        assert after[1] is A
    elif states == (P, B):
        assert after[0] is A, "equal data: the primary serves"
    else:
        passive = 0 if states[0] is S else 1
        assert after[passive] is A, "equal data: the passive side keeps serving what it holds"


@given(RANKS, RANKS)
def test_dual_passive_still_ends_with_exactly_one_active(
    primary_rank: Rank, backup_rank: Rank
) -> None:
    primary, backup = _reach(PRI, S, primary_rank), _reach(BAK, S, backup_rank)
    assert _decide(primary, backup) == (A, S)


def test_older_primary_yields_first_then_the_backup_takes_over() -> None:
    primary, backup = _fsm(PRI, OLD), _fsm(BAK, NEW)
    outcome = primary.receive_peer_state(B, 0.5, 0, NEW)
    assert outcome.became_passive and outcome.yielded and outcome.tie_break is TieBreak.RANK
    outcome = backup.receive_peer_state(S, 0.6, primary.epoch, primary.rank)
    assert outcome.became_active and backup.epoch == 1
    assert backup.receive_peer_state(S, 1.0, 0, OLD).state is A
    assert primary.receive_peer_state(A, 1.0, backup.epoch, NEW).state is S


def test_backup_hears_the_start_first_then_the_primary_sees_it_active() -> None:
    primary, backup = _fsm(PRI, OLD), _fsm(BAK, NEW)
    assert backup.receive_peer_state(P, 0.5, 0, OLD).became_active
    # The primary may still get the backup's stale BACKUP message first.
    assert primary.receive_peer_state(B, 0.6, 0, NEW).became_passive
    assert primary.receive_peer_state(A, 0.7, backup.epoch, NEW).state is S
    assert backup.receive_peer_state(S, 0.8, 0, OLD).state is A


def test_newer_primary_serves_and_the_older_backup_stands_by() -> None:
    primary, backup = _fsm(PRI, NEW), _fsm(BAK, OLD)
    assert backup.receive_peer_state(P, 0.5, 0, NEW).state is B
    assert primary.receive_peer_state(B, 0.6, 0, OLD).became_active
    assert backup.receive_peer_state(A, 0.7, primary.epoch, NEW).became_passive


def test_in_memory_primary_restarting_behind_its_passive_backup_does_not_serve() -> None:
    """The Guide's failback: the passive backup holds the data, the restarted
    in-memory primary has none. Equal (0, 0) ranks must not let the primary win."""
    primary, backup = _fsm(PRI), _reach(BAK, S, NO_RANK)
    assert primary.receive_peer_state(S, 1.0).state is P
    assert backup.receive_peer_state(P, 1.0).became_active
    assert primary.receive_peer_state(A, 1.1, backup.epoch).became_passive


class _RankedPair:
    """A primary and a backup with fixed data ranks, linked by in-memory queues."""

    def __init__(self, ranks: dict[bool, Rank]) -> None:
        self.now = 0.0
        self.ranks = ranks
        self.fsm = {role: self._new(role) for role in (PRI, BAK)}
        self.queue: dict[bool, deque[tuple[State, int, Rank]]] = {PRI: deque(), BAK: deque()}

    def _new(self, role: bool) -> BinaryStarFSM:
        return BinaryStarFSM(
            role, self.now, heartbeat=HEARTBEAT, missed=MISSED, rank=self.ranks[role]
        )

    def publish(self, role: bool) -> None:
        fsm = self.fsm[role]
        self.queue[role].append((fsm.state, fsm.epoch, fsm.rank))

    def deliver(self, sender: bool) -> None:
        if self.queue[sender]:
            state, epoch, rank = self.queue[sender].popleft()
            outcome = self.fsm[not sender].receive_peer_state(state, self.now, epoch, rank)
            if outcome.changed:
                self.publish(not sender)

    def restart(self, role: bool) -> None:
        self.fsm[role] = self._new(role)
        self.publish(role)

    def settle(self) -> None:
        for _ in range(3):
            while self.queue[PRI] or self.queue[BAK]:
                self.deliver(PRI)
                self.deliver(BAK)
            self.publish(PRI)
            self.publish(BAK)
        while self.queue[PRI] or self.queue[BAK]:
            self.deliver(PRI)
            self.deliver(BAK)

    @property
    def states(self) -> tuple[State, State]:
        return self.fsm[PRI].state, self.fsm[BAK].state


_STEPS = st.sampled_from(["publish-p", "publish-b", "deliver-p", "deliver-b"])


@settings(max_examples=300, deadline=None)
@given(RANKS, RANKS, st.lists(_STEPS, max_size=20))
def test_cold_start_in_any_message_order_the_newer_data_serves(
    primary_rank: Rank, backup_rank: Rank, steps: list[str]
) -> None:
    """Both start together; messages go out and arrive in any interleaving."""
    pair = _RankedPair({PRI: primary_rank, BAK: backup_rank})
    for step in steps:
        verb, _, who = step.partition("-")
        role = who == "p"
        if verb == "publish":
            pair.publish(role)
        else:
            pair.deliver(role)
        assert pair.states != (A, A), "never both active"
    pair.settle()
    winner = PRI if primary_rank >= backup_rank else BAK
    assert pair.fsm[winner].state is A
    assert pair.fsm[not winner].state is S


_HISTORY = st.sampled_from(
    ["publish-p", "publish-b", "deliver-p", "deliver-b", "restart-p", "restart-b", "clear-p"]
)


@settings(max_examples=300, deadline=None)
@given(RANKS, RANKS, st.lists(_HISTORY, max_size=40))
def test_any_history_with_ranks_settles_to_one_active(
    primary_rank: Rank, backup_rank: Rank, steps: list[str]
) -> None:
    pair = _RankedPair({PRI: primary_rank, BAK: backup_rank})
    for step in steps:
        verb, _, who = step.partition("-")
        role = who == "p"
        if verb == "publish":
            pair.publish(role)
        elif verb == "deliver":
            pair.deliver(role)
        elif verb == "restart":
            pair.queue[role].clear()  # what the dead process had queued is lost
            pair.restart(role)
        else:
            pair.queue[role].clear()
    pair.settle()
    assert sorted(pair.states, key=lambda s: s.value) == [A, S]


# -- the start wait ----------------------------------------------------------------


def test_start_wait_stretches_the_first_expiry_only() -> None:
    fsm = _fsm(PRI, start_wait=10.0)
    assert fsm.start_wait == 10.0 and not fsm.heard_peer
    assert fsm.peer_expiry == 10.0
    assert not fsm.client_request(9.9).accepted
    assert fsm.client_request(10.0).became_active


def test_start_wait_shorter_than_the_heartbeat_expiry_changes_nothing() -> None:
    assert _fsm(PRI, start_wait=0.5).peer_expiry == EXPIRY


def test_after_first_contact_the_start_wait_plays_no_part() -> None:
    fsm = _fsm(BAK, start_wait=10.0)
    fsm.receive_peer_state(A, 1.0, 1)
    assert fsm.heard_peer and fsm.peer_expiry == 1.0 + EXPIRY
    fsm.peer_disconnected(1.5)
    assert fsm.peer_expiry == 1.5
    assert fsm.client_request(1.5).became_active


def test_a_lost_connection_before_first_contact_does_not_cut_the_start_wait() -> None:
    """A lone server whose peer is not up yet (connection refused or dropped)
    still waits: the peer may be booting with newer data."""
    fsm = _fsm(PRI, start_wait=10.0)
    assert fsm.peer_disconnected(0.1) is False, "still within the start wait: nothing new"
    assert fsm.peer_lost_at == 0.1
    assert fsm.peer_expiry == 10.0
    assert not fsm.check_expiry(5.0)
    assert not fsm.client_request(9.9).accepted
    assert fsm.check_expiry(10.0)
    assert fsm.client_request(10.0).became_active


def test_a_lost_connection_still_cuts_the_heartbeat_part_of_a_short_start_wait() -> None:
    fsm = _fsm(PRI, start_wait=0.5)
    fsm.peer_disconnected(0.1)
    assert fsm.peer_expiry == 0.5
    fsm2 = _fsm(PRI)  # no start wait: the existing shortcut is untouched
    fsm2.peer_disconnected(0.1)
    assert fsm2.peer_expiry == 0.1


@given(
    st.floats(0.0, 100.0),
    st.one_of(st.none(), st.floats(0.0, 200.0)),
    st.floats(0.0, 200.0),
)
def test_a_never_heard_peer_never_expires_before_the_start_wait(
    start_wait: float, lost_at: float | None, now: float
) -> None:
    fsm = _fsm(PRI, start_wait=start_wait)
    if lost_at is not None:
        fsm.peer_disconnected(lost_at)
    assert fsm.peer_expiry >= start_wait
    assert fsm.peer_expiry <= max(start_wait, EXPIRY)
    if now < start_wait:
        assert not fsm.client_request(now).accepted


# -- construction and inputs --------------------------------------------------------


def test_initial_epoch_is_outbid_by_the_next_election() -> None:
    fsm = BinaryStarFSM(True, 0.0, epoch=7)
    assert fsm.epoch == 7
    assert fsm.receive_peer_state(B, 0.1).became_active
    assert fsm.epoch == 8


def test_set_rank_and_peer_rank_follow_the_latest_message() -> None:
    fsm = _fsm(BAK, OLD)
    assert (fsm.rank, fsm.peer_rank) == (OLD, NO_RANK)
    fsm.set_rank(MID)
    assert fsm.rank == MID
    fsm.receive_peer_state(A, 0.1, 1, NEW)
    assert fsm.peer_rank == NEW
    fsm.receive_peer_state(A, 0.2, 1, OLD)
    assert fsm.peer_rank == OLD, "the latest, not the highest"
    fsm.receive_peer_state(A, 0.3, 1)
    assert fsm.peer_rank == NO_RANK


def test_client_request_outcome_has_no_peer_rank() -> None:
    outcome = _fsm(PRI, MID).client_request(EXPIRY)
    assert isinstance(outcome, Outcome)
    assert outcome.rank == MID and outcome.peer_rank is None and outcome.tie_break is None


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"epoch": -1}, ValueError),
        ({"epoch": True}, TypeError),
        ({"epoch": 1.0}, TypeError),
        ({"start_wait": -0.1}, ValueError),
        ({"start_wait": math.nan}, ValueError),
        ({"start_wait": math.inf}, ValueError),
        ({"start_wait": True}, TypeError),
        ({"start_wait": "1"}, TypeError),
        ({"rank": (1,)}, TypeError),
        ({"rank": [1, 2]}, TypeError),
        ({"rank": (1, -2)}, ValueError),
        ({"rank": (1, 2.0)}, TypeError),
        ({"rank": (True, 2)}, TypeError),
    ],
)
def test_constructor_rejects_bad_epoch_start_wait_and_rank(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error):
        BinaryStarFSM(True, 0.0, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [(1,), (-1, 0), (0, 1.5), None])
def test_bad_ranks_are_rejected_and_change_nothing(rank: object) -> None:
    fsm = _fsm(BAK, OLD)
    with pytest.raises((TypeError, ValueError)):
        fsm.set_rank(rank)  # type: ignore[arg-type]
    with pytest.raises((TypeError, ValueError)):
        fsm.receive_peer_state(A, 0.1, 1, rank)  # type: ignore[arg-type]
    assert fsm.rank == OLD and fsm.state is B and not fsm.heard_peer


# -- wire format ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "epoch", "rank", "frame"),
    [
        (P, 5, (5, 120), b"1:5:5:120"),
        (A, 0, (0, 0), b"3:0:0:0"),
        (S, 17, None, b"4:17"),
        (B, MAX_RANK_PART, (MAX_RANK_PART, MAX_RANK_PART), b"2" + b":4611686018427387904" * 3),
    ],
)
def test_encode_with_and_without_a_rank(
    state: State, epoch: int, rank: Rank | None, frame: bytes
) -> None:
    assert encode_state(state, epoch, rank) == [frame]
    assert len(frame) <= MAX_STATE_FRAME
    assert decode_state([frame]) == PeerReport(state, epoch, NO_RANK if rank is None else rank)
    assert int(frame.split(b":")[0]) == state.value  # what a Guide peer's atoi sees


@given(
    st.sampled_from(State),
    st.integers(0, MAX_RANK_PART),
    st.tuples(st.integers(0, MAX_RANK_PART), st.integers(0, MAX_RANK_PART)),
)
def test_any_ranked_state_round_trips(state: State, epoch: int, rank: Rank) -> None:
    assert decode_state(encode_state(state, epoch, rank)) == PeerReport(state, epoch, rank)


@pytest.mark.parametrize("frame", [b"3", b"3\0", b"3:4", b"3:4\0", b"3:4:5:6\0", b"3:004:005:006"])
def test_decode_accepts_every_known_shape(frame: bytes) -> None:
    report = decode_state([frame])
    assert report.state is A
    assert report.rank in (NO_RANK, (5, 6))


@pytest.mark.parametrize(
    ("rank", "error"),
    [
        ((MAX_RANK_PART + 1, 0), ValueError),
        ((0, MAX_RANK_PART + 1), ValueError),
        ((-1, 0), ValueError),
        ((1,), TypeError),
        ((1, 2, 3), TypeError),
        ((1.0, 2), TypeError),
    ],
)
def test_encode_rejects_bad_ranks(rank: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_state(A, 1, rank)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "frame",
    [
        b"3:1:2",
        b"3:1:2:",
        b"3:1::2",
        b"3::1:2",
        b"3:1:2:3:4",
        b"3:1:2:3:",
        b"3:1:-2:3",
        b"3:1:2:+3",
        b"3:1: 2:3",
        b"3:1:2:3 ",
        b"3:1:x:3",
        b"3:1:2:0x3",
        b"3:1:" + b"1" * 21 + b":3",
        b"3:1:2:" + b"1" * 21,
        b"3:1:2:" + b"1" * (MAX_STATE_FRAME),
        b"5:1:2:3",
        b"3:1:2\0:3",
        "3:1:2:\uff13".encode(),
    ],
)
def test_decode_rejects_malformed_ranked_messages(frame: bytes) -> None:
    with pytest.raises(PeerStateError, match="from tcp://peer"):
        decode_state([frame], "tcp://peer")


@given(
    st.one_of(
        st.lists(st.binary(max_size=80), max_size=2),
        st.lists(
            st.from_regex(rb"\A[0-9]{1,2}(:[-+ 0-9]{0,22}){0,5}\x00{0,3}\Z"), min_size=1, max_size=1
        ),
    )
)
def test_decode_is_total_for_ranked_shapes(frames: list[bytes]) -> None:
    try:
        report = decode_state(frames)
    except PeerStateError:
        return
    assert isinstance(report.state, State)
    assert 0 <= report.epoch <= MAX_RANK_PART
    term, sequence = report.rank
    assert 0 <= term <= MAX_RANK_PART and 0 <= sequence <= MAX_RANK_PART


def test_a_backup_alone_serves_after_its_start_wait() -> None:
    """A durable backup that starts alone does not wait forever: after its start
    wait, with no word from the primary, a client's vote makes it active."""
    fsm = _fsm(BAK, start_wait=10.0)
    assert not fsm.client_request(9.9).accepted
    assert fsm.state is State.BACKUP
    outcome = fsm.client_request(10.0)
    assert outcome.accepted and fsm.state is State.ACTIVE and fsm.epoch == 1


def test_a_backup_without_a_start_wait_never_serves_alone() -> None:
    fsm = _fsm(BAK)  # in memory: the Guide's rule
    for now in (1.0, 100.0, 10_000.0):
        assert not fsm.client_request(now).accepted
    assert fsm.state is State.BACKUP


def test_a_backup_that_heard_the_primary_keeps_the_guides_rule() -> None:
    fsm = _fsm(BAK, start_wait=1.0)
    fsm.receive_peer_state(State.PRIMARY, 0.5)
    # Heard once: the primary is starting too; only it may decide.
    assert not fsm.client_request(100.0).accepted
    assert fsm.state is State.BACKUP


# -- a server restarted from data it wrote as the passive ---------------------


def test_only_the_votes_that_make_a_server_active_are_refused_behind() -> None:
    rows = {key for key, rule in TRANSITIONS.items() if rule.refused_behind}
    assert rows == {(P, Event.CLIENT_REQUEST), (B, Event.CLIENT_REQUEST), (S, Event.CLIENT_REQUEST)}


def test_a_passive_behind_the_active_takes_no_vote_until_it_caught_up() -> None:
    """Chaos run seed 7 with the first fix: a restarted primary went passive,
    its sync not done when the active died; a vote made it active on its older
    state.  The application marks it behind until its first sync completes."""
    fsm = _fsm(PRI, start_wait=10.0, epoch=32, rank=(32, 5806))
    fsm.receive_peer_state(A, 0.5, epoch=33, rank=(32, 5838))
    assert fsm.state is S
    fsm.set_behind_peer(True)
    assert fsm.waits_for_peer
    # The active dies: its expiry passes, a client votes.
    for now in (2.0, 100.0):
        assert not fsm.client_request(now).accepted
    assert fsm.state is S
    # Synced before it died (say): the next vote is a normal failover.
    fsm.set_behind_peer(False)
    outcome = fsm.client_request(101.0)
    assert outcome.accepted and fsm.state is A and fsm.epoch == 34


def test_becoming_active_clears_behind() -> None:
    fsm = _fsm(PRI, start_wait=10.0, epoch=3, rank=(3, 50), behind_peer=True)
    fsm.receive_peer_state(B, 1.0, epoch=3, rank=(3, 40))  # our data is newer: serve
    assert fsm.state is A and not fsm.behind_peer and not fsm.waits_for_peer


def test_a_restarted_follower_stays_behind_once_passive_until_told() -> None:
    # Behind from its start (data written as the passive), it hears the active
    # and stands by: still behind until the application says it caught up.
    fsm = _fsm(BAK, start_wait=10.0, epoch=5, rank=(5, 10), behind_peer=True)
    fsm.receive_peer_state(A, 1.0, epoch=6, rank=(6, 20))
    assert fsm.state is S and fsm.waits_for_peer
    assert not fsm.client_request(50.0).accepted


@pytest.mark.parametrize("primary", [PRI, BAK], ids=["primary", "backup"])
def test_a_server_behind_its_peer_never_serves_before_hearing_it(primary: bool) -> None:
    """Chaos run seed 7: the primary fail-stopped as the passive at (43, 9566),
    the backup confirmed writes to 9642 and fail-stopped too; the primary,
    restarted alone, served after its start wait and its later election
    (term 44) outranked the backup's newer writes when it came back.  Behind
    its peer, a server waits for it, whatever the time."""
    fsm = _fsm(primary, start_wait=10.0, epoch=43, rank=(43, 9566), behind_peer=True)
    assert fsm.waits_for_peer
    for now in (9.9, 10.0, 100.0, 10_000.0):
        outcome = fsm.client_request(now)
        assert not outcome.accepted and outcome.vote is Vote.REFUSED
    assert fsm.state is (P if primary else B) and fsm.epoch == 43
    # The peer is back with the writes we lack: it serves, we follow.
    peer = B if primary else P
    outcome = fsm.receive_peer_state(peer, 10_001.0, epoch=43, rank=(43, 9642))
    assert outcome.yielded and outcome.state is not State.ACTIVE
    fsm.receive_peer_state(A, 10_001.1, epoch=44, rank=(44, 9642))
    # Passive now, and behind until its sync from the active completes.
    assert fsm.state is State.PASSIVE and fsm.waits_for_peer


@pytest.mark.parametrize("primary", [PRI, BAK], ids=["primary", "backup"])
def test_a_server_behind_its_peer_still_serves_when_its_data_is_newer(primary: bool) -> None:
    """Behind only means "wait to hear the peer": the ranks still decide."""
    fsm = _fsm(primary, start_wait=10.0, epoch=43, rank=(43, 9642), behind_peer=True)
    peer = B if primary else P
    outcome = fsm.receive_peer_state(peer, 1.0, epoch=43, rank=(43, 9566))
    assert outcome.state is State.ACTIVE and fsm.epoch == 44


def test_behind_peer_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="behind_peer"):
        BinaryStarFSM(True, 0.0, behind_peer=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="behind"):
        BinaryStarFSM(True, 0.0).set_behind_peer(1)  # type: ignore[arg-type]
