"""The conflicts of split brains: loser writes the winner kept instead of applying.

How this works: when a split brain heals, the winner judges each write the loser
forwards (:mod:`clone.server.splitrule`); one it does not apply becomes a
:class:`ConflictRecord`, with both values, both update ids and times and the
loser's term, so that nothing the loser confirmed is dropped silently.  The
:class:`ConflictBook` holds them in memory, by id and by the loser's uuid (a
resent write gets the same record), counts them, and lists what changed since
the reactor last wrote them to the data directory (``clone.storage.conflicts``).
An operator lists them (``clone conflicts``) and resolves each once: *applied*
(the loser's value is written now, as a new update) or *discarded*.

The book is bounded in bytes (``--max-conflict-bytes``, like every buffer): a long split
with a busy island must not fill the disk or the memory.  Each record counts
:func:`record_bytes` (its byte strings plus :data:`RECORD_OVERHEAD`).  Beyond
the budget the oldest *resolved* records go first -- an operator has already
acted on them -- then the oldest unresolved ones, each of those counted in
:attr:`ConflictBook.dropped` (``clone_split_conflicts_dropped_total``).  What
was dropped is listed for the data directory too (:meth:`take_dropped`), so the
table keeps the same bound and a restart loads no more than the budget.

Pure: no database, no clock (times are arguments).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "DEFAULT_MAX_CONFLICT_BYTES",
    "RECORD_OVERHEAD",
    "RESOLUTIONS",
    "ConflictBook",
    "ConflictRecord",
    "record_bytes",
]

#: The default of ``--max-conflict-bytes``: room for ~1,000 conflicts of 64 KiB
#: values, a small share of a server's memory budget.
DEFAULT_MAX_CONFLICT_BYTES = 64 * 1024 * 1024
#: What a record costs beyond its byte strings: its numbers and the book's and
#: the table's bookkeeping (an estimate, so that empty values still count).
RECORD_OVERHEAD = 128

#: What an operator may do with a conflict, and the ``resolution`` it then has.
RESOLUTIONS = {"apply": "applied", "discard": "discarded"}


@dataclass(frozen=True, slots=True)
class ConflictRecord:
    """One loser write not applied (the columns of the ``conflicts`` table)."""

    id: int
    key: bytes
    reason: str
    loser_uuid: bytes
    loser_props: bytes
    loser_body: bytes
    loser_at: float
    loser_term: int
    winner_seq: int
    winner_uuid: bytes | None
    winner_props: bytes | None
    winner_body: bytes | None
    winner_at: float | None
    recorded: float
    resolution: str | None = None

    def as_json(self) -> dict[str, Any]:
        """For ``clone conflicts --json`` and the admin reply: text where it is
        text, hex for ids, values as UTF-8 with replacement."""

        def text(raw: bytes | None) -> str | None:
            return None if raw is None else raw.decode("utf-8", "replace")

        return {
            "id": self.id,
            "key": text(self.key),
            "reason": self.reason,
            "loser": {
                "uuid": self.loser_uuid.hex(),
                "value": text(self.loser_body),
                "properties": text(self.loser_props),
                "at": self.loser_at,
                "term": self.loser_term,
            },
            "winner": {
                "sequence": self.winner_seq,
                "uuid": None if self.winner_uuid is None else self.winner_uuid.hex(),
                "value": text(self.winner_body),
                "properties": text(self.winner_props),
                "at": self.winner_at,
            },
            "recorded": self.recorded,
            "resolution": self.resolution,
        }


def record_bytes(rec: ConflictRecord) -> int:
    """What ``rec`` counts against the budget: its byte strings plus the overhead."""
    return (
        RECORD_OVERHEAD
        + len(rec.key)
        + len(rec.reason)
        + len(rec.loser_uuid)
        + len(rec.loser_props)
        + len(rec.loser_body)
        + len(rec.winner_uuid or b"")
        + len(rec.winner_props or b"")
        + len(rec.winner_body or b"")
    )


class ConflictBook:
    """Every conflict this server holds; what is new, resolved or dropped since the last write.

    ``max_bytes`` bounds the records' :func:`record_bytes` (0: no bound).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_CONFLICT_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be 0 (no bound) or more, not {max_bytes}")
        self.max_bytes = max_bytes
        self._records: dict[int, ConflictRecord] = {}
        self._by_uuid: dict[bytes, int] = {}
        self._next_id = 1
        #: Conflicts recorded since this server started (``clone_split_conflicts_total``).
        self.total = 0
        #: The bytes the records held count (:func:`record_bytes`).
        self.nbytes = 0
        #: Unresolved records dropped over the budget since start
        #: (``clone_split_conflicts_dropped_total``), and resolved ones trimmed.
        self.dropped = 0
        self.trimmed = 0
        # Unresolved ids, oldest first (ids only grow); resolved ids, a heap.
        self._unresolved: dict[int, None] = {}
        self._resolved: list[int] = []
        # Not yet in the data directory: new records, resolutions, drops.
        self._dirty: dict[int, ConflictRecord] = {}
        self._gone: set[int] = set()

    def load(self, records: Iterable[ConflictRecord]) -> None:
        """The records a data directory held, oldest first (at start, before
        anything is recorded); a budget smaller than they are trims them."""
        for rec in records:
            self._add(rec)
            self._next_id = max(self._next_id, rec.id + 1)
        self._trim()

    def record(self, rec: ConflictRecord) -> ConflictRecord:
        """Keep ``rec`` under the next id (its own ``id`` is ignored).

        The record returned may already be dropped, if alone it is over the budget.
        """
        kept = replace(rec, id=self._next_id)
        self._next_id += 1
        self._add(kept)
        self.total += 1
        self._dirty[kept.id] = kept
        self._trim()
        return kept

    def _add(self, rec: ConflictRecord) -> None:
        self._records[rec.id] = rec
        self._by_uuid[rec.loser_uuid] = rec.id
        self.nbytes += record_bytes(rec)
        if rec.resolution is None:
            self._unresolved[rec.id] = None
        else:
            heapq.heappush(self._resolved, rec.id)

    def _trim(self) -> None:
        """Drop the oldest resolved records, then the oldest unresolved, until
        the records fit the budget."""
        if not self.max_bytes:
            return
        while self.nbytes > self.max_bytes and self._records:
            if self._resolved:
                cid = heapq.heappop(self._resolved)
                self.trimmed += 1
            else:
                cid = next(iter(self._unresolved))
                del self._unresolved[cid]
                self.dropped += 1
            rec = self._records.pop(cid)
            self.nbytes -= record_bytes(rec)
            if self._by_uuid.get(rec.loser_uuid) == cid:
                del self._by_uuid[rec.loser_uuid]
            self._dirty.pop(cid, None)
            self._gone.add(cid)

    def of_uuid(self, uuid: bytes) -> ConflictRecord | None:
        """The conflict the loser's write ``uuid`` became, if it became one."""
        cid = self._by_uuid.get(uuid)
        return None if cid is None else self._records[cid]

    def get(self, cid: int) -> ConflictRecord | None:
        return self._records.get(cid)

    def resolve(self, cid: int, resolution: str) -> ConflictRecord:
        """Mark an unresolved conflict ``applied`` or ``discarded``; ValueError
        for an unknown id, a resolved one or another word."""
        if resolution not in RESOLUTIONS.values():
            raise ValueError(f"a resolution is applied or discarded, not {resolution!r}")
        rec = self._records.get(cid)
        if rec is None:
            raise ValueError(f"no conflict {cid}")
        if rec.resolution is not None:
            raise ValueError(f"conflict {cid} was {rec.resolution} already")
        done = replace(rec, resolution=resolution)
        self._records[cid] = done
        del self._unresolved[cid]
        heapq.heappush(self._resolved, cid)
        self._dirty[cid] = done
        return done

    def records(self, *, unresolved_only: bool = False) -> list[ConflictRecord]:
        """Every record, oldest first."""
        return [
            r
            for _, r in sorted(self._records.items())
            if not unresolved_only or r.resolution is None
        ]

    @property
    def unresolved(self) -> int:
        return len(self._unresolved)

    def __len__(self) -> int:
        return len(self._records)

    def take_dirty(self) -> list[ConflictRecord]:
        """What changed since the last call, for the data directory (then forgotten)."""
        out, self._dirty = list(self._dirty.values()), {}
        return out

    def take_dropped(self) -> list[int]:
        """The ids dropped over the budget since the last call, to delete from
        the data directory (then forgotten)."""
        out, self._gone = sorted(self._gone), set()
        return out

    def put_back(self, dirty: Iterable[ConflictRecord], dropped: Iterable[int]) -> None:
        """What a write that did not happen took (the database was busy): to be
        taken again by the next one.  A record changed or dropped since stays so."""
        for rec in dirty:
            if rec.id in self._records and rec.id not in self._dirty:
                self._dirty[rec.id] = self._records[rec.id]
        self._gone.update(dropped)
