"""The client agent's vocabulary: its states, the events of its table, and
the actions its state machine returns for the I/O loop to carry out (pure).

How this works: :class:`~clone.client.fsm.AgentFSM` takes events with an
explicit ``now`` and returns a list of these frozen dataclasses; the agent
(:mod:`clone.client.agent`) carries each out (a send, an event to the
frontend) and decides nothing itself.  Kept apart from the state
(:mod:`clone.client.state`) so that a reader of the loop sees every action it
must handle in one short module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from clone.wire.calls import Reply
from clone.wire.codec import KVMsg

__all__ = [
    "Action",
    "CallReplied",
    "Changed",
    "Confirmed",
    "Event",
    "LeaseGone",
    "LeaseKept",
    "Malformed",
    "Refused",
    "RequestSnapshot",
    "SendCall",
    "SendUpdate",
    "SplitConflicted",
    "State",
    "StateChanged",
]


class State(enum.Enum):
    INITIAL = "initial"  # no server known yet
    SYNCING = "syncing"  # snapshot requested from the current server
    ACTIVE = "active"  # snapshot complete, applying updates


class Event(enum.Enum):
    CONNECT = "connect"  # a server endpoint was added
    # Raw snapshot replies (KVSYNCs, KVBATCHes, KTHXBAIs), undecoded: the only
    # snapshot event, as the I/O loop hands them over thousands at a time.
    SNAPSHOT_BATCH = "snapshot_batch"
    UPDATE = "update"  # KVPUB
    HEARTBEAT = "heartbeat"  # HUGZ
    # The heartbeat of a restricted client's filtered stream (clone.wire.control):
    # liveness, like HUGZ, and the count that replaces the "+1" rule.
    VIEW_HEARTBEAT = "view_heartbeat"
    SILENCE = "silence"  # the current server said nothing for server_timeout
    REASK = "reask"  # syncing, no snapshot data yet, reask_interval passed
    SERVER_DISCONNECTED = "server_disconnected"  # TCP connection to its publisher lost
    # Another server published a KVPUB, or a HUGZ that says its heartbeat: it is
    # active.  The only event about a server that is not the current one.
    ACTIVE_ELSEWHERE = "active_elsewhere"


# --------------------------------------------------------------------------
# Actions: what the I/O loop must do.


@dataclass(frozen=True, slots=True)
class RequestSnapshot:
    """Send ICANHAZ? for each subtree to ``server``, on a fresh DEALER.

    A fresh socket per request means late replies to an earlier request cannot
    be mistaken for this one.  ``since``: ask for a catch-up instead (our
    KVDELTA extension): the sequence and digest of the last update we applied,
    for the DEALER's ``X-CHP-Since`` metadata (:func:`clone.wire.delta.since_metadata`).
    """

    server: int
    subtrees: tuple[str, ...]
    since: tuple[int, bytes] | None = None


@dataclass(frozen=True, slots=True)
class SendUpdate:
    """Publish this KVSET to every server's collector.

    ``frames``: the KVSET as the frontend built it, when this is its first
    send: the agent sends those frames as they are, so a write is encoded
    once, in the application's thread (a resend encodes ``msg`` again).
    """

    msg: KVMsg
    frames: list[bytes] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class Changed:
    """The application's view of ``key`` changed.

    ``entry`` None, or an entry with an empty body, means deleted: a live delete
    carries its KVPUB (so its sequence), a key gone after a resync has none.
    ``resync``: the change comes from a resync's diff, not from an update, so
    the key's updates since the last change told are not known; watchers learn
    it in order with the changes (a counter read later cannot say which
    changes came before the resync).
    """

    key: str
    entry: KVMsg | None
    resync: bool = False


@dataclass(frozen=True, slots=True)
class Confirmed:
    """The write with this uuid is in the map: the active server republished it,
    as the update with this ``sequence`` (what ``set(wait=True)`` returns)."""

    uuid: bytes
    sequence: int


@dataclass(frozen=True, slots=True)
class StateChanged:
    state: State
    server: int | None


@dataclass(frozen=True, slots=True)
class Malformed:
    """A reply was dropped as malformed (already counted): log ``error``."""

    server: int
    what: str
    error: str


@dataclass(frozen=True, slots=True)
class Refused:
    """The server refused the confirmed write ``uuid`` to ``key`` (a refusal
    notice): fail it now with ``reason``, it will never be applied."""

    uuid: bytes
    reason: str
    key: str


@dataclass(frozen=True, slots=True)
class SplitConflicted:
    """A write of ours already confirmed became a split-brain conflict (a
    notice from the server that confirmed it, after it stepped down): tell
    the application."""

    uuid: bytes
    key: str


@dataclass(frozen=True, slots=True)
class SendCall:
    """Send this CALL? (:mod:`clone.wire.calls`) to ``server`` on its call DEALER
    (connected to its snapshot port; the reply comes back on it)."""

    frames: tuple[bytes, ...]
    server: int


@dataclass(frozen=True, slots=True)
class CallReplied:
    """A call the application waits on has its answer (never ``not-active``:
    those calls stay pending and are sent again)."""

    reply: Reply


@dataclass(frozen=True, slots=True)
class LeaseKept:
    """A keepalive was answered: the servers hold the lease at least until
    ``valid_until`` (the agent's clock: when that keepalive was first made, plus
    the ttl; a server counts the ttl from when it received it, later)."""

    lease_id: str
    valid_until: float


@dataclass(frozen=True, slots=True)
class LeaseGone:
    """A lease we kept alive is gone from the servers (a keepalive was refused,
    ``why`` says how): we no longer keep it; tell the application."""

    lease_id: str
    why: str


Action = (
    RequestSnapshot
    | SendUpdate
    | Changed
    | Confirmed
    | StateChanged
    | Malformed
    | Refused
    | SplitConflicted
    | SendCall
    | CallReplied
    | LeaseGone
    | LeaseKept
)
