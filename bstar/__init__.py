"""Binary Star: primary/backup failover for a pair of ZeroMQ servers.

The pattern is the one from chapter 4 of the ZeroMQ Guide: two servers publish
their state to each other every heartbeat; clients vote for the server they want
by sending it requests; a passive server takes over only when its peer has gone
silent *and* a client asks it to. See ``docs/failover.md`` for the rules.

* :mod:`bstar.rules` holds the decision table (states, events, rules, tie-breaks)
  and :mod:`bstar.fsm` the machine that applies it (no I/O, explicit ``now``);
* :mod:`bstar.wire` the state message format (state, election epoch and, for a
  server that keeps its data on disk, the data rank);
* :mod:`bstar.reactor` the sockets and timers on a tornado IOLoop.
* :mod:`bstar.hooks` the types of the callbacks an application hands it.
"""

from bstar.errors import (
    BinaryStarError,
    IllegalTransitionError,
    PeerNumberOutOfRange,
    PeerStateError,
    RoleConflictError,
)
from bstar.fsm import (
    NO_RANK,
    TRANSITIONS,
    BinaryStarFSM,
    Conflict,
    Event,
    FsmCounters,
    Outcome,
    Rank,
    Rule,
    State,
    TieBreak,
    Vote,
    VotePolicy,
    check_rank,
    peer_event,
    yields_on_rank,
    yields_to_peer,
)
from bstar.reactor import BinaryStar, BinaryStarCounters, StateCallback, VoteHandler
from bstar.wire import MAX_EPOCH, MAX_RANK_PART, PeerReport, decode_state, encode_state

__all__ = [
    "MAX_EPOCH",
    "MAX_RANK_PART",
    "NO_RANK",
    "TRANSITIONS",
    "BinaryStar",
    "BinaryStarCounters",
    "BinaryStarError",
    "BinaryStarFSM",
    "Conflict",
    "Event",
    "FsmCounters",
    "IllegalTransitionError",
    "Outcome",
    "PeerNumberOutOfRange",
    "PeerReport",
    "PeerStateError",
    "Rank",
    "RoleConflictError",
    "Rule",
    "State",
    "StateCallback",
    "TieBreak",
    "Vote",
    "VoteHandler",
    "VotePolicy",
    "check_rank",
    "decode_state",
    "encode_state",
    "peer_event",
    "yields_on_rank",
    "yields_to_peer",
]
