"""Binary Star's table: the states, the events, the rules keyed by
``(state, event)`` and the tie-breaks they name.

How this works: :data:`TRANSITIONS` is the whole decision table of a server
in a pair (:class:`~bstar.fsm.BinaryStarFSM` applies it; the module
docstring there says why each row is what it is).  A row (:class:`Rule`)
names the next state, how to answer a vote, whether the pair is in conflict,
and, for the symmetric rows, where the side that yields goes and how that
side is picked (:class:`TieBreak`: role, epoch or data rank).  Pure: no
clock, no I/O.  :mod:`bstar.fsm` re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Final, TypeAlias

__all__ = [
    "MAX_EPOCH",
    "NO_RANK",
    "TRANSITIONS",
    "Conflict",
    "Event",
    "Rank",
    "Rule",
    "State",
    "TieBreak",
    "Vote",
    "VotePolicy",
    "check_epoch",
    "check_rank",
    "peer_event",
    "yields_on_rank",
    "yields_to_peer",
]

#: How new a server's data is: ``(term, sequence)``, compared lexicographically.
Rank: TypeAlias = tuple[int, int]
#: The rank of a server with no data, or that does not say (in memory, a Guide peer).
NO_RANK: Final[Rank] = (0, 0)
#: The largest election epoch, and rank part, a server holds, announces or
#: accepts.  Far below what the wire (20 digits) and SQLite (a signed 64-bit
#: INTEGER) carry, so no bump can overflow either, and out of reach of any real
#: count of elections or writes (one per nanosecond for 146 years).  A peer
#: claiming more is refused at the wire (:mod:`bstar.wire`), never obeyed.
MAX_EPOCH: Final = 2**62


def check_rank(rank: object, what: str = "rank") -> Rank:
    """Return ``rank`` as a :data:`Rank` or raise ``TypeError``/``ValueError``.

    A pair of non-negative ints; anything else is a bug in the caller.
    """
    if not isinstance(rank, tuple) or len(rank) != 2:
        raise TypeError(f"{what} must be a (term, sequence) tuple, got {rank!r}")
    for part in rank:
        if isinstance(part, bool) or not isinstance(part, int):
            raise TypeError(f"{what} must hold two ints, got {rank!r}")
        if not 0 <= part <= MAX_EPOCH:
            raise ValueError(f"{what} must hold two ints in [0, {MAX_EPOCH}], got {rank!r}")
    return (rank[0], rank[1])


def check_epoch(epoch: object) -> None:
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be between 0 and {MAX_EPOCH}, got {epoch}")


class State(Enum):
    """Where a server stands. The values are the Guide's wire numbers; keep them."""

    PRIMARY = 1  # configured primary, waiting to hear the peer
    BACKUP = 2  # configured backup, waiting to hear the peer
    ACTIVE = 3  # serving clients
    PASSIVE = 4  # standing by, refusing clients while the peer lives


class Event(Enum):
    """What can happen to a server. ``PEER_*`` mirror the peer's published state."""

    PEER_PRIMARY = 1
    PEER_BACKUP = 2
    PEER_ACTIVE = 3
    PEER_PASSIVE = 4
    CLIENT_REQUEST = 5


_PEER_EVENTS: Final[Mapping[State, Event]] = MappingProxyType(
    {
        State.PRIMARY: Event.PEER_PRIMARY,
        State.BACKUP: Event.PEER_BACKUP,
        State.ACTIVE: Event.PEER_ACTIVE,
        State.PASSIVE: Event.PEER_PASSIVE,
    }
)


def peer_event(state: State) -> Event:
    """The event this server sees when its peer reports ``state``."""
    return _PEER_EVENTS[state]


class VotePolicy(Enum):
    """How a rule answers a client request."""

    ACCEPT = "accept"
    REFUSE = "refuse"
    ACCEPT_IF_PEER_DEAD = "accept if the peer has expired"
    #: Only a server with a start wait that has never heard its peer, once the
    #: wait is over: a backup that starts alone (its data on disk) serves after a
    #: bounded wait instead of never; without a start wait it refuses, as the
    #: Guide's backup does.
    ACCEPT_IF_WAITED_ALONE = "accept if the start wait passed without a word from the peer"


class Vote(Enum):
    """The answer given to one client request."""

    ACCEPTED = "accepted"
    REFUSED = "refused"


class Conflict(Enum):
    """Both servers claim the same settled state; the table says who yields."""

    SPLIT_BRAIN = "both servers active"
    DUAL_PASSIVE = "both servers passive"


class TieBreak(Enum):
    """How a symmetric conflict picks the server that yields."""

    ROLE = "the backup yields"
    EPOCH = "the lower epoch yields; on equal epochs the backup yields"
    RANK = "the older data yields; on equal rank the backup yields"
    #: A starting server facing a passive peer: it serves only with newer data.
    RANK_NEEDS_NEWER = "go ahead only with strictly newer data; on equal rank yield"
    #: A passive server facing a restarted peer: only newer data displaces it.
    RANK_YIELDS_TO_NEWER = "yield only to strictly newer data; on equal rank go ahead"


def yields_to_peer(own_epoch: int, peer_epoch: int, primary: bool) -> bool:
    """Whether a server with ``own_epoch`` gives way to an active peer at ``peer_epoch``.

    The higher epoch was elected later, so clients voted for it and wrote to it
    last: it keeps serving. Equal epochs mean neither heard of the other's
    election; the configured roles then decide, so the answer is never the same
    on both sides: exactly one of ``yields_to_peer(a, b, True)`` and
    ``yields_to_peer(b, a, False)`` is true.
    """
    if own_epoch != peer_epoch:
        return own_epoch < peer_epoch
    return not primary


def yields_on_rank(own_rank: Rank, peer_rank: Rank, primary: bool) -> bool:
    """Whether a starting server with data at ``own_rank`` gives way to a starting
    peer at ``peer_rank``.

    Older data yields, so that a confirmed write (which only the newer side has)
    is never rolled back. Equal ranks (including two servers without data) fall
    back on the roles, as the Guide does: the primary serves. As for epochs,
    exactly one of ``yields_on_rank(a, b, True)`` and ``yields_on_rank(b, a, False)``
    is true.
    """
    if own_rank != peer_rank:
        return own_rank < peer_rank
    return not primary


@dataclass(frozen=True, slots=True)
class Rule:
    """One row of the transition table.

    ``next_state`` is where the server goes; for a vote with
    ``ACCEPT_IF_PEER_DEAD`` it is where an *accepted* vote takes it (a refused vote
    changes nothing). ``yield_state``, when set, is where the server goes instead
    if it yields to its peer, and ``tie_break`` says which side yields: that is how
    a symmetric conflict is broken deterministically.
    """

    next_state: State
    why: str
    vote: VotePolicy | None = None
    conflict: Conflict | None = None
    yield_state: State | None = None
    tie_break: TieBreak = TieBreak.ROLE
    #: A vote here makes a server active on data the peer may have outgrown:
    #: refused while the server is behind its peer (:attr:`BinaryStarFSM.waits_for_peer`).
    refused_behind: bool = False

    def yields(
        self,
        primary: bool,
        own_epoch: int = 0,
        peer_epoch: int = 0,
        own_rank: Rank = NO_RANK,
        peer_rank: Rank = NO_RANK,
    ) -> bool:
        """Whether a server of this role, epoch and rank gives way to the peer
        under this rule."""
        if self.yield_state is None:
            return False
        if self.tie_break is TieBreak.EPOCH:
            return yields_to_peer(own_epoch, peer_epoch, primary)
        if self.tie_break is TieBreak.RANK:
            return yields_on_rank(own_rank, peer_rank, primary)
        if self.tie_break is TieBreak.RANK_NEEDS_NEWER:
            return own_rank <= peer_rank
        if self.tie_break is TieBreak.RANK_YIELDS_TO_NEWER:
            return own_rank < peer_rank
        return not primary

    def target(
        self,
        primary: bool,
        own_epoch: int = 0,
        peer_epoch: int = 0,
        own_rank: Rank = NO_RANK,
        peer_rank: Rank = NO_RANK,
    ) -> State:
        """Where a server of the given role, epoch and rank goes under this rule."""
        if self.yield_state is not None and self.yields(
            primary, own_epoch, peer_epoch, own_rank, peer_rank
        ):
            return self.yield_state
        return self.next_state


_P, _B, _A, _S = State.PRIMARY, State.BACKUP, State.ACTIVE, State.PASSIVE

#: The Binary Star rules. Deliberately absent, hence illegal:
#: (PRIMARY, PEER_PRIMARY) and (BACKUP, PEER_BACKUP): two servers configured with
#: the same role. (A peer announcing our own role is refused in every state, see
#: BinaryStarFSM.handle, because then no role-based tie-break can work.)
TRANSITIONS: Final[Mapping[tuple[State, Event], Rule]] = MappingProxyType(
    {
        # PRIMARY: configured primary, peer not heard yet.
        (_P, Event.PEER_BACKUP): Rule(
            _A,
            "both starting: the newer data serves; on equal data the primary",
            yield_state=_S,
            tie_break=TieBreak.RANK,
        ),
        (_P, Event.PEER_ACTIVE): Rule(_S, "backup is already active (failback), so stand by"),
        (_P, Event.PEER_PASSIVE): Rule(
            _A,
            "our restarted data is newer than the passive backup's, so serve; otherwise"
            " it takes over from us: wait for news",
            yield_state=_P,
            tie_break=TieBreak.RANK_NEEDS_NEWER,
        ),
        (_P, Event.CLIENT_REQUEST): Rule(
            _A,
            "backup silent for the whole expiry period and a client voted for us",
            vote=VotePolicy.ACCEPT_IF_PEER_DEAD,
            refused_behind=True,
        ),
        # BACKUP: configured backup, peer not heard yet.
        (_B, Event.PEER_PRIMARY): Rule(
            _A,
            "both starting: the newer data serves; on equal data the primary",
            yield_state=_B,
            tie_break=TieBreak.RANK,
        ),
        (_B, Event.PEER_ACTIVE): Rule(_S, "primary is active, so stand by"),
        (_B, Event.PEER_PASSIVE): Rule(
            _A,
            "our data is newer than the passive primary's, so serve; otherwise it"
            " takes over from us: wait for it",
            yield_state=_B,
            tie_break=TieBreak.RANK_NEEDS_NEWER,
        ),
        (_B, Event.CLIENT_REQUEST): Rule(
            _A,
            "a backup serves only after it has seen the primary, or once a start wait"
            " passed without a word from it (a durable server that starts alone)",
            vote=VotePolicy.ACCEPT_IF_WAITED_ALONE,
            refused_behind=True,
        ),
        # ACTIVE: serving. The only normal way out is death.
        (_A, Event.PEER_PRIMARY): Rule(_A, "peer restarted and goes passive on seeing us"),
        (_A, Event.PEER_BACKUP): Rule(_A, "peer restarted and goes passive on seeing us"),
        (_A, Event.PEER_ACTIVE): Rule(
            _A,
            "split brain: the later elected (higher epoch) keeps serving, the other steps"
            " down; on equal epochs the primary keeps serving",
            conflict=Conflict.SPLIT_BRAIN,
            yield_state=_S,
            tie_break=TieBreak.EPOCH,
        ),
        (_A, Event.PEER_PASSIVE): Rule(_A, "normal operation"),
        (_A, Event.CLIENT_REQUEST): Rule(_A, "we serve", vote=VotePolicy.ACCEPT),
        # PASSIVE: standing by while the peer serves.
        (_S, Event.PEER_PRIMARY): Rule(
            _A,
            "active peer restarted; take over unless its data is newer than ours",
            yield_state=_S,
            tie_break=TieBreak.RANK_YIELDS_TO_NEWER,
        ),
        (_S, Event.PEER_BACKUP): Rule(
            _A,
            "active peer restarted; take over unless its data is newer than ours",
            yield_state=_S,
            tie_break=TieBreak.RANK_YIELDS_TO_NEWER,
        ),
        (_S, Event.PEER_ACTIVE): Rule(_S, "normal operation"),
        (_S, Event.PEER_PASSIVE): Rule(
            _A,
            "nobody serves: the primary takes over, the backup keeps standing by",
            conflict=Conflict.DUAL_PASSIVE,
            yield_state=_S,
            tie_break=TieBreak.ROLE,
        ),
        (_S, Event.CLIENT_REQUEST): Rule(
            _A,
            "failover: the peer expired and a client voted for us",
            vote=VotePolicy.ACCEPT_IF_PEER_DEAD,
            refused_behind=True,
        ),
    }
)
