"""A checkpoint that holds the writer lock never fails the reactor's commit.

A ``wal_checkpoint(TRUNCATE)`` takes the database's writer lock and, while it
holds it, waits (its busy handler) for every reader to leave the WAL.  A reader
pinned to an old snapshot -- here a plain connection in a read transaction, in
a server a ``clone backup`` copying the database -- makes that wait as long as
the checkpointing connection's busy timeout.  These tests pin one, so the lock
is held for exactly as long as the test says: the contention is deterministic,
not a race with the checkpoint thread's timer.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from clone.errors import StorageBusy
from clone.storage import DATA_FILE, db
from clone.storage.checkpointer import CATCH_UP_FRAMES, Checkpointer, Next, plan
from tests.storage.conftest import OpenStorage, upd
from tests.support.waiting import eventually


def _writer_lock_held(path: Path) -> bool:
    """Whether another connection holds the writer lock (a probe that takes no wait)."""
    probe = sqlite3.connect(path, isolation_level=None, timeout=0.0)
    try:
        probe.execute("BEGIN IMMEDIATE")
    except sqlite3.OperationalError as exc:
        return getattr(exc, "sqlite_errorname", "").startswith("SQLITE_BUSY")
    else:
        probe.execute("ROLLBACK")
        return False
    finally:
        probe.close()


def _pin_a_reader(path: Path) -> sqlite3.Connection:
    reader = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM kv").fetchone()  # holds its snapshot
    return reader


def test_an_update_commit_waits_out_a_truncate_that_holds_the_lock_past_its_busy_timeout(
    data_dir: Path, open_storage: OpenStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reactor's connection gives up on a held lock after 50 ms, so a
    # checkpoint holding it longer is what used to fail-stop the server.
    monkeypatch.setattr(db, "BUSY_TIMEOUT", 0.05)
    storage = open_storage(data_dir)
    path = data_dir / DATA_FILE
    storage.append([upd(b"/a", 1)], term=1, at=1.0)
    reader = _pin_a_reader(path)
    storage.append([upd(b"/b", 2)], term=1, at=2.0)  # past the reader's snapshot

    # A TRUNCATE checkpoint that waits up to 60 s for the reader, lock held.
    checkpoint = sqlite3.connect(path, isolation_level=None, timeout=60.0,
                                 check_same_thread=False)
    result: list[tuple[int, int, int]] = []
    truncating = threading.Thread(
        target=lambda: result.append(
            checkpoint.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()))
    truncating.start()
    committed: list[BaseException | None] = []

    def commit() -> None:
        try:
            storage.append([upd(b"/c", 3)], term=1, at=3.0)
        except BaseException as exc:
            committed.append(exc)
        else:
            committed.append(None)

    committing = threading.Thread(target=commit)
    try:
        eventually(lambda: _writer_lock_held(path), timeout=30, what="the TRUNCATE's lock")
        committing.start()
        # The commit has met the held lock (SQLITE_BUSY) at least twice: each
        # time it waits again instead of failing.
        eventually(lambda: storage.busy_waits >= 2 or bool(committed), timeout=30,
                   what="the commit to meet the lock")
        assert not committed, f"the commit ended while the lock was held: {committed}"
    finally:
        reader.execute("ROLLBACK")  # the reader leaves: the checkpoint ends
        truncating.join(60)
        committing.join(60) if committing.is_alive() or committed else None
        reader.close()
        checkpoint.close()
    assert committed == [None]
    assert result and result[0][0] == 0  # the checkpoint itself completed
    assert storage.sequence == 3
    assert sorted(storage.load().entries) == [b"/a", b"/b", b"/c"]


def test_a_lock_held_past_the_ceiling_still_fails_the_commit(
    data_dir: Path, open_storage: OpenStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holding the database for good (not our checkpointer,
    which lets go within its own short wait) is a fault: the commit gives up
    after ``BUSY_CEILING`` and the server fail-stops as on any write error."""
    monkeypatch.setattr(db, "BUSY_TIMEOUT", 0.02)
    monkeypatch.setattr(db, "BUSY_CEILING", 0.2)
    storage = open_storage(data_dir)
    other = sqlite3.connect(data_dir / DATA_FILE, isolation_level=None)
    try:
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(StorageBusy, match="database is locked"):
            storage.append([upd(b"/a", 1)], term=1, at=1.0)
        assert storage.busy_waits >= 2
        other.execute("ROLLBACK")
    finally:
        other.close()
    assert storage.sequence == 0
    storage.append([upd(b"/a", 1)], term=1, at=1.0)
    assert storage.sequence == 1


def test_the_checkpoint_thread_lets_go_of_the_lock_when_a_reader_holds_the_wal(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """With a reader pinned, the thread's TRUNCATE gives up within its short
    wait (counted) instead of holding the writer lock; the writer's commits go
    through meanwhile, and the WAL is cut once the reader has gone."""
    storage = open_storage(data_dir)
    path = data_dir / DATA_FILE
    storage.append([upd(b"/k0", 1, body=b"x" * 10_000)], term=1, at=1.0)
    reader = _pin_a_reader(path)
    checkpointer = Checkpointer(path, 0.01, truncate_above=100_000, truncate_wait=0.02)
    try:
        for seq in range(2, 12):
            # Little past the reader (under CATCH_UP_FRAMES), so a TRUNCATE is tried.
            storage.append([upd(f"/k{seq}".encode(), seq, body=b"x" * 10_000)], term=1,
                           at=float(seq))
        checkpointer.start()
        eventually(lambda: checkpointer.truncations_busy >= 3, timeout=30,
                   what="truncations that gave up")
        assert checkpointer.truncations == 0
        # Not a lock held for the reader's lifetime: a commit with no busy wait
        # of its own goes through between the thread's tries.
        waits = storage.busy_waits
        for seq in range(12, 20):
            storage.append([upd(f"/k{seq}".encode(), seq)], term=1, at=float(seq))
        assert storage.busy_waits - waits <= 1
        reader.execute("ROLLBACK")
        eventually(lambda: checkpointer.truncations >= 1, timeout=30, what="a truncation")
    finally:
        checkpointer.stop()
        reader.close()
    assert storage.sequence == 19


def test_plan_truncates_only_what_a_passive_pass_has_nearly_copied() -> None:
    mib64 = 64 * 1024 * 1024
    # A small WAL, or a busy pass: the next interval.
    assert plan(0, 1000, 10, 1_000_000, mib64) is Next.WAIT
    assert plan(1, 90_000, 10, mib64 + 1, mib64) is Next.WAIT
    # Over the limit, all but CATCH_UP_FRAMES copied: cut it now.
    assert plan(0, 20_000, 20_000, mib64 + 1, mib64) is Next.RESTART
    assert plan(0, 20_000, 20_000 - CATCH_UP_FRAMES, mib64 + 1, mib64) is Next.RESTART
    # More left: another passive pass soon, while passes make progress ...
    assert plan(0, 20_000, 15_000, mib64 + 1, mib64, copied_before=9_000) is Next.CATCH_UP
    # ... (a WAL that started again from the top counts as progress) ...
    assert plan(0, 20_000, 15_000, mib64 + 1, mib64, copied_before=19_000) is Next.CATCH_UP
    # ... but a reader holding them back makes them copy the same: wait.
    assert plan(0, 20_000, 15_000, mib64 + 1, mib64, copied_before=15_000) is Next.WAIT
    # Not in WAL mode (SQLite answers -1): nothing to do.
    assert plan(0, -1, -1, mib64 + 1, mib64) is Next.WAIT
