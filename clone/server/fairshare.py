"""Snapshot slots and pump turns shared fairly between requesting hosts (pure).

Why: 200 snapshot requesters from one host that never read took all 64
slots the moment they asked, and while the kernel's buffers took their first
megabytes (about 1.8 MB a connection on loopback) they looked like readers:
no slot came free for 1.4 s, and the pump then gave a healthy client's
stream one turn in 65.  A healthy client on another host synced in 1.7 to
2.5 s instead of 0.1 to 0.4.  A connection, a routing id or a requester id
costs a flooder nothing to multiply; the host it connects from does.  So a
host is the unit of fairness (the Guide's Clone serves a fleet of nodes, and
one misbehaving node must cost the others nothing):

* **Slots** (:func:`crowded_host`): a request that finds every slot taken,
  from a host holding at least two fewer than the host holding the most,
  takes one of that host's (its stalest stream gives its slot up at once,
  reading or not).  Hosts end up with equal shares; a host alone, or every
  requester on one host (a test, a fleet behind one address), is served as
  before.
* **Idle slots** (:func:`sheltered`): the stream of a requester that has
  read nothing for a while gives its slot to a new request, but not to one
  from a host holding more slots than its own: a flooder's request does not
  take a slot from a reader on another host that paused (a client starved
  of CPU for a quarter second on a busy machine would lose its stream, and
  sync again only after its silence timeout).
* **Turns** (:class:`HostRoundRobin`): the pump's queue takes one stream of
  each host in turn, so a host's streams together get one turn per round,
  however many it has.
* **Time** (:class:`SliceShares`): of the loop's slice for snapshots (for the
  queue's turns, and for the first messages of new streams), each host
  holding a slot may spend an equal share.  Turns alone were not enough: a
  reader's stream sends its window and waits for its requester, so it leaves
  the queue within a turn, and the flooder's streams took the rest of every
  slice (most of the loop's time while a healthy client's stream ran); the
  loop's turns came round that much more slowly, and the reader got one
  window per turn.  With shares the flooder's streams spend half the slice
  at most (two hosts), the turn ends sooner and the reader's next window
  comes sooner.  And a host holding more than an equal share of the slots
  in use (:func:`over_share`) sends no first messages at once for its new
  streams: they wait for their host's turns, instead of spending a share of
  a second slice (the one for new streams) in every turn that admits one.
* **Readers first** (:func:`host_weights`): with equal shares a healthy
  client still synced in about twice its time alone (1.8 to 2.4 times in
  runs against 200 requesters that never read).  Its stream waits for its
  requester after every window or two (ten to twenty times in a 20 MB
  sync), and each time its next turn came only after the flood's streams
  had spent their half of a slice.  So a host one of whose requesters has
  shown it reads (it has read more than the kernel's buffers could take for
  a requester that reads nothing: :data:`~clone.server.snapwindow.GROW_AFTER`)
  weighs :data:`READER_WEIGHT` times one whose requesters have not: against
  a flood its streams get four fifths of each slice, and the flood's turn a
  reader waits behind lasts a fifth.  A host that has not shown it yet
  still gets an equal share, so a healthy client's first windows get at
  least half; a flooder that also reads is weighed as a reader, where it
  stood before.
* **Paced, not only shared** (:class:`SliceWindows`): a share of each loop
  turn bounds a host's time per turn, not per second, and turns come back
  at once: while the reader waited for its client the flood's streams ran
  turn after turn, keeping the loop (and on a small machine the client's
  CPU) busy.  So while a reader's host holds a slot, a slice lasts its
  length in wall time, and a host that has not shown it reads and has
  spent its share waits for the next slice; a reader's host that spent its
  share opens the next one at once (readers use whatever time the loop
  has).  Without a reader among the hosts, slices are per turn as before.

A request whose host is not known (held through a heal, deferred by a vote:
rare) neither takes a slot from a host nor gives one up for a host; for
turns and time its streams count as one more host, ``None``.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterator, Mapping, Sequence
from typing import Generic, TypeVar

__all__ = [
    "READER_WEIGHT",
    "HostRoundRobin",
    "SliceShares",
    "SliceWindows",
    "crowded_host",
    "host_weights",
    "over_share",
    "paced",
    "sheltered",
    "yielder",
]

S = TypeVar("S", bound=Hashable)

#: A slice's weight of a host that has shown it reads, against one's that has not.
READER_WEIGHT = 4


def crowded_host(slots: Mapping[str | None, int], asker: str | None) -> str | None:
    """The host that must give a slot to ``asker``'s request (``slots``: host
    -> streams it holds), or None: ``asker`` already has its fair share.

    The host holding the most, if it holds at least two more than ``asker``
    (with one more, taking one would only move the imbalance).  Of hosts
    holding equally many, the first in ``slots``.  Never for an unknown
    host's request, nor from an unknown host's streams."""
    if asker is None:
        return None
    mine = slots.get(asker, 0)
    most: str | None = None
    most_held = mine + 1
    for host, held in slots.items():
        if host is not None and host != asker and held > most_held:
            most, most_held = host, held
    return most


def yielder(hosts: Mapping[S, str | None], progress: Mapping[S, float],
            asker: str | None) -> S | None:  # fmt: skip
    """The stream whose slot goes to a request from ``asker``, or None
    (``hosts``: each stream holding a slot -> its host; ``progress``: stream
    -> the time of its requester's last progress): the stalest stream of the
    :func:`crowded_host`, if there is one."""
    slots: dict[str | None, int] = {}
    for host in hosts.values():
        slots[host] = slots.get(host, 0) + 1
    crowded = crowded_host(slots, asker)
    if crowded is None:
        return None
    theirs = [stream for stream, host in hosts.items() if host == crowded]
    return min(theirs, key=progress.__getitem__)


def sheltered(hosts: Mapping[S, str | None], asker: str | None) -> set[S]:
    """The streams whose slots a request from ``asker`` may not take even if
    idle (``hosts``: each stream holding a slot -> its host): those of hosts
    holding fewer slots than ``asker``'s.  None for an unknown host's request."""
    if asker is None:
        return set()
    slots: dict[str | None, int] = {}
    for host in hosts.values():
        slots[host] = slots.get(host, 0) + 1
    mine = slots.get(asker, 0)
    return {stream for stream, host in hosts.items() if slots[host] < mine}


def over_share(hosts: Sequence[str | None], host: str | None) -> bool:
    """Whether ``host`` holds more than an equal share of the slots in use
    (``hosts``: the host of each stream holding one).  Never for the only
    host."""
    return hosts.count(host) * len(set(hosts)) > len(hosts)


def host_weights(hosts: Mapping[S, str | None], readers: Collection[S]) -> dict[str | None, int]:
    """Each host holding a slot -> its weight in a slice (``hosts``: each
    stream holding a slot -> its host; ``readers``: the streams whose
    requesters have shown they read): :data:`READER_WEIGHT` for a host with a
    stream in ``readers``, else 1."""
    weights: dict[str | None, int] = {}
    for stream, host in hosts.items():
        if stream in readers:
            weights[host] = READER_WEIGHT
        else:
            weights.setdefault(host, 1)
    return weights


class HostRoundRobin(Generic[S]):
    """The pump's queue: streams waiting for a turn, one host after another.

    Within a host, first in first out; across hosts, round robin: the host
    whose stream was just taken goes to the back of the round.  Adding a
    stream already queued keeps its place.
    """

    __slots__ = ("_by_host", "_host_of")

    def __init__(self) -> None:
        # host -> its queued streams, in order; the hosts in round order.
        self._by_host: dict[str | None, dict[S, None]] = {}
        self._host_of: dict[S, str | None] = {}

    def __len__(self) -> int:
        return len(self._host_of)

    def __contains__(self, stream: object) -> bool:
        return stream in self._host_of

    def __iter__(self) -> Iterator[S]:
        return iter(list(self._host_of))

    def hosts(self) -> list[str | None]:
        """The hosts with queued streams, in round order."""
        return list(self._by_host)

    def add(self, stream: S, host: str | None) -> None:
        """Queue ``stream`` of ``host`` (no-op if queued)."""
        if stream in self._host_of:
            return
        self._host_of[stream] = host
        self._by_host.setdefault(host, {})[stream] = None

    def discard(self, stream: S) -> None:
        """Take ``stream`` out of the queue, if it is there."""
        if stream not in self._host_of:
            return
        host = self._host_of.pop(stream)
        queued = self._by_host[host]
        del queued[stream]
        if not queued:
            del self._by_host[host]

    def pop(self) -> S | None:
        """The next stream to pump (None: the queue is empty)."""
        if not self._by_host:
            return None
        host = next(iter(self._by_host))
        queued = self._by_host.pop(host)
        stream = next(iter(queued))
        del queued[stream]
        del self._host_of[stream]
        if queued:
            self._by_host[host] = queued  # to the back of the round
        return stream

    def clear(self) -> None:
        self._by_host.clear()
        self._host_of.clear()


class SliceShares:
    """One slice of loop time (from ``now``, ``length`` seconds) split
    between the hosts holding slots in proportion to their ``weights`` (host
    -> weight: :func:`host_weights`): what each host's streams may still
    spend of it.  A host not in ``weights`` weighs 1.  The caller says what
    they spent (:meth:`spend`)."""

    __slots__ = ("_length", "_spent", "_total", "_weights", "end")

    def __init__(self, now: float, length: float, weights: Mapping[str | None, float]) -> None:
        self.end = now + length
        self._length = length
        self._weights = dict(weights)
        self._total = sum(self._weights.values())
        self._spent: dict[str | None, float] = {}

    def share(self, host: str | None) -> float:
        """The seconds of the slice ``host``'s streams may spend in all."""
        weight = self._weights.get(host, 1)
        return self._length * weight / max(self._total, weight)

    def stop_for(self, host: str | None, now: float) -> float | None:
        """When a stream of ``host`` pumped from ``now`` must stop, or None:
        the host's share, or the slice, is spent."""
        left = self.share(host) - self._spent.get(host, 0.0)
        if left <= 0 or now >= self.end:
            return None
        return min(self.end, now + left)

    def spend(self, host: str | None, seconds: float) -> None:
        """``host``'s streams spent ``seconds`` of the slice."""
        self._spent[host] = self._spent.get(host, 0.0) + seconds


def paced(weights: Mapping[str | None, float]) -> bool:
    """Whether hosts that have not shown they read are paced: a reader's
    host and one of theirs both hold slots."""
    values = set(weights.values())
    return READER_WEIGHT in values and 1 in values


class SliceWindows:
    """The loop's snapshot slices, each ``length`` seconds of wall time while
    some hosts are paced (:func:`paced`); else one slice per pump turn.

    A pump turn asks :meth:`open` for the slice it draws from, and when it
    ends with streams still queued, :meth:`wait` for how long before the next
    turn can send anything for them.
    """

    __slots__ = ("_current", "_weights", "length")

    def __init__(self, length: float) -> None:
        self.length = length
        self._current: SliceShares | None = None
        self._weights: dict[str | None, float] = {}

    def open(self, now: float, weights: Mapping[str | None, float],
             waiting: Collection[str | None]) -> SliceShares:  # fmt: skip
        """The slice a pump turn at ``now`` draws from (``weights``:
        :func:`host_weights`; ``waiting``: the hosts with queued streams).
        The current one while it lasts, the hosts are paced and their
        weights unchanged, and no reader's host among ``waiting`` has spent
        its share; else a new one."""
        current = self._current
        if (
            current is None
            or now >= current.end
            or not paced(weights)
            or weights != self._weights
            or any(weights.get(host, 1) >= READER_WEIGHT and current.stop_for(host, now) is None
                   for host in waiting)
        ):  # fmt: skip
            current = self._current = SliceShares(now, self.length, weights)
            self._weights = dict(weights)
        return current

    def wait(self, now: float, waiting: Collection[str | None]) -> float:
        """Seconds before a turn can send for ``waiting`` (hosts with queued
        streams): 0, unless every one of them is a paced host that has spent
        its share of the current slice: then until the slice ends."""
        current = self._current
        if current is None or not waiting or not paced(self._weights):
            return 0.0
        for host in waiting:
            reader = self._weights.get(host, 1) >= READER_WEIGHT
            if reader or current.stop_for(host, now) is not None:
                return 0.0
        return max(0.0, current.end - now)
