"""The checkpoint thread cuts a WAL that a steady writer keeps from restarting."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from clone.storage.checkpointer import Checkpointer
from tests.support.waiting import eventually


def test_a_wal_past_the_limit_is_truncated(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("PRAGMA journal_mode = WAL")
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    # As the server's connection (clone.storage.db): the restarted WAL's
    # first commit cuts the file to this size.
    writer.execute("PRAGMA journal_size_limit = 1000000")
    writer.execute("CREATE TABLE t (v BLOB)")
    for _ in range(40):
        writer.execute("INSERT INTO t VALUES (?)", (os.urandom(100_000),))
    wal = db.with_name("t.db-wal")
    assert wal.stat().st_size > 4_000_000
    checkpointer = Checkpointer(db, 0.02, truncate_above=1_000_000)
    checkpointer.start()
    try:
        eventually(lambda: checkpointer.truncations >= 1, timeout=30)
        # Writes go on as before, into a WAL that starts again from the top,
        # its file cut to the writer's journal_size_limit.
        writer.execute("INSERT INTO t VALUES (?)", (b"x",))
        assert writer.execute("SELECT count(*) FROM t").fetchone()[0] == 41
        assert wal.stat().st_size <= 1_000_000
        runs, cuts = checkpointer.runs, checkpointer.truncations
        eventually(lambda: checkpointer.runs >= runs + 5, timeout=30)
        assert checkpointer.truncations == cuts  # a restarted WAL is small: no cut again
    finally:
        checkpointer.stop()
        writer.close()


def test_a_small_wal_is_left_to_passive_checkpoints(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    writer = sqlite3.connect(db, isolation_level=None)
    writer.execute("PRAGMA journal_mode = WAL")
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute("CREATE TABLE t (v BLOB)")
    checkpointer = Checkpointer(db, 0.02, truncate_above=64 * 1024 * 1024)
    checkpointer.start()
    try:
        eventually(lambda: checkpointer.runs >= 3, timeout=30)
        assert checkpointer.truncations == 0
    finally:
        checkpointer.stop()
        writer.close()
