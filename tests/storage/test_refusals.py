"""Open refuses what it cannot trust, with our error naming the path and what to do.

Never a silent empty start: a locked, damaged, foreign or newer data directory
raises a StorageError kind, and the lock is released again.
"""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clone.errors import DataDirCorrupt, DataDirIncompatible, DataDirLocked, StorageError
from clone.storage import DATA_FILE, Storage, write_state_file
from clone.storage.mark import MARK_FILE
from tests.storage.conftest import OpenStorage, upd


def _assert_unlocked(path: Path) -> None:
    """The failed open left nothing locked: a good database can take the dir
    (a new, empty one: without the old one's commit mark, which would refuse it)."""
    (path / DATA_FILE).unlink()
    (path / MARK_FILE).unlink(missing_ok=True)
    Storage.open(path, checkpoint_interval=3600).close()


def test_second_open_in_process_is_locked(data_dir: Path, open_storage: OpenStorage) -> None:
    open_storage(data_dir)
    with pytest.raises(DataDirLocked, match=rf"pid {os.getpid()} holds .*LOCK"):
        Storage.open(data_dir)


def test_lock_is_released_on_close(data_dir: Path, open_storage: OpenStorage) -> None:
    open_storage(data_dir).close()
    open_storage(data_dir)


def test_open_from_another_process_is_locked(data_dir: Path, open_storage: OpenStorage) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys
            from clone.storage import Storage
            s = Storage.open({str(data_dir)!r})
            print("locked", flush=True)
            sys.stdin.read()
            s.close()
        """)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        cwd=Path(__file__).parents[2],
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "locked"
        with pytest.raises(DataDirLocked, match=rf"pid {child.pid} holds"):
            Storage.open(data_dir)
    finally:
        child.communicate("", timeout=10)
    assert child.returncode == 0
    open_storage(data_dir)


@pytest.mark.parametrize("content", [b"", b"hello, this is not SQLite" * 20],
                         ids=["empty", "garbage"])
def test_garbage_file_is_corrupt(data_dir: Path, content: bytes) -> None:
    data_dir.mkdir()
    (data_dir / DATA_FILE).write_bytes(content)
    expected = re.escape(f"{data_dir / DATA_FILE} is not a database")
    with pytest.raises(DataDirCorrupt, match=expected):
        Storage.open(data_dir)
    _assert_unlocked(data_dir)


def test_truncated_database_is_refused(data_dir: Path) -> None:
    storage = Storage.open(data_dir, checkpoint_interval=3600)
    storage.append([upd(b"k%05d" % i, i + 1, b"x" * 200) for i in range(3000)], term=1, at=0.0)
    storage.close()
    db = data_dir / DATA_FILE
    os.truncate(db, db.stat().st_size // 2)
    with pytest.raises(DataDirCorrupt, match=re.escape(str(db))) as info:
        Storage.open(data_dir)
    assert "--restore" in str(info.value)
    _assert_unlocked(data_dir)


def _rewrite_header(db: Path, pragma: str) -> None:
    conn = sqlite3.connect(db)
    try:
        conn.execute(pragma)
        conn.commit()
    finally:
        conn.close()


def test_wrong_user_version_is_incompatible(data_dir: Path) -> None:
    Storage.open(data_dir, checkpoint_interval=3600).close()
    _rewrite_header(data_dir / DATA_FILE, "PRAGMA user_version = 7")
    newer = r"format version 7, written by a newer .* reads format versions 1 to 2"
    with pytest.raises(DataDirIncompatible, match=newer):
        Storage.open(data_dir)
    _assert_unlocked(data_dir)


def test_wrong_application_id_is_incompatible(data_dir: Path) -> None:
    data_dir.mkdir()
    _rewrite_header(data_dir / DATA_FILE, "CREATE TABLE t (x)")  # someone else's database
    with pytest.raises(DataDirIncompatible, match="not a Clone data directory"):
        Storage.open(data_dir)
    _assert_unlocked(data_dir)


def test_missing_table_is_corrupt(data_dir: Path) -> None:
    Storage.open(data_dir, checkpoint_interval=3600).close()
    _rewrite_header(data_dir / DATA_FILE, "DROP TABLE log")
    with pytest.raises(DataDirCorrupt, match="lacks the table"):
        Storage.open(data_dir)


def test_data_dir_that_is_a_file(tmp_path: Path) -> None:
    path = tmp_path / "data"
    path.write_text("not a directory")
    with pytest.raises(StorageError, match="not a directory"):
        Storage.open(path)
    with pytest.raises(StorageError, match="cannot create or use data directory"):
        Storage.open(path / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file modes")
def test_unreadable_dir(tmp_path: Path) -> None:
    path = tmp_path / "data"
    Storage.open(path, checkpoint_interval=3600).close()
    path.chmod(0)
    try:
        with pytest.raises(StorageError, match="writable"):
            Storage.open(path)
    finally:
        path.chmod(0o755)


def test_no_create_needs_a_database(tmp_path: Path) -> None:
    with pytest.raises(StorageError, match="does not exist"):
        Storage.open(tmp_path / "none", create=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StorageError, match=r"holds no clone\.db"):
        Storage.open(tmp_path / "empty", create=False)
    Storage.open(tmp_path / "empty", checkpoint_interval=3600).close()  # not left locked


def test_state_file_opens_as_a_data_dir(data_dir: Path, open_storage: OpenStorage) -> None:
    data_dir.mkdir()
    write_state_file(data_dir / DATA_FILE, {b"k": (b"\0" * 7 + b"\x09", b"u", b"", b"v")},
                     sequence=9, term=2)
    loaded = open_storage(data_dir, create=False).load()
    assert (len(loaded.entries), loaded.sequence, loaded.term) == (1, 9, 2)


def test_a_full_database_is_named_full_not_a_failed_rollback(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """SQLite rolls a transaction back itself when the disk fills: the error
    must say the disk is full, not that our own ROLLBACK found nothing to undo
    (the hostile drill's disk attack met a really full disk and said only
    "cannot rollback - no transaction is active")."""
    storage = open_storage(data_dir)
    storage.append([upd(b"/a", 1)], term=0, at=0.0)
    conn = storage._live()
    pages = conn.execute("PRAGMA page_count").fetchone()[0]
    conn.execute(f"PRAGMA max_page_count = {pages + 2}")  # a disk with two pages left
    with pytest.raises(StorageError, match="full") as raised:
        storage.append([upd(b"/big", 2, b"v" * 100_000)], term=0, at=0.0)
    assert "rollback" not in str(raised.value)
    assert not conn.in_transaction
    conn.execute("PRAGMA max_page_count = 1073741823")  # space again: writing goes on
    storage.append([upd(b"/b", 2)], term=0, at=0.0)
    assert storage.sequence == 2
