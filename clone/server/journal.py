"""What the core changed since the last commit, in order, for the database.

How this works: the core (:mod:`.core`) is sans-IO, so it does not write to
disk itself.  Every change it makes to its state is recorded here, in order,
and the reactor takes the record once per loop turn, writes it to the data
directory in one transaction (group commit, :mod:`clone.storage`) and only then
publishes the updates: a KVPUB, which is what confirms a write to its client,
never leaves before the write is on disk.

Three kinds of change, kept in the order they happened:

* an applied update (the five frames of its KVPUB; empty body = a delete),
  consecutive ones coalesced into one list, which is also what gets published;
* entries of a full snapshot from the peer being staged (only when the server
  has a data directory: an in-memory server has nothing to stage into);
* the swap of the staged snapshot for the state, at its KTHXBAI.

Taking the record (:meth:`Journal.take`) hands the caller the operations and
starts a new record; :func:`published` says which updates in them go out, in
order.  This is the core's one output channel: its event methods return no
frames, so a test reads what a server would commit and publish exactly where
the reactor reads it.  Pure: no disk, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from clone.server.store import Entry

__all__ = ["Journal", "Op", "OpKind", "published"]


class OpKind(enum.Enum):
    UPDATES = "updates"  # payload: list of KVPUB frame lists, in sequence order
    BEGIN_REPLACE = "begin_replace"  # a full snapshot starts: empty the staging area
    STAGE = "stage"  # payload: list of (raw key, Entry) of the snapshot
    REPLACE = "replace"  # payload: the snapshot's sequence; the staged state becomes the state


@dataclass(slots=True)
class Op:
    kind: OpKind
    updates: list[list[bytes]] = field(default_factory=list)
    staged: list[tuple[bytes, Entry]] = field(default_factory=list)
    sequence: int = 0


class Journal:
    """The ordered record of changes since the last :meth:`take`."""

    __slots__ = ("_ops", "_stage", "_staging", "_updates", "nbytes", "rows")

    def __init__(self, *, stage: bool = False) -> None:
        #: Whether snapshot entries are recorded (only a server with a data
        #: directory has somewhere to stage them).
        self._stage = stage
        self._ops: list[Op] = []
        self._updates: list[list[bytes]] | None = None  # the open UPDATES op's list
        self._staging: list[tuple[bytes, Entry]] | None = None  # the open STAGE op's list
        #: Bytes and rows (updates and staged entries) recorded since the
        #: last take: what bounds the gathering while a commit is in flight
        #: (clone.server.gathering).
        self.nbytes = 0
        self.rows = 0

    @property
    def stages(self) -> bool:
        return self._stage

    def __bool__(self) -> bool:
        return bool(self._ops)

    def first_sequence(self) -> int | None:
        """The sequence of the first update recorded since the last take
        (None: none): everything below it that was applied is committed or
        in the commit in flight (clone.server.diskgate)."""
        for op in self._ops:
            if op.kind is OpKind.UPDATES and op.updates:
                return int.from_bytes(op.updates[0][1], "big")
        return None

    def update(self, frames: list[bytes]) -> None:
        """An update was applied to the state: record its KVPUB frames."""
        updates = self._updates
        if updates is None:
            op = Op(OpKind.UPDATES)
            self._ops.append(op)
            updates = self._updates = op.updates
            self._staging = None
        updates.append(frames)
        self.nbytes += sum(map(len, frames))
        self.rows += 1

    def begin_replace(self) -> None:
        """A full snapshot starts arriving: whatever was staged before is void."""
        if self._stage:
            self._mark(Op(OpKind.BEGIN_REPLACE))

    def stage(self, items: Iterable[tuple[bytes, Entry]]) -> None:
        """Entries of the snapshot being received (raw key, stored frames)."""
        if not self._stage:
            return
        staging = self._staging
        if staging is None:
            op = Op(OpKind.STAGE)
            self._ops.append(op)
            staging = self._staging = op.staged
            self._updates = None
        before = len(staging)
        staging.extend(items)
        added = staging[before:]
        self.rows += len(added)
        self.nbytes += sum(len(key) + sum(map(len, entry)) for key, entry in added)

    def replace(self, sequence: int) -> None:
        """The staged snapshot, complete at ``sequence``, is now the state."""
        self._mark(Op(OpKind.REPLACE, sequence=sequence))

    def take(self) -> list[Op]:
        """The operations recorded since the last call, oldest first."""
        ops = self._ops
        self._ops = []
        self._updates = self._staging = None
        self.nbytes = self.rows = 0
        return ops

    def _mark(self, op: Op) -> None:
        self._ops.append(op)
        self._updates = self._staging = None


def published(ops: list[Op]) -> list[list[bytes]]:
    """The KVPUB frames of ``ops`` (a :meth:`Journal.take`), in order: what
    the reactor publishes once they are committed."""
    if len(ops) == 1 and ops[0].kind is OpKind.UPDATES:
        return ops[0].updates
    return [frames for op in ops if op.kind is OpKind.UPDATES for frames in op.updates]
