"""A snapshot shows only what is on disk: its end waits for the commit.

Why: the active publishes an update (KVPUB) only once it is committed
(docs/operations.md, "When a write is confirmed"), but a snapshot is read
from the live map, which also holds the updates of the commit in flight and
of the group gathering behind it.  A snapshot request waits for the commit of
what was applied before it; what is applied while it waits (the gathered
group) and while it streams is in the map too.  A requester that took such an
update and then lost the server with it saw the pair go back: a chaos run
(seed 1, kill-both) had a watcher resync from the freshly promoted backup and
get a counter at sequence 188 that the backup had applied, not committed; the
backup was killed 0.1 s later, came back at 187, and gave 188 to another
write; the watcher saw the counter go back from 188 to 175.  docs/drills.md
("both-crash") promises the pair never serves a sequence below one a client
applied, and the chaos run's ``reverts`` check that no key goes back outside
a split brain.

How this works: a requester applies a full snapshot (private or shared) at
its KTHXBAI, and a catch-up's updates as they come.  So the pump asks
:meth:`DiskGate.holds` before each message: a full snapshot's KTHXBAI waits
until the committed sequence reaches the store's sequence when the KTHXBAI
was first due (every entry the stream sent was looked up at or below it);
a catch-up's messages wait until it reaches the catch-up's own sequence (the
history when it opened).  A held stream is woken when everything applied so
far is committed (``when_published``): one or two commits later, whatever
keeps arriving meanwhile.  Its target is kept until it passes, so newer
updates never hold it again.  A server without a data directory commits
nothing and is never held (its committed sequence is the store's).
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

from clone.server.core import ServerCore
from clone.server.delta import DeltaStream
from clone.server.durability import Durability
from clone.wire.protocol import KTHXBAI

__all__ = ["DiskGate", "committed_through"]


def committed_through(durability: Durability, core: ServerCore) -> int:
    """The sequence up to which every update the map holds is committed: the
    one before the first update of the commit in flight, else of the group
    gathered for the next commit, else the store's."""
    if durability.in_flight:
        return durability.announced_sequence()
    first = core.journal.first_sequence()
    return core.store.sequence if first is None else first - 1


class DiskGate:
    """Holds each stream's next message until what it makes the requester
    apply is committed (a part of the snapshot streams).

    ``committed`` is :func:`committed_through`, ``store_sequence`` the
    store's, ``when_published`` the durability's (run a callback once
    everything applied so far is committed), ``wake`` the pump's (give a
    stream its turn again) and ``alive`` whether a stream is still served.
    """

    def __init__(
        self,
        *,
        committed: Callable[[], int],
        store_sequence: Callable[[], int],
        when_published: Callable[[Callable[[], None]], None],
        wake: Callable[[Any], None],
        alive: Callable[[Any], bool],
        counters: MutableMapping[str, int],
    ) -> None:
        self._committed = committed
        self._store_sequence = store_sequence
        self._when_published = when_published
        self._wake = wake
        self._alive = alive
        self.counters = counters
        #: Held streams -> the committed sequence each waits for.
        self._targets: dict[Any, int] = {}
        self._waiting: set[Any] = set()  # held streams with a wake-up registered

    def __len__(self) -> int:
        """Streams held now."""
        return len(self._targets)

    def holds(self, stream: Any, frames: Sequence[Any]) -> bool:
        """Whether ``frames`` (``stream``'s next message, routing id first)
        must wait; if so the stream is woken once the commit has landed."""
        target = self._targets.get(stream)
        if target is None:
            target = self._target(stream, frames)
            if target is None:
                return False
        if self._committed() >= target:
            self._targets.pop(stream, None)
            return False
        if stream not in self._targets:
            self._targets[stream] = target
            self.counters["snapshot_ends_held"] = self.counters.get("snapshot_ends_held", 0) + 1
        if stream not in self._waiting:
            self._waiting.add(stream)
            self._when_published(lambda: self._resume(stream))
        return True

    def _target(self, stream: Any, frames: Sequence[Any]) -> int | None:
        if isinstance(stream, DeltaStream):
            return int(stream.sequence)
        if len(frames) > 1 and _is_kthxbai(frames[1]):
            return self._store_sequence()
        return None

    def _resume(self, stream: Any) -> None:
        """The commit it waited for landed: its turn again, or forgotten if
        it was aborted meanwhile."""
        self._waiting.discard(stream)
        if not self._alive(stream):
            self._targets.pop(stream, None)
            return
        self._wake(stream)  # the pump asks again, and holds it again if still short


def _is_kthxbai(frame: Any) -> bool:
    """Whether a message's first frame (after the routing id) is KTHXBAI.
    Frames of a shared snapshot may be ``zmq.Frame``; only short ones are read."""
    return len(frame) == len(KTHXBAI) and bytes(frame) == KTHXBAI
