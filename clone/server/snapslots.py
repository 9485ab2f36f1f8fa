"""Who gets a snapshot slot when every one is taken (a part of :mod:`.streaming`).

Why a module of its own: the streams' slots are a duty apart from pumping
them.  :class:`SnapshotSlots` is the base of
:class:`~clone.server.streaming.SnapshotStreams` and works on its state: when
every slot (``--max-snapshots``) is taken, a stream whose requester is
unroutable gives its slot up at once; else one whose requester has read
nothing for ``--snapshot-slot-idle`` (0.25 s: our client's re-ask interval, a
quarter heartbeat at the default 250 ms), but not one of a host holding fewer
slots than the asker's; else a host holding at least two more slots than the
asker's gives its stalest stream's up, reading or not (:mod:`.fairshare`);
else the request waits, bounded in number and age, and is served as slots
free.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore
from clone.server.fairshare import HostRoundRobin, sheltered, yielder
from clone.server.opening import AnyStream
from clone.server.requesters import Requester
from clone.server.snapwindow import SendWindow, stalest

__all__ = ["WAITING_MAX", "WAITING_MAX_AGE", "SnapshotSlots"]

# Requests that wait for a slot at most, and for how long: a client re-asks on
# a fresh socket every quarter heartbeat, so an older request has no reader.
WAITING_MAX = 1000
WAITING_MAX_AGE = 2.0


class SnapshotSlots:
    """The slot rules of :class:`~clone.server.streaming.SnapshotStreams`,
    which sets every attribute named here and defines ``serve`` and ``abort``."""

    config: ServerConfig
    core: ServerCore
    counters: dict[str, int]
    _throttle: Throttle
    _clock: Callable[[], float]
    _snapshots: dict[AnyStream, float]  # stream -> last progress
    _in_flight: dict[AnyStream, SendWindow]
    _requesters: dict[AnyStream, Requester]
    _peer_syncs: set[AnyStream]
    _pump_queue: HostRoundRobin[AnyStream]
    _waiting: dict[bytes, tuple[float, dict[str, Any]]]
    _unreachable: dict[AnyStream, float]

    if TYPE_CHECKING:
        @property
        def _stopping(self) -> bool: ...

        serve: Callable[..., None]

        def abort(self, stream: AnyStream, why: str, *, gone: bool = False) -> None: ...

    def _wait_for_slot(self, identity: bytes, **how: Any) -> None:
        """Hold a request that found every slot taken by a reader, bounded in
        number and age (:data:`WAITING_MAX`, :data:`WAITING_MAX_AGE`)."""
        waiting = self._waiting
        waiting.pop(identity, None)  # asked again: keep the newest, last
        if len(waiting) >= WAITING_MAX:
            oldest = next(iter(waiting))
            del waiting[oldest]
            self.counters["snapshots_refused"] += 1
        waiting[identity] = (self._clock(), how)
        self.counters["snapshots_queued"] += 1
        self._throttle.log("snapshots_full", logging.INFO,
                           "%d snapshots in flight: requests wait for a slot (%d waiting)",
                           len(self._snapshots), len(waiting))  # fmt: skip

    def _admit_waiting(self) -> None:
        """Serve waiting requests while slots are free or a requester that
        reads nothing gives one up; drop those too old (their requester has
        asked again on a fresh socket by then)."""
        waiting = self._waiting
        if not waiting:
            return
        if self.core.role in (Role.STARTING, Role.PASSIVE) or self._stopping:
            # Their vote was won by the active server we no longer are.
            self.counters["snapshots_refused"] += len(waiting)
            waiting.clear()
            return
        cutoff = self._clock() - WAITING_MAX_AGE
        while waiting:
            # Newest first: an older request's client has likely asked again
            # on a fresh socket, and a burst of requesters that read nothing
            # must not stand between a reader and the next slot.
            identity = next(reversed(waiting))
            at, how = waiting[identity]
            full = len(self._snapshots) >= self.config.max_snapshots
            if full and not self._evict_stalest(how.get("host")):
                break
            del waiting[identity]
            if at < cutoff:
                self.counters["snapshots_refused"] += 1
                continue
            self.serve(identity, **how)
        for identity in [i for i, (at, _) in waiting.items() if at < cutoff]:
            del waiting[identity]
            self.counters["snapshots_refused"] += 1

    def _evict_unroutable(self) -> None:
        """A request needs a slot: streams whose requester is unroutable now
        give theirs up at once, as gone, instead of after the grace.

        The grace protects a live reader libzmq briefly calls unroutable; a
        client that asks again on a fresh socket leaves its old stream
        unroutable for good, and holding its slot for the grace turned away
        other requests (the relay resync bench: a third more retries).
        """
        for stream in list(self._unreachable):
            self.abort(stream, "requester went away", gone=True)

    def _evict_stalest(self, host: str | None) -> bool:
        """A request needs a slot and none is free: the stream whose requester
        has read nothing for longest gives up its own, if for at least
        ``snapshot_slot_idle`` (a requester that reads nothing must not keep
        one that reads from being served).  True if one was freed.

        A stream waiting for its turn in the pump (``_pump_queue``) waits for
        us, not for its requester: in a storm of requests on a busy machine
        new streams waited that long before their first send, and were
        evicted, their requesters never answered.  Nor a stream of a host
        holding fewer slots than ``host``, the asker's (:mod:`.fairshare`)."""
        for stream, window in self._in_flight.items():
            self._note_progress(stream, window)
        now = self._clock()
        hosts = {stream: asker.host for stream, asker in self._requesters.items()}
        busy = [*self._peer_syncs, *self._pump_queue, *sheltered(hosts, host)]
        victim = stalest(self._snapshots, now, self.config.snapshot_slot_idle,
                         exclude=busy)
        if victim is None:
            return False
        idle = now - self._snapshots[victim]
        self.counters["snapshots_evicted"] += 1
        self.abort(victim, f"its slot went to a new request ({idle:.1f} s unread)")
        return True

    def _evict_for_host(self, host: str | None) -> None:
        """A request from ``host`` needs a slot, none is free: a host holding two
        more gives up its stalest stream's, reading or not (:mod:`.fairshare`)."""
        hosts = {stream: asker.host for stream, asker in self._requesters.items()
                 if stream in self._snapshots and stream not in self._peer_syncs}  # fmt: skip
        victim = yielder(hosts, self._snapshots, host)
        if victim is not None:
            self.counters["snapshots_yielded"] += 1
            self.abort(victim, f"its slot went to a request from {host}, a host with fewer")

    def _note_progress(self, stream: AnyStream, window: SendWindow) -> float:
        """Whether the requester read since we last looked (its checkpoints);
        the time of its last progress."""
        if window.update() and stream in self._snapshots:
            self._snapshots[stream] = self._clock()
        return self._snapshots.get(stream, self._clock())
