"""The data directory's lock holds on the database itself, not only on ``LOCK``."""

from __future__ import annotations

from pathlib import Path

import pytest

from clone.errors import DataDirLocked
from clone.storage import DATA_FILE, Storage
from clone.storage.lock import LOCK_FILE, DirLock
from clone.storage.restore import restore_into
from tests.storage.conftest import OpenStorage
from tests.support.ports import free_base_port
from tests.support.servers import Servers


def test_deleted_lock_file_does_not_let_a_second_open_in(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    open_storage(data_dir)
    (data_dir / LOCK_FILE).unlink()
    with pytest.raises(DataDirLocked, match=rf"database .*{DATA_FILE} is in use"):
        Storage.open(data_dir)
    # The failed open left no new lock behind: only the first holder's remains.
    assert not DirLock(data_dir).held


def test_hold_moves_with_a_replaced_database(tmp_path: Path) -> None:
    db = tmp_path / "x.db"
    db.write_bytes(b"")
    lock = DirLock(tmp_path)
    lock.acquire()
    try:
        lock.hold_database(db)
        other = tmp_path / "y.db"
        other.write_bytes(b"")
        lock.hold_database(other)
        # The first file is free again, the second is held.
        second = DirLock(tmp_path / "sub")
        (tmp_path / "sub").mkdir()
        second.acquire()
        second.hold_database(db)
        with pytest.raises(DataDirLocked):
            second.hold_database(other)
        second.release()
    finally:
        lock.release()


def test_restore_refuses_a_database_in_use_without_its_lock_file(
    data_dir: Path, open_storage: OpenStorage, tmp_path: Path
) -> None:
    open_storage(data_dir)
    backup = tmp_path / "backup.db"
    Storage.open(tmp_path / "other", checkpoint_interval=3600).close()
    (tmp_path / "other" / DATA_FILE).rename(backup)
    (data_dir / LOCK_FILE).unlink()
    with pytest.raises(DataDirLocked):
        restore_into(data_dir, backup)


@pytest.mark.slow
def test_two_servers_with_the_lock_file_deleted_in_between(servers: Servers) -> None:
    first = servers.standalone(name="first")
    data = servers.data_dir("first")
    (data / LOCK_FILE).unlink()
    port = free_base_port()
    second = servers.spawn(
        "second",
        ["--standalone", "--port", str(port), "--bind", "127.0.0.1", "--data-dir", str(data)],
        port,
        None,
    )
    assert second.proc is not None
    code = second.proc.wait(timeout=60)
    assert code == 3  # never started (clone-server EXIT_START_FAILED)
    assert "is in use by another process" in second.log_text()
    assert first.alive
