"""State files: backup_to, write_state_file, check_state_file and restore_into."""

from __future__ import annotations

import os
import re
import sqlite3
from pathlib import Path

import pytest

from clone.errors import DataDirCorrupt, DataDirIncompatible, DataDirLocked
from clone.storage import DATA_FILE, Entry, check_state_file, restore_into, write_state_file
from tests.storage.conftest import OpenStorage, upd


def entries(n: int) -> dict[bytes, Entry]:
    return {b"k%d" % i: ((i + 1).to_bytes(8, "big"), b"u", b"p=1\n", b"v%d" % i)
            for i in range(n)}


def test_write_state_file_round_trip(tmp_path: Path, open_storage: OpenStorage) -> None:
    state = tmp_path / "state.db"
    write_state_file(state, entries(100), sequence=100, term=3)
    write_state_file(tmp_path / "pairs.db", iter(entries(5).items()), sequence=5, term=1)
    assert check_state_file(state) == (100, 100, 3)
    assert check_state_file(tmp_path / "pairs.db") == (5, 5, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pairs.db", "state.db"]  # no temp left

    restore_into(tmp_path / "data", state)
    loaded = open_storage(tmp_path / "data").load()
    assert loaded.entries == entries(100)
    assert (loaded.sequence, loaded.term, loaded.history) == (100, 3, [])


def test_backup_to_is_a_consistent_copy(tmp_path: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(tmp_path / "data")
    storage.append([upd(b"k%d" % i, i + 1) for i in range(50)], term=2, at=1.0)
    target = tmp_path / "backup.db"
    target.write_bytes(b"an older backup")
    storage.backup_to(target)
    storage.append([upd(b"later", 51)], term=2, at=1.0)  # after the copy: not in it
    assert check_state_file(target) == (50, 50, 2)
    assert not (tmp_path / "backup.db.tmp").exists()
    assert not (tmp_path / "backup.db-wal").exists()  # one self-contained file


def test_check_state_file_refuses_bad_files(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(os.urandom(4096))
    with pytest.raises(DataDirCorrupt, match=re.escape(str(garbage))):
        check_state_file(garbage)
    write_state_file(tmp_path / "good.db", entries(1), sequence=1, term=1)
    conn = sqlite3.connect(tmp_path / "good.db")
    conn.execute("PRAGMA user_version = 3")
    conn.close()
    with pytest.raises(DataDirIncompatible, match="version 3"):
        check_state_file(tmp_path / "good.db")


def test_restore_moves_the_old_database_aside(tmp_path: Path, open_storage: OpenStorage) -> None:
    data = tmp_path / "data"
    storage = open_storage(data)
    storage.append([upd(b"old", 1, b"O")], term=1, at=0.0)
    storage.close()
    backup = tmp_path / "b.db"
    write_state_file(backup, entries(3), sequence=3, term=5)

    aside = restore_into(data, backup)
    assert aside is not None and aside.parent == data
    assert aside.name.startswith("replaced-") and aside.name.endswith("Z.db")
    assert check_state_file(aside) == (1, 1, 1)  # the old state, intact
    assert sorted(p.name for p in data.iterdir()) == sorted([DATA_FILE, "LOCK", aside.name])
    loaded = open_storage(data).load()
    assert (loaded.entries, loaded.sequence, loaded.term) == (entries(3), 3, 5)


def test_restore_with_a_bad_file_changes_nothing(tmp_path: Path,
                                                 open_storage: OpenStorage) -> None:
    data = tmp_path / "data"
    open_storage(data).append([upd(b"old", 1)], term=1, at=0.0)
    bad = tmp_path / "bad.db"
    bad.write_bytes(b"nope" * 100)
    with pytest.raises(DataDirCorrupt):
        restore_into(data, bad)
    good = tmp_path / "good.db"
    write_state_file(good, entries(1), sequence=1, term=1)
    with pytest.raises(DataDirLocked):  # the running server's directory is left alone
        restore_into(data, good)
    assert sorted(p.name for p in data.iterdir() if not p.name.startswith(DATA_FILE + "-")) \
        == sorted([DATA_FILE, "LOCK", "COMMITTED"])


def test_restore_into_a_new_dir(tmp_path: Path) -> None:
    backup = tmp_path / "b.db"
    write_state_file(backup, entries(2), sequence=2, term=1)
    assert restore_into(tmp_path / "new" / "data", backup) is None
    assert check_state_file(tmp_path / "new" / "data" / DATA_FILE) == (2, 2, 1)
