"""append/load round trips, fsync policies, the log's trimming and position records."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from clone.errors import StorageError
from clone.storage import DATA_FILE, FORMAT_VERSION, FsyncPolicy, Storage
from clone.storage.db import PAGE_CACHE_KIB
from tests.storage.conftest import OpenStorage, upd


def test_new_dir_loads_empty(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    loaded = storage.load()
    assert (loaded.entries, loaded.sequence, loaded.term, loaded.history) == ({}, 0, 0, [])
    assert storage.path == data_dir
    assert storage.fsync is FsyncPolicy.BATCH
    assert (data_dir / DATA_FILE).is_file()


def test_header_marks_and_wal(data_dir: Path, open_storage: OpenStorage) -> None:
    open_storage(data_dir)
    conn = sqlite3.connect(data_dir / DATA_FILE)
    try:
        assert conn.execute("PRAGMA application_id").fetchone()[0] == 0x434C4F4E
        assert conn.execute("PRAGMA user_version").fetchone()[0] == FORMAT_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        meta = dict(conn.execute("SELECT name, value FROM meta"))
        assert set(meta) == {"created", "sequence", "term", "release"}
        assert abs(meta["created"] - time.time()) < 60
    finally:
        conn.close()


def test_round_trip(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"a", 1, b"A1"), upd(b"b", 2, b"B"), upd(b"a", 3, b"A3")],
                   term=1, at=[10.0, 11.0, 12.0])
    storage.append([upd(b"b", 4, b""), upd(b"c", 5, b"C", props=b"ttl=1\n")], term=2, at=20.0)
    storage.close()

    loaded = open_storage(data_dir).load()
    assert loaded.entries == {
        b"a": ((3).to_bytes(8, "big"), b"u" * 16, b"", b"A3"),
        b"c": ((5).to_bytes(8, "big"), b"u" * 16, b"ttl=1\n", b"C"),
    }
    assert (loaded.sequence, loaded.term) == (5, 2)
    assert [frames[0] for frames, _, _ in loaded.history] == [b"a", b"b", b"a", b"b", b"c"]
    assert loaded.history[3] == (upd(b"b", 4, b""), 2, 20.0)
    assert [(term, at) for _, term, at in loaded.history] == [
        (1, 10.0), (1, 11.0), (1, 12.0), (2, 20.0), (2, 20.0)]


def test_delete_then_set_in_one_group_keeps_the_set(
        data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"k", 1), upd(b"k", 2, b""), upd(b"k", 3, b"back")], term=1, at=0.0)
    storage.append([upd(b"j", 4), upd(b"j", 5, b"")], term=1, at=0.0)
    assert storage.load().entries == {b"k": ((3).to_bytes(8, "big"), b"u" * 16, b"", b"back")}


def test_keep_from_trims_the_log(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"k%d" % i, i) for i in range(1, 11)], term=1, at=0.0)
    storage.append([upd(b"x", 11)], term=1, at=0.0, keep_from=8)
    loaded = storage.load()
    assert [int.from_bytes(f[1], "big") for f, _, _ in loaded.history] == [8, 9, 10, 11]
    assert len(loaded.entries) == 11  # trimming the log never touches the state


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_every_policy_is_durable_across_reopen(
        data_dir: Path, open_storage: OpenStorage, policy: FsyncPolicy) -> None:
    storage = open_storage(data_dir, fsync=policy)
    assert storage.fsync is policy
    for group in range(5):
        storage.append([upd(b"k%d" % i, group * 3 + i + 1, b"g%d" % group) for i in range(3)],
                       term=group, at=float(group), keep_from=4)
    storage.close()
    loaded = open_storage(data_dir, fsync=policy).load()
    assert {k: e[3] for k, e in loaded.entries.items()} == {b"k0": b"g4", b"k1": b"g4",
                                                            b"k2": b"g4"}
    assert (loaded.sequence, loaded.term, len(loaded.history)) == (15, 4, 12)


def test_empty_append_records_a_new_term(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"a", 7)], term=1, at=0.0)
    storage.append([], term=1, at=0.0)
    storage.append([], term=3, at=0.0)
    assert (storage.sequence, storage.term) == (7, 3)
    storage.close()
    loaded = open_storage(data_dir).load()
    assert (loaded.sequence, loaded.term) == (7, 3)


def test_set_position(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.set_position(41, 5)
    storage.close()
    loaded = open_storage(data_dir).load()
    assert (loaded.sequence, loaded.term, loaded.entries) == (41, 5, {})


def test_the_role_a_server_wrote_under_survives_a_restart(
        data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    assert not storage.load().following  # a new directory: never followed anyone
    storage.record_following(True)
    storage.close()
    storage = open_storage(data_dir)
    assert storage.load().following
    storage.record_following(False)
    storage.close()
    assert not open_storage(data_dir).load().following


@pytest.mark.parametrize("bad", [[b"k", b"\0" * 8, b"u", b""], [b"k", b"\1", b"u", b"", b"v"]])
def test_malformed_update_is_a_value_error(
        data_dir: Path, open_storage: OpenStorage, bad: list[bytes]) -> None:
    storage = open_storage(data_dir)
    with pytest.raises(ValueError, match="5 KVPUB frames"):
        storage.append([upd(b"ok", 1), bad], term=1, at=0.0)
    assert storage.load().entries == {}  # nothing of the group was written


def test_at_list_must_match(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    with pytest.raises(ValueError, match="2 times for 1 updates"):
        storage.append([upd(b"a", 1)], term=1, at=[1.0, 2.0])


def test_use_after_close_and_double_close(data_dir: Path) -> None:
    storage = Storage.open(data_dir, checkpoint_interval=3600)
    storage.close()
    storage.close()
    with pytest.raises(ValueError, match="closed"):
        storage.load()


def test_checkpointer_moves_the_wal_into_the_db(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir, checkpoint_interval=0.02)
    storage.append([upd(b"k%d" % i, i + 1, b"x" * 100) for i in range(200)], term=1, at=0.0)
    deadline = time.monotonic() + 5
    checkpointer = storage._checkpointer
    while checkpointer.last_copied == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpointer.last_copied > 0
    storage.close()
    assert not (data_dir / (DATA_FILE + "-wal")).exists() or \
        (data_dir / (DATA_FILE + "-wal")).stat().st_size == 0


def test_close_joins_the_checkpoint_thread(data_dir: Path) -> None:
    storage = Storage.open(data_dir)  # default 1 s interval: close must not wait for it
    thread = storage._checkpointer._thread
    started = time.monotonic()
    storage.close()
    assert not thread.is_alive()
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("term", [10**20, 2**63])
def test_a_number_too_large_for_sqlite_is_a_storage_error(
        data_dir: Path, open_storage: OpenStorage, term: int) -> None:
    """sqlite3 raises OverflowError, not one of its errors, for such an int: the
    server's commit path catches StorageError, so it must arrive as one
    (once a write stayed in memory only, and the loop took the error)."""
    storage = open_storage(data_dir)
    storage.append([upd(b"a", 1)], term=1, at=0.0)
    with pytest.raises(StorageError, match="appending to") as failed:
        storage.append([upd(b"b", 2)], term=term, at=0.0)
    assert isinstance(failed.value.__cause__, OverflowError)
    with pytest.raises(StorageError, match="recording the position"):
        storage.set_position(3, term)
    loaded = storage.load()  # nothing of either was written; still usable
    assert (loaded.sequence, loaded.term, list(loaded.entries)) == (1, 1, [b"a"])


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_a_group_is_one_commit_under_every_policy(
    data_dir: Path, open_storage: OpenStorage, policy: FsyncPolicy
) -> None:
    """`always` used to commit (and fsync) each update of a turn on its
    own, up to 1,000 back to back; now a group is one transaction for every
    policy, and its timing is counted once."""
    s = open_storage(data_dir, fsync=policy)
    before = s.timing.commits
    s.append([upd(b"/k/%d" % i, i + 1) for i in range(300)], term=1, at=1.0, keep_from=1)
    assert s.timing.commits == before + 1
    assert s.timing.write_s > 0 and s.timing.sync_s > 0
    assert s.timing.max_s >= s.timing.sync_s / s.timing.commits
    s.close()
    loaded = open_storage(data_dir).load()
    assert loaded.sequence == 300 and len(loaded.entries) == 300
    assert [int.from_bytes(u[0][1], "big") for u in loaded.history] == list(range(1, 301))


def test_the_log_is_trimmed_once_keep_from_moved_trim_every(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """A trim every commit dirtied the log's first page each time
    (5.4 WAL pages per single-update commit instead of 4.1); the log is now
    trimmed when keep_from has moved TRIM_EVERY since the last trim."""
    from clone.storage.db import TRIM_EVERY

    s = open_storage(data_dir)
    s.append([upd(b"k", i) for i in range(1, 11)], term=1, at=0.0, keep_from=5)  # first: trims
    seq = 10
    for keep in range(6, 6 + TRIM_EVERY - 1):  # keep_from creeps up: no trim
        seq += 1
        s.append([upd(b"k", seq)], term=1, at=0.0, keep_from=keep)
    first = int.from_bytes(s.load().history[0][0][1], "big")
    assert first == 5
    seq += 1
    s.append([upd(b"k", seq)], term=1, at=0.0, keep_from=5 + TRIM_EVERY)  # moved far enough
    first = int.from_bytes(s.load().history[0][0][1], "big")
    assert first == 5 + TRIM_EVERY


def test_the_log_is_trimmed_once_trim_every_bytes_went_into_it(
    data_dir: Path, open_storage: OpenStorage
) -> None:
    """A count alone let 1,024 large updates pile up in the log (512 KB
    values: 358 MB of rows beyond a 64 MiB history): 16 MiB written since the
    last trim trims too, however few updates that was."""
    from clone.storage.db import TRIM_EVERY, TRIM_EVERY_BYTES

    s = open_storage(data_dir)
    s.append([upd(b"k", 1)], term=1, at=0.0, keep_from=1)  # the first always trims
    big = b"x" * (512 * 1024)
    per_trim = TRIM_EVERY_BYTES // len(big)
    assert per_trim < TRIM_EVERY
    for seq in range(2, 2 + per_trim - 1):  # under the bytes: no trim
        s.append([upd(b"k", seq, big)], term=1, at=0.0, keep_from=seq - 1)
    assert int.from_bytes(s.load().history[0][0][1], "big") == 1
    seq = 1 + per_trim
    s.append([upd(b"k", seq, big)], term=1, at=0.0, keep_from=seq - 1)  # 16 MiB: trims
    assert int.from_bytes(s.load().history[0][0][1], "big") == seq - 1


def test_the_writer_keeps_a_small_page_cache(data_dir: Path, open_storage: OpenStorage) -> None:
    """The reactor's connection only writes (the map is served from memory): its
    page cache is PAGE_CACHE_KIB, not SQLite's 2 MB, which was a fifth of a
    durable server's memory over key+value at 100,000 keys; a write that needs
    a page it no longer holds still finds it (here: every key written again)."""
    s = open_storage(data_dir)
    conn = s._live()
    assert conn.execute("PRAGMA cache_size").fetchone()[0] == -PAGE_CACHE_KIB
    n = 5_000  # about 1.5 MB of rows: more pages than the cache holds
    s.append([upd(b"/k/%05d" % i, i + 1, b"v" * 200) for i in range(n)], term=1, at=1.0)
    s.append([upd(b"/k/%05d" % i, n + i + 1, b"w" * 200) for i in range(n)], term=1, at=2.0)
    s.close()
    loaded = open_storage(data_dir).load()
    assert len(loaded.entries) == n and loaded.sequence == 2 * n
    assert {entry[3] for entry in loaded.entries.values()} == {b"w" * 200}
