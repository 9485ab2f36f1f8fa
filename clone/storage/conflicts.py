"""The ``conflicts`` table (format 2): split-brain writes the winner did not apply.

How this works: the server's :class:`~clone.server.conflicts.ConflictBook`
holds the records; at each group commit the reactor hands this module the
ones recorded or resolved since the last, as rows in the table's column
order (:data:`COLUMNS`), and the ids dropped over the book's byte budget;
they are written in the turn's transaction (the updates', if it has any).  At start
they are read back, so a restart of the winner keeps every conflict and its
resolution.  Plain blocking SQLite, short and bounded like the rest of
:mod:`clone.storage`; no server types (rows are tuples).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["COLUMNS", "ConflictRow", "delete_conflicts", "read_conflicts", "write_conflicts"]

#: The table's columns, in the order of a row.
COLUMNS = (
    "id",
    "key",
    "reason",
    "loser_uuid",
    "loser_props",
    "loser_body",
    "loser_at",
    "loser_term",
    "winner_seq",
    "winner_uuid",
    "winner_props",
    "winner_body",
    "winner_at",
    "recorded",
    "resolution",
)
ConflictRow = tuple[Any, ...]

_INSERT = (
    f"INSERT OR REPLACE INTO conflicts ({', '.join(COLUMNS)}) "
    f"VALUES ({', '.join('?' for _ in COLUMNS)})"
)


def write_conflicts(conn: sqlite3.Connection, rows: Iterable[Sequence[Any]]) -> None:
    """Insert or replace ``rows`` (the caller holds the transaction)."""
    batch = [tuple(r) for r in rows]
    for row in batch:
        if len(row) != len(COLUMNS):
            raise ValueError(f"a conflict row has {len(COLUMNS)} columns, not {len(row)}")
    conn.executemany(_INSERT, batch)


def delete_conflicts(conn: sqlite3.Connection, ids: Iterable[int]) -> None:
    """Delete the rows of ``ids`` (dropped over the budget; the caller holds
    the transaction)."""
    conn.executemany("DELETE FROM conflicts WHERE id = ?", [(int(i),) for i in ids])


def read_conflicts(conn: sqlite3.Connection) -> list[ConflictRow]:
    """Every row, oldest first; none when the table does not exist (format 1)."""
    found = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'conflicts'"
    ).fetchone()
    if found is None:
        return []
    return [
        tuple(r) for r in conn.execute(f"SELECT {', '.join(COLUMNS)} FROM conflicts ORDER BY id")
    ]
