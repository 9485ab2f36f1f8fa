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

Pure: no database, no clock (times are arguments).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

__all__ = ["RESOLUTIONS", "ConflictBook", "ConflictRecord"]

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


class ConflictBook:
    """Every conflict this server holds; what is new or resolved since the last write."""

    def __init__(self) -> None:
        self._records: dict[int, ConflictRecord] = {}
        self._by_uuid: dict[bytes, int] = {}
        self._next_id = 1
        #: Conflicts recorded since this server started (``clone_split_conflicts_total``).
        self.total = 0
        self._unresolved = 0
        # Not yet in the data directory: new records, and resolutions.
        self._dirty: dict[int, ConflictRecord] = {}

    def load(self, records: Iterable[ConflictRecord]) -> None:
        """The records a data directory held (at start, before anything is recorded)."""
        for rec in records:
            self._records[rec.id] = rec
            self._by_uuid[rec.loser_uuid] = rec.id
            self._next_id = max(self._next_id, rec.id + 1)
            self._unresolved += rec.resolution is None

    def record(self, rec: ConflictRecord) -> ConflictRecord:
        """Keep ``rec`` under the next id (its own ``id`` is ignored)."""
        kept = replace(rec, id=self._next_id)
        self._next_id += 1
        self._records[kept.id] = kept
        self._by_uuid[kept.loser_uuid] = kept.id
        self.total += 1
        self._unresolved += 1
        self._dirty[kept.id] = kept
        return kept

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
        self._unresolved -= 1
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
        return self._unresolved

    def __len__(self) -> int:
        return len(self._records)

    def take_dirty(self) -> list[ConflictRecord]:
        """What changed since the last call, for the data directory (then forgotten)."""
        out, self._dirty = list(self._dirty.values()), {}
        return out
