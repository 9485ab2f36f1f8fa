"""Format migrations: a release-0.1.0 data directory under this release's code.

The fixture (tests/fixtures/format1, see its README) was written by a real
0.1.0 server; every test copies it first, since opening it migrates it.
"""

from __future__ import annotations

import configparser
import json
import logging
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest

from clone import Clone
from clone.errors import DataDirIncompatible
from clone.release import RELEASE
from clone.storage import DATA_FILE, Storage, check_state_file, migrations, restore_into
from clone.storage.migrations import MIGRATIONS, Migration, kept_copy_path, migrate_file, steps_from
from clone.storage.schema import CONFLICTS_SQL, FORMAT_VERSION, OLDEST_FORMAT
from tests.storage.conftest import OpenStorage, upd
from tests.support.servers import Servers
from tests.support.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "format1"
EXPECTED: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())


def _format1_dir(tmp_path: Path) -> Path:
    """A copy of the 0.1.0 data directory (the committed one is never opened)."""
    target = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", target)
    return target


def _user_version(db: Path) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def _tables(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    finally:
        conn.close()


def _props(raw: bytes) -> dict[str, str]:
    text = raw.decode()
    return dict(line.split("=", 1) for line in text.splitlines() if line)


def test_the_version_in_setup_cfg_is_the_release() -> None:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["version"] == RELEASE


def test_every_older_format_has_a_path_to_the_current_one() -> None:
    assert sorted(MIGRATIONS) == list(range(OLDEST_FORMAT, FORMAT_VERSION))
    for version, step in MIGRATIONS.items():
        assert step.version == version and step.summary
    assert [s.version for s in steps_from(OLDEST_FORMAT)] == list(range(OLDEST_FORMAT,
                                                                         FORMAT_VERSION))
    assert steps_from(FORMAT_VERSION) == []
    for bad in (0, FORMAT_VERSION + 1):
        with pytest.raises(ValueError, match="no migration path"):
            steps_from(bad)


def test_format_2_conflicts_table_is_the_agreed_ddl() -> None:
    # The issue-32 work writes this table: the DDL is a contract between branches.
    assert CONFLICTS_SQL == (
        "CREATE TABLE conflicts (id INTEGER PRIMARY KEY, key BLOB NOT NULL, reason TEXT NOT "
        "NULL, loser_uuid BLOB, loser_props BLOB, loser_body BLOB, loser_at REAL, loser_term "
        "INTEGER, winner_seq INTEGER, winner_uuid BLOB, winner_props BLOB, winner_body BLOB, "
        "winner_at REAL, recorded REAL NOT NULL, resolution TEXT)"
    )


def test_a_new_data_directory_is_created_at_the_current_format(
    tmp_path: Path, open_storage: OpenStorage
) -> None:
    storage = open_storage(tmp_path / "new")
    db = tmp_path / "new" / DATA_FILE
    assert _user_version(db) == FORMAT_VERSION
    assert {"kv", "log", "meta", "conflicts"} <= _tables(db)
    conn = sqlite3.connect(db)
    release = conn.execute("SELECT value FROM meta WHERE name = 'release'").fetchone()[0]
    conn.close()
    assert release == RELEASE
    assert not list((tmp_path / "new").glob(f"{DATA_FILE}.v*"))  # nothing to migrate
    storage.close()


def test_format1_fixture_opens_with_every_key_sequence_ttl_and_lease(
    tmp_path: Path, open_storage: OpenStorage, caplog: pytest.LogCaptureFixture
) -> None:
    data = _format1_dir(tmp_path)
    original = (data / DATA_FILE).read_bytes()
    assert _user_version(data / DATA_FILE) == 1
    caplog.set_level(logging.INFO, logger="clone.storage")

    storage = open_storage(data)
    loaded = storage.load()

    want = EXPECTED["keys"]
    assert loaded.sequence == EXPECTED["sequence"] == 53
    assert storage.sequence == 53 and loaded.term == 0
    assert {k.decode() for k in loaded.entries} == set(want)
    for key, (seq, _uuid, props, body) in loaded.entries.items():
        w = want[key.decode()]
        assert body.hex() == w["value"], key
        assert int.from_bytes(seq, "big") == w["sequence"], key
        assert _props(props) == w["properties"], key
    # The TTL key keeps its absolute deadline, the lease its key and its bound key.
    session = _props(loaded.entries[b"/ephemeral/session"][2])
    assert session["ttl"] == "31536000" and float(session["expires"]) > 1.79e9
    lease_key = f"/_clone/lease/{EXPECTED['lease']}".encode()
    assert loaded.entries[lease_key][3] == b"ttl=31536000.0"
    assert _props(loaded.entries[b"/locks/leader"][2]) == {"lease": EXPECTED["lease"]}
    # The log (every update of the run, deletes included) came along too.
    assert [int.from_bytes(u[0][1], "big") for u in loaded.history] == list(range(1, 54))
    assert sum(1 for u in loaded.history if not u[0][4]) == 8

    # Migrated: the file is format 2 now, and the old one is kept, byte for byte.
    db = data / DATA_FILE
    assert _user_version(db) == FORMAT_VERSION and "conflicts" in _tables(db)
    kept = data / f"{DATA_FILE}.v1"
    assert kept.read_bytes() == original or _user_version(kept) == 1
    assert _user_version(kept) == 1
    assert check_state_file(kept) == (36, 53, 0)
    assert str(kept) in caplog.text and "migrated" in caplog.text
    storage.close()

    # Opening again migrates nothing and keeps no second copy.
    caplog.clear()
    open_storage(data).close()
    assert "migrat" not in caplog.text
    assert sorted(p.name for p in data.glob(f"{DATA_FILE}.v*")) == [f"{DATA_FILE}.v1"]


def test_a_newer_format_is_refused_with_both_versions_named(tmp_path: Path) -> None:
    data = _format1_dir(tmp_path)
    db = data / DATA_FILE
    conn = sqlite3.connect(db)
    conn.execute(f"PRAGMA user_version = {FORMAT_VERSION + 1}")
    conn.commit()
    conn.close()
    before = db.read_bytes()
    with pytest.raises(DataDirIncompatible) as info:
        Storage.open(data)
    text = str(info.value)
    assert f"format version {FORMAT_VERSION + 1}" in text
    assert f"reads format versions {OLDEST_FORMAT} to {FORMAT_VERSION}" in text
    assert RELEASE in text and str(db) in text
    assert db.read_bytes() == before  # untouched, no copy made
    assert not list(data.glob(f"{DATA_FILE}.v*"))
    # The same rule for a state file given to --restore.
    with pytest.raises(DataDirIncompatible, match=f"format version {FORMAT_VERSION + 1}"):
        restore_into(tmp_path / "other", db)
    assert not (tmp_path / "other" / DATA_FILE).exists()


def test_a_format1_state_file_is_restored_then_migrated_at_open(
    tmp_path: Path, open_storage: OpenStorage
) -> None:
    state = _format1_dir(tmp_path) / DATA_FILE
    assert check_state_file(state) == (36, 53, 0)  # an older format is readable
    restore_into(tmp_path / "restored", state)
    storage = open_storage(tmp_path / "restored")
    assert len(storage.load().entries) == 36
    assert (tmp_path / "restored" / f"{DATA_FILE}.v1").exists()
    assert _user_version(tmp_path / "restored" / DATA_FILE) == FORMAT_VERSION


def test_a_failed_step_leaves_the_file_at_its_old_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _format1_dir(tmp_path)
    db = data / DATA_FILE

    def half_done(conn: sqlite3.Connection) -> None:
        conn.execute(CONFLICTS_SQL)
        raise RuntimeError("power cut")

    monkeypatch.setitem(MIGRATIONS, 1, Migration(1, "fails half-way", half_done))
    with pytest.raises(RuntimeError, match="power cut"):
        migrate_file(db)
    assert _user_version(db) == 1 and "conflicts" not in _tables(db)  # one transaction
    assert not list(data.glob(f"{DATA_FILE}.v*"))  # a useless copy is not left behind
    monkeypatch.undo()
    # The next start migrates.
    done = migrate_file(db)
    assert done is not None and done.kept == data / f"{DATA_FILE}.v1"
    assert _user_version(db) == FORMAT_VERSION
    assert migrate_file(db) is None


def test_the_kept_copy_holds_commits_still_in_the_wal(tmp_path: Path) -> None:
    data = _format1_dir(tmp_path)
    db = data / DATA_FILE
    writer = sqlite3.connect(db, isolation_level=None)
    try:
        writer.execute("PRAGMA journal_mode = WAL")
        writer.execute("PRAGMA wal_autocheckpoint = 0")
        writer.execute("INSERT INTO kv VALUES (?, ?, ?, ?, ?)",
                       (b"/only/in/wal", (54).to_bytes(8, "big"), b"u" * 16, b"", b"v"))
        writer.execute("UPDATE meta SET value = 54 WHERE name = 'sequence'")
        assert (data / f"{DATA_FILE}-wal").stat().st_size > 0
        done = migrate_file(db)
    finally:
        writer.close()
    assert done is not None
    assert check_state_file(done.kept) == (37, 54, 0)
    assert not Path(f"{done.kept}-wal").exists()  # one self-contained file


def test_kept_copy_path_never_overwrites(tmp_path: Path) -> None:
    db = tmp_path / DATA_FILE
    assert kept_copy_path(db, 1) == tmp_path / f"{DATA_FILE}.v1"
    (tmp_path / f"{DATA_FILE}.v1").write_bytes(b"x")
    (tmp_path / f"{DATA_FILE}.v1.2").write_bytes(b"x")
    assert kept_copy_path(db, 1) == tmp_path / f"{DATA_FILE}.v1.3"


def test_migrated_storage_keeps_writing(tmp_path: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(_format1_dir(tmp_path))
    storage.append([upd(b"/after/upgrade", 54)], term=1, at=time.time())
    storage.close()
    again = open_storage(tmp_path / "data").load()
    assert again.sequence == 54 and b"/after/upgrade" in again.entries


def test_migration_names_the_release_that_wrote_the_old_format() -> None:
    assert migrations._release_of(1) == "0.1.0"


def test_a_new_server_serves_a_format1_data_directory(tmp_path: Path, servers: Servers) -> None:
    data = _format1_dir(tmp_path)
    server = servers.standalone("--data-dir", str(data))
    server.wait_log(f"{DATA_FILE}.v1")
    server.wait_log(f"release {RELEASE}, data format {FORMAT_VERSION}")  # the start-up line
    client = Clone(servers=[f"tcp://127.0.0.1:{server.port}"])
    try:
        client.wait_synced(timeout=30)
        assert client.status().sequence == 53
        got = {key: client.entry(key) for key, _ in client.items()}
        want = dict(EXPECTED["keys"])
        session = want["/ephemeral/session"]
        if float(session["properties"]["expires"]) <= time.time():
            want.pop("/ephemeral/session")  # the fixture's year is over: expired, as it must
        assert set(got) == set(want)
        for key, entry in got.items():
            assert entry is not None
            assert (entry.value or b"").hex() == want[key]["value"], key
            assert entry.sequence == want[key]["sequence"], key
            assert dict(entry.properties) == want[key]["properties"], key
        # The lease is live again on the new server: its bound key is still there
        # after a keepalive window, and writes continue from sequence 53.
        assert client.set("/after/upgrade", "yes", wait=True) == 54
        eventually(lambda: client.get("/after/upgrade") == b"yes", timeout=10)
    finally:
        client.close()
