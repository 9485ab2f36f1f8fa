"""Conflict rows in the data directory: in the turn's transaction, and a busy lock.

A second connection holding the write lock stands in for the checkpointer's
``wal_checkpoint(TRUNCATE)``, which holds it while it copies the WAL.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from clone.errors import StorageBusy
from clone.storage import DATA_FILE
from clone.storage.conflicts import COLUMNS
from tests.storage.conftest import OpenStorage, upd


def _row(cid: int, resolution: str | None = None) -> tuple[object, ...]:
    row = (cid, b"/k", "winner-wrote", bytes([cid]) * 16, b"", b"loser", 1.0, 2, 3,
           b"w" * 16, b"", b"winner", 4.0, 5.0, resolution)
    assert len(row) == len(COLUMNS)
    return row


def test_conflict_rows_go_in_the_transaction_of_the_updates(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    storage = open_storage(data_dir)
    storage.write_conflicts([_row(1), _row(2)])
    commits = storage.timing.commits
    storage.append([upd(b"/a", 1)], term=1, at=10.0, conflict_rows=[_row(3)],
                   conflict_drops=[1])
    assert storage.timing.commits == commits + 1  # one transaction, one commit
    assert [r[0] for r in storage.read_conflicts()] == [2, 3]
    # A turn with neither updates nor conflict changes writes nothing.
    storage.append([], term=1, at=11.0)
    storage.write_conflicts([], [])
    assert storage.timing.commits == commits + 1


def test_a_held_write_lock_fails_a_short_wait_with_storage_busy_and_writes_nothing(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    storage = open_storage(data_dir)
    other = sqlite3.connect(data_dir / DATA_FILE, isolation_level=None, timeout=0.0)
    try:
        other.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(StorageBusy, match="database is locked"):
            storage.write_conflicts([_row(1)], busy_timeout=0.05)
        # Waited its 50 ms, not the connection's 2 s (a generous ceiling: a busy machine).
        assert time.monotonic() - started < 1.5
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert storage.read_conflicts() == []
    # The lock gone, the same rows land; the connection's own timeout is back.
    storage.write_conflicts([_row(1)], busy_timeout=0.05)
    assert [r[0] for r in storage.read_conflicts()] == [1]
    assert storage._live().execute("PRAGMA busy_timeout").fetchone()[0] == 2000
