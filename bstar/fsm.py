"""Binary Star failover state machine, without any I/O.

How this works
--------------
A Binary Star pair is two servers, one configured *primary* and one *backup*.
Each runs a :class:`BinaryStarFSM`. A server starts in ``PRIMARY`` or ``BACKUP``
(its configured role, peer not heard yet) and settles in ``ACTIVE`` (serving
clients) or ``PASSIVE`` (standing by). Two kinds of input drive it:

* the state the peer publishes every heartbeat, mapped to a ``PEER_*`` event;
* a client request (a *vote*): a client asking this server to serve it, which it
  only does because it believes the other server is gone.

The rules live in :data:`TRANSITIONS`, a table keyed by ``(state, event)``. A rule
names the next state, how to answer a vote, and whether the pair is in conflict
(both active: *split brain*; both passive: nobody serves). Conflicts are symmetric,
so the rule also names where the side that *yields* goes (``yield_state``) and how
the yielding side is picked (``tie_break``); the start-up rows that compare data
ranks (below) use the same two fields. A pair missing from the table raises
:class:`~bstar.errors.IllegalTransitionError` and leaves the machine untouched.

Epochs settle split brain. Each server holds an election *epoch* (a term number,
as in Raft), 0 at start (or the last one it saved, for a server that keeps its
data on disk); whenever it becomes ``ACTIVE`` it takes
``max(own epoch, highest peer epoch seen) + 1``, and it announces its epoch with
its state. Two actives compare epochs: the lower one yields (:func:`yields_to_peer`),
because the server elected most recently is the one the clients last voted for
and wrote to. A frozen primary that thaws still believes it is active, but with
the epoch it had before the backup took over, so it is the one that steps down.
Equal epochs (two elections from the same knowledge, neither hearing of the
other) fall back on the roles: the primary wins. Dual passive is settled by role alone.

Time is an argument, never read here: every input carries ``now`` (seconds on a
monotonic clock). The peer is presumed alive until
``peer_expiry = last_peer_contact + missed * heartbeat``; before the first contact
the start time stands in for the last contact, so a freshly started server waits
one full expiry period before it accepts a vote. A vote that would make this
server active is accepted only when ``now >= peer_expiry``. Expiry on its own never
changes the state: only a vote turns a silent peer into a failover, because only
a client can tell us that it can no longer reach the other server.

Ranks settle a cold start. A server that keeps its data on disk survives a
restart with it, so the Guide's rule "the primary serves" could let an older
primary win over a backup that took writes after it, and roll back confirmed
writes. Each server therefore announces a *rank*, ``(term, sequence)``, saying
how new its data is (compared lexicographically; ``(0, 0)`` means no data or
unknown: an in-memory server or a Guide peer). The rows where neither side is
settled yet look at the ranks: the older data yields. On equal ranks two
starting servers fall back on the roles (the primary serves), while between a
passive server and a restarted peer the passive one serves: it holds the data
in memory, the restarted peer may have lost it, which is exactly the Guide's
behaviour when both announce ``(0, 0)``. Every pair of these rows is
complementary, so whatever the ranks and the order of the messages, exactly one
side goes active (:func:`yields_on_rank`).

A lost connection is earlier evidence of the same thing. When the peer's process
dies, its kernel closes its TCP connections at once, and the reactor reports that
as :meth:`BinaryStarFSM.peer_disconnected`: from then on the peer counts as expired
(``peer_expiry`` is the moment of the disconnect) until it is heard again. It only
brings forward what the heartbeat would conclude ``missed * heartbeat`` later; a
vote is still needed to fail over, so the rules and their safety are unchanged. A
frozen peer or a partition closes nothing, so there only the heartbeat tells.

A server that starts alone must not serve too early either: its peer may be
booting and hold newer data. ``start_wait`` stretches the first expiry, before
the peer has ever been heard, to ``start + max(missed * heartbeat, start_wait)``,
and a lost connection does not shorten it (a peer that is not up yet refuses or
drops connections, which says nothing about its data). After the first contact
it plays no part.

A server whose data was last written while it followed its peer (it stopped
as the passive one) is *behind*: the peer went on confirming writes after our
last one, for as long as it lived. Serving alone after the start wait would
hand clients that older state and, once the peer is back, its newer rank loses
to our later election: the writes it confirmed are lost. So ``behind_peer``
refuses every vote in the start states until the peer has been heard; then the
ranks decide as above. Such a server waits for its peer however long it takes.
A passive server that has not yet caught up with the active it follows (a
restarted one before its first sync completes) is behind in the same way: the
application says so with :meth:`BinaryStarFSM.set_behind_peer`, and the
passive's vote row refuses until it is cleared. Becoming active clears it.

The table, its rows' types and the tie-break rules are in :mod:`bstar.rules`
(re-exported here); this module holds the machine that applies them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from bstar.errors import IllegalTransitionError, RoleConflictError
from bstar.rules import (
    MAX_EPOCH,
    NO_RANK,
    TRANSITIONS,
    Conflict,
    Event,
    Rank,
    Rule,
    State,
    TieBreak,
    Vote,
    VotePolicy,
    check_epoch,
    check_rank,
    peer_event,
    yields_on_rank,
    yields_to_peer,
)

__all__ = [
    "MAX_EPOCH",
    "NO_RANK",
    "TRANSITIONS",
    "BinaryStarFSM",
    "Conflict",
    "Event",
    "FsmCounters",
    "Outcome",
    "Rank",
    "Rule",
    "State",
    "TieBreak",
    "Vote",
    "VotePolicy",
    "check_rank",
    "peer_event",
    "yields_on_rank",
    "yields_to_peer",
]

@dataclass(frozen=True, slots=True)
class Outcome:
    """What one input did: the decision for the application to act upon.

    ``vote`` is set only for client requests. ``conflict`` is set once per conflict
    episode (the first time the peer is seen in our own settled state), so an
    application alerting on it is not flooded by every heartbeat. ``epoch`` is our
    epoch after the input; ``peer_epoch`` the one the peer announced with this
    input (None for a client request). ``rank`` and ``peer_rank`` are the ranks
    compared (``peer_rank`` None for a client request); ``tie_break`` is set when
    the rule could send us to its yield state, and ``yielded`` says whether it did.
    """

    event: Event
    previous: State
    state: State
    why: str
    vote: Vote | None = None
    conflict: Conflict | None = None
    epoch: int = 0
    peer_epoch: int | None = None
    rank: Rank = NO_RANK
    peer_rank: Rank | None = None
    tie_break: TieBreak | None = None
    yielded: bool = False

    @property
    def changed(self) -> bool:
        """True when this input moved the machine to another state."""
        return self.state is not self.previous

    @property
    def accepted(self) -> bool:
        """True for a client request that may be served."""
        return self.vote is Vote.ACCEPTED

    @property
    def became_active(self) -> bool:
        """True when this input made the server start serving."""
        return self.changed and self.state is State.ACTIVE

    @property
    def became_passive(self) -> bool:
        """True when this input made the server stand by (it may need to resync)."""
        return self.changed and self.state is State.PASSIVE

    @property
    def split_brain_detected(self) -> bool:
        """True on the first sight of a peer that is active while we are too."""
        return self.conflict is Conflict.SPLIT_BRAIN


@dataclass(frozen=True, slots=True)
class FsmCounters:
    """A snapshot of what the machine has seen, for metrics and tests."""

    transitions: int = 0
    votes_accepted: int = 0
    votes_refused: int = 0
    split_brain_count: int = 0
    dual_passive_count: int = 0
    peer_expirations: int = 0
    illegal_events: int = 0


class BinaryStarFSM:
    """One server's side of a Binary Star pair.

    Not thread-safe; meant to be owned by one reactor. ``primary`` is the
    configured role, which never changes: it picks the start state and breaks ties.

    ``epoch`` is the epoch to start from: a server that keeps its data on disk
    passes the last one it saved, so that its next election outbids it.
    ``start_wait`` is how long, at least, a server that has never heard its peer
    waits before it may accept a vote (see the module docstring). ``rank`` is how
    new our data is; the application keeps it current with :meth:`set_rank`.
    ``behind_peer`` says that our data was last written while we followed the
    peer: no vote makes us active before we have heard it (module docstring).
    """

    def __init__(
        self,
        primary: bool,
        now: float,
        *,
        heartbeat: float = 1.0,
        missed: int = 2,
        epoch: int = 0,
        start_wait: float = 0.0,
        rank: Rank = NO_RANK,
        behind_peer: bool = False,
    ) -> None:
        if not isinstance(primary, bool):
            raise TypeError(f"primary must be a bool, got {type(primary).__name__}")
        if not heartbeat > 0:
            raise ValueError(f"heartbeat must be a positive number of seconds, got {heartbeat!r}")
        if isinstance(missed, bool) or not isinstance(missed, int) or missed < 1:
            raise ValueError(f"missed must be an integer >= 1, got {missed!r}")
        check_epoch(epoch)
        if isinstance(start_wait, bool) or not isinstance(start_wait, (int, float)):
            raise TypeError(f"start_wait must be a number, got {type(start_wait).__name__}")
        if not (start_wait >= 0 and math.isfinite(start_wait)):
            raise ValueError(f"start_wait must be a finite number >= 0, got {start_wait!r}")
        if not isinstance(behind_peer, bool):
            raise TypeError(f"behind_peer must be a bool, got {type(behind_peer).__name__}")
        self._behind_peer = behind_peer
        self._rank = check_rank(rank)
        self._peer_rank = NO_RANK
        self._start_wait = float(start_wait)
        self._primary = primary
        self._heartbeat = float(heartbeat)
        self._missed = missed
        self._started_at = now
        self._state = State.PRIMARY if primary else State.BACKUP
        self._peer_state: State | None = None
        self._last_peer_contact: float | None = None
        # When the connection to the peer was lost, if it has not been heard since.
        self._peer_lost_at: float | None = None
        self._epoch = epoch
        self._peer_epoch = 0
        # The epoch in the peer's last state message (0 after a restart).
        self._peer_announced_epoch = 0
        # Whether the peer's expiry has been reported yet, so it is reported once.
        self._expiry_reported = False
        # The conflict already reported and still going on, so it is reported once.
        self._ongoing_conflict: Conflict | None = None
        self._transitions = 0
        self._votes_accepted = 0
        self._votes_refused = 0
        self._split_brains = 0
        self._dual_passives = 0
        self._expirations = 0
        self._illegal = 0

    # -- read-only views -------------------------------------------------------

    @property
    def primary(self) -> bool:
        """The configured role: True for the primary, False for the backup."""
        return self._primary

    @property
    def state(self) -> State:
        return self._state

    @property
    def heartbeat(self) -> float:
        return self._heartbeat

    @property
    def missed(self) -> int:
        return self._missed

    @property
    def peer_state(self) -> State | None:
        """The peer's last reported state, or None if it has never been heard."""
        return self._peer_state

    @property
    def epoch(self) -> int:
        """Our election epoch: 0 until we first become active, then bumped each time."""
        return self._epoch

    @property
    def peer_epoch(self) -> int:
        """The highest epoch the peer has announced (0 if never, or a Guide peer).

        It is the highest, not the latest: a restarted peer announces 0 again, but
        our next election must still outbid every epoch we have heard of.
        """
        return self._peer_epoch

    @property
    def peer_announced_epoch(self) -> int:
        """The epoch in the peer's last state message: 0 from a peer never
        active since it started, its election's epoch from one that was (a
        passive peer announcing one lost a split brain and stepped down)."""
        return self._peer_announced_epoch

    @property
    def rank(self) -> Rank:
        """How new our data is, as last set (``(0, 0)``: no data, or not said)."""
        return self._rank

    def set_rank(self, rank: Rank) -> None:
        """Our data changed: ``rank`` is how new it is now. Changes no state by itself."""
        self._rank = check_rank(rank)

    @property
    def peer_rank(self) -> Rank:
        """The rank carried by the peer's last message (``(0, 0)`` if none, or a
        peer that does not announce one)."""
        return self._peer_rank

    @property
    def start_wait(self) -> float:
        """The least time a server that has never heard its peer waits before serving."""
        return self._start_wait

    @property
    def behind_peer(self) -> bool:
        """Whether our data was last written while we followed the peer."""
        return self._behind_peer

    def set_behind_peer(self, behind: bool) -> None:
        """Whether our data may be older than what the peer confirmed: set by a
        passive until it has caught up with the active it follows."""
        if not isinstance(behind, bool):
            raise TypeError(f"behind must be a bool, got {type(behind).__name__}")
        self._behind_peer = behind

    @property
    def waits_for_peer(self) -> bool:
        """Whether a vote would be refused because we are behind the peer: in
        the start states until it has been heard, in PASSIVE until the
        application says we have caught up (:meth:`set_behind_peer`)."""
        if not self._behind_peer:
            return False
        return self._state is State.PASSIVE or not self.heard_peer

    @property
    def heard_peer(self) -> bool:
        """Whether the peer has ever been heard."""
        return self._last_peer_contact is not None

    @property
    def last_peer_contact(self) -> float | None:
        """When the peer was last heard, or None if never."""
        return self._last_peer_contact

    @property
    def peer_lost_at(self) -> float | None:
        """When the connection to the peer was lost, or None if it has not been
        lost since the peer was last heard (or since it was back)."""
        return self._peer_lost_at

    @property
    def peer_expiry(self) -> float:
        """The moment from which the peer counts as dead, unless heard again.

        Normally ``missed`` heartbeats after the last contact; after a lost
        connection, the moment it was lost, if that is earlier. Before the first
        contact, never earlier than ``start_wait`` after the start, lost
        connection or not.
        """
        base = self._started_at if self._last_peer_contact is None else self._last_peer_contact
        expiry = base + self._missed * self._heartbeat
        if self._peer_lost_at is not None:
            expiry = min(expiry, self._peer_lost_at)
        if self._last_peer_contact is None:
            expiry = max(expiry, self._started_at + self._start_wait)
        return expiry

    def peer_alive(self, now: float) -> bool:
        """Whether the peer still counts as alive at ``now`` (``now < peer_expiry``)."""
        return now < self.peer_expiry

    @property
    def counters(self) -> FsmCounters:
        return FsmCounters(
            transitions=self._transitions,
            votes_accepted=self._votes_accepted,
            votes_refused=self._votes_refused,
            split_brain_count=self._split_brains,
            dual_passive_count=self._dual_passives,
            peer_expirations=self._expirations,
            illegal_events=self._illegal,
        )

    # -- inputs ----------------------------------------------------------------

    def receive_peer_state(
        self, peer: State, now: float, epoch: int = 0, rank: Rank = NO_RANK
    ) -> Outcome:
        """The peer reported ``peer`` with its ``epoch`` and ``rank`` at ``now``
        (0 and ``(0, 0)`` from a Guide peer)."""
        return self.handle(peer_event(peer), now, epoch, rank)

    def client_request(self, now: float) -> Outcome:
        """A client asked us to serve it; ``outcome.accepted`` says whether we may."""
        return self.handle(Event.CLIENT_REQUEST, now)

    def peer_disconnected(self, now: float) -> bool:
        """The connection to the peer was lost at ``now``: count the peer as expired.

        This is what a peer process that died looks like: its kernel closes its
        connections at once, long before ``missed`` heartbeats have gone by. The
        peer counts as dead from ``now`` until it is heard again (or the
        connection is back, see :meth:`peer_connected`); the state does not change,
        a vote is still needed to fail over (and before the peer was ever heard,
        not before ``start_wait``). Returns True if this made a live peer count
        as dead. A disconnect older than the last message heard is stale
        news and is ignored.
        """
        contact = self._last_peer_contact
        if contact is not None and now < contact:
            return False
        was_alive = self.peer_alive(now)
        if self._peer_lost_at is None or now < self._peer_lost_at:
            self._peer_lost_at = now
        # Before the first contact the start wait still holds the peer alive.
        return was_alive and not self.peer_alive(now)

    def peer_connected(self, now: float) -> None:
        """A connection to the peer endpoint was (re)established at ``now``.

        Someone is listening there again, so a loss recorded earlier no longer
        stands: expiry goes back to counting heartbeats from the last contact.
        This is not contact (nothing has been heard), so it never makes a silent
        peer alive by itself; it only undoes the shortcut of a disconnect.
        """
        if self._peer_lost_at is None:
            return
        self._peer_lost_at = None
        if self.peer_alive(now):
            self._expiry_reported = False  # alive again: report the next expiry

    def check_expiry(self, now: float) -> bool:
        """Return True exactly once each time the peer goes silent past its expiry.

        This only notes the fact (and counts it): the state does not change, since
        in Binary Star only a client vote can turn silence into a failover.
        """
        if self._expiry_reported or self.peer_alive(now):
            return False
        self._expiry_reported = True
        self._expirations += 1
        return True

    def handle(self, event: Event, now: float, epoch: int = 0, rank: Rank = NO_RANK) -> Outcome:
        """Apply one event. Raises IllegalTransitionError and changes nothing if illegal.

        ``epoch`` and ``rank`` are the ones the peer announced with a ``PEER_*``
        event; they are ignored for a client request.
        """
        if event is Event.CLIENT_REQUEST:
            return self._apply(event, self._rule(event), now, None, None)
        check_epoch(epoch)
        rank = check_rank(rank, "peer rank")
        reported = State(event.value)
        if not self.peer_alive(now):
            # A peer back from silence starts a new story, conflicts included.
            self._ongoing_conflict = None
        # Any state message proves the peer is alive, even one we then reject:
        # treating a live but misconfigured peer as dead could let us grab votes.
        self._peer_state = reported
        self._peer_epoch = max(self._peer_epoch, epoch)
        self._peer_announced_epoch = epoch
        self._peer_rank = rank
        self._last_peer_contact = now
        self._peer_lost_at = None  # heard again: back to heartbeat expiry
        self._expiry_reported = False
        if reported is (State.PRIMARY if self._primary else State.BACKUP):
            self._illegal += 1
            role = "primary" if self._primary else "backup"
            raise RoleConflictError(self._state, event, f"both servers are configured as {role}")
        return self._apply(event, self._rule(event), now, epoch, rank)

    # -- internals -------------------------------------------------------------

    def _rule(self, event: Event) -> Rule:
        try:
            return TRANSITIONS[(self._state, event)]
        except KeyError:
            self._illegal += 1
            raise IllegalTransitionError(
                self._state, event, "no rule in the Binary Star table"
            ) from None

    def _apply(
        self,
        event: Event,
        rule: Rule,
        now: float,
        peer_epoch: int | None,
        peer_rank: Rank | None,
    ) -> Outcome:
        previous = self._state
        # Compare with the epoch of this very message, not the highest ever seen: a
        # peer that restarted and was elected while cut off from us really is at a
        # lower epoch, and both sides must reach the same verdict.
        yielded = rule.yields(
            self._primary,
            self._epoch,
            0 if peer_epoch is None else peer_epoch,
            self._rank,
            NO_RANK if peer_rank is None else peer_rank,
        )
        target = rule.yield_state if yielded and rule.yield_state is not None else rule.next_state
        vote: Vote | None = None
        if rule.vote is not None:
            if rule.vote is VotePolicy.ACCEPT:
                vote = Vote.ACCEPTED
            elif rule.vote is VotePolicy.REFUSE:
                vote = Vote.REFUSED
            elif rule.vote is VotePolicy.ACCEPT_IF_WAITED_ALONE:
                waited = self._start_wait > 0 and not self.heard_peer and not self.peer_alive(now)
                vote = Vote.ACCEPTED if waited else Vote.REFUSED
            else:
                vote = Vote.REFUSED if self.peer_alive(now) else Vote.ACCEPTED
            if rule.refused_behind and self.waits_for_peer:
                vote = Vote.REFUSED
            if vote is Vote.ACCEPTED:
                self._votes_accepted += 1
            else:
                self._votes_refused += 1
                target = previous
        # Report a conflict when it starts, not on every heartbeat while it lasts.
        conflict = rule.conflict if rule.conflict is not self._ongoing_conflict else None
        if conflict is Conflict.SPLIT_BRAIN:
            self._split_brains += 1
        elif conflict is Conflict.DUAL_PASSIVE:
            self._dual_passives += 1
        if target is not previous:
            self._transitions += 1
            self._state = target
            self._ongoing_conflict = None  # whatever it was, we moved out of it
            if target is State.ACTIVE:
                self._behind_peer = False  # we write now: the newest data is ours
                # A new election: outbid every epoch known on either side, so that
                # a stale active (say, a primary thawing from a freeze) loses to us.
                # Saturates at MAX_EPOCH, which only a peer claiming it could
                # bring within reach: equal epochs then fall to the role tie-break.
                self._epoch = min(MAX_EPOCH, max(self._epoch, self._peer_epoch) + 1)
        elif event is not Event.CLIENT_REQUEST:
            self._ongoing_conflict = rule.conflict
        return Outcome(
            event=event,
            previous=previous,
            state=target,
            why=rule.why,
            vote=vote,
            conflict=conflict,
            epoch=self._epoch,
            peer_epoch=peer_epoch,
            rank=self._rank,
            peer_rank=peer_rank,
            tie_break=rule.tie_break if rule.yield_state is not None else None,
            yielded=yielded,
        )
