"""Committed updates missing at open are refused, never served (issue 30).

A chaos run's primary confirmed 7513-7517, was killed, and reopened its data
directory at 7512 with nothing logged.  The commit mark (clone.storage.mark)
turns such a loss into a refusal; the one mechanism found that loses commits
silently (a descriptor of clone.db closed in the server's process drops
SQLite's locks, and another process's reader then deletes the live -wal) is
fixed in ``Storage.backup_to``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from clone.errors import DataDirBehind
from clone.storage import DATA_FILE, Storage, restore_into, write_state_file
from clone.storage.mark import MARK_FILE, MARK_SIZE, check, format_mark, parse_mark
from tests.storage.conftest import OpenStorage, upd

# -- the record (pure) ---------------------------------------------------------


def test_a_mark_reads_back_what_was_written() -> None:
    for position in [(0, 0), (7517, 29), (2**63 - 1, 2**40)]:
        data = format_mark(*position)
        assert len(data) == MARK_SIZE
        assert parse_mark(data) == position


_GOOD = format_mark(5, 1)


@pytest.mark.parametrize("data", [b"", b"clone-committed 12", b"\0" * MARK_SIZE, _GOOD[:30],
                                  _GOOD[:-3], b"x" + _GOOD[1:]],
                         ids=["empty", "short", "zeros", "torn", "unpadded", "foreign"])
def test_anything_else_is_no_mark(data: bytes) -> None:
    assert parse_mark(data) is None


def test_only_a_database_behind_the_mark_is_refused(tmp_path: Path) -> None:
    mark, db = tmp_path / MARK_FILE, tmp_path / DATA_FILE
    check(mark, db, None, 0, 0)  # no mark: nothing to compare with
    check(mark, db, (10, 3), 10, 3)
    check(mark, db, (10, 3), 11, 3)  # killed between the commit and the mark's write
    with pytest.raises(DataDirBehind, match=r"holds sequence 9 \(term 3\).* up to sequence "
                                            r"10 \(term 3.*1 committed .*missing.*--restore"):
        check(mark, db, (10, 3), 9, 3)


# -- a real data directory -----------------------------------------------------


def _commit(storage: Storage, first: int, last: int, term: int = 1) -> None:
    for seq in range(first, last + 1):
        storage.append([upd(b"k%d" % (seq % 7), seq, b"v%d" % seq)], term=term, at=0.0)


def test_a_database_that_lost_committed_updates_is_refused(
    tmp_path: Path, open_storage: OpenStorage
) -> None:
    """clone.db and its -wal as they were at 10 (what a lost -wal leaves), the
    mark at 15: without the mark the open served 10 and said nothing."""
    data, aside = tmp_path / "data", tmp_path / "aside"
    storage = open_storage(data)
    _commit(storage, 1, 10)
    aside.mkdir()
    for name in (DATA_FILE, DATA_FILE + "-wal"):  # no checkpoint ran: 1-10 are in the WAL
        shutil.copy(data / name, aside / name)
    _commit(storage, 11, 15)
    storage.close()
    for name in (DATA_FILE, DATA_FILE + "-wal"):
        shutil.copy(aside / name, data / name)
    (data / (DATA_FILE + "-shm")).unlink(missing_ok=True)

    with pytest.raises(DataDirBehind) as info:
        Storage.open(data, checkpoint_interval=3600)
    text = str(info.value)
    assert "holds sequence 10 (term 1)" in text
    assert "committed up to sequence 15 (term 1" in text
    assert str(data / MARK_FILE) in text  # what to move aside to accept the loss
    # Nothing was left locked or changed: accepting the loss opens it at 10.
    (data / MARK_FILE).rename(tmp_path / "COMMITTED.old")
    reopened = open_storage(data)
    assert reopened.sequence == 10
    assert parse_mark((data / MARK_FILE).read_bytes()) == (10, 1)


def test_the_mark_follows_every_commit(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (0, 0)
    _commit(storage, 1, 3, term=2)
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (3, 2)
    storage.set_position(3, 4)
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (3, 4)


def test_a_resync_onto_an_older_state_lowers_the_mark(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """A stepped-down server takes the winner's state, which may be older: its
    next start must not take that for a loss."""
    storage = open_storage(data_dir)
    _commit(storage, 1, 20, term=3)
    storage.begin_replace()
    storage.stage([(b"k", ((12).to_bytes(8, "big"), b"u" * 16, b"", b"K"))])
    storage.finish_replace(12, 3)
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (12, 3)
    # And a sequence written again lower after a failover (INSERT OR REPLACE).
    storage.append([upd(b"k", 11, b"again")], term=4, at=0.0)
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (11, 4)
    storage.close()
    assert Storage.open(data_dir, checkpoint_interval=3600).sequence == 11


def test_the_mark_is_lowered_before_the_commit_that_lowers_the_position(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """Killed between the two, the database is ahead of the mark (fine), never behind."""
    storage = open_storage(data_dir)
    _commit(storage, 1, 20)
    seen: list[tuple[int, int] | None] = []
    real = storage._transaction

    def spy(doing: str, busy_timeout: float | None = None):  # type: ignore[no-untyped-def]
        seen.append(parse_mark((data_dir / MARK_FILE).read_bytes()))
        return real(doing, busy_timeout)

    storage._transaction = spy  # type: ignore[method-assign]
    storage.set_position(5, 2)
    assert seen == [(5, 2)]


def test_a_restore_drops_the_old_mark(tmp_path: Path, open_storage: OpenStorage) -> None:
    data, backup = tmp_path / "data", tmp_path / "b.db"
    storage = open_storage(data)
    _commit(storage, 1, 30)
    storage.close()
    write_state_file(backup, {b"a": ((3).to_bytes(8, "big"), b"u" * 16, b"", b"A")},
                     sequence=3, term=1)
    restore_into(data, backup)  # older, by the operator's choice
    assert not (data / MARK_FILE).exists()
    assert open_storage(data).sequence == 3


def test_a_directory_without_a_valid_mark_starts_one(
    data_dir: Path, open_storage: OpenStorage, caplog: pytest.LogCaptureFixture
) -> None:
    storage = open_storage(data_dir)
    _commit(storage, 1, 4)
    storage.close()
    (data_dir / MARK_FILE).write_bytes(b"garbage")
    assert open_storage(data_dir).sequence == 4
    assert "does not hold a commit mark" in caplog.text
    assert parse_mark((data_dir / MARK_FILE).read_bytes()) == (4, 1)


# -- the loss found: a descriptor closed in the server's process ------------------


_WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from clone.storage import Storage
    data = Path(sys.argv[1])
    st = Storage.open(data, checkpoint_interval=3600)
    def up(s):
        return [b"/k", s.to_bytes(8, "big"), b"u" * 16, b"", b"v%d" % s]
    for s in range(1, 11):
        st.append([up(s)], term=1, at=0.0)
    st.backup_to(data.parent / "copy.db")
    print("ready", flush=True)
    sys.stdin.readline()
    for s in range(11, 21):
        st.append([up(s)], term=1, at=0.0)
    print("committed", st.sequence, flush=True)
    sys.stdin.readline()
""")

_READER = textwrap.dedent("""
    import sqlite3, sys
    conn = sqlite3.connect(sys.argv[1])
    conn.execute("PRAGMA query_only = 1")
    print(conn.execute("SELECT value FROM meta WHERE name = 'sequence'").fetchone()[0])
    conn.close()
""")


@pytest.mark.slow
def test_a_reader_in_another_process_never_deletes_the_live_wal(tmp_path: Path) -> None:
    """backup_to opened and closed clone.db beside SQLite, which dropped the
    server's locks; a read-only connection in another process (clone-pipeline's
    read_data_dir, an sqlite3 shell) then closed as the last one, checkpointed
    and deleted the -wal the server kept appending to: 10 commits lost at the
    next start, nothing logged."""
    data = tmp_path / "data"
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(data)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None and writer.stdin is not None
        assert writer.stdout.readline().strip() == "ready"
        read = subprocess.run([sys.executable, "-c", _READER, str(data / DATA_FILE)],
                              capture_output=True, text=True, timeout=60, check=True)
        assert read.stdout.strip() == "10"
        assert (data / (DATA_FILE + "-wal")).exists()
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.stdout.readline().split() == ["committed", "20"]
        writer.kill()  # kill -9: no close, no final checkpoint
        writer.wait(timeout=60)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait(timeout=60)
    storage = Storage.open(data, checkpoint_interval=3600)
    try:
        assert storage.sequence == 20
    finally:
        storage.close()
