"""The database format, version 2: tables, header marks, and the checks on open.

How this works: a Clone database carries ``application_id = 0x434C4F4E``
("CLON") and ``user_version = FORMAT_VERSION`` in its SQLite header, so that a
file written by something else, or by another format version, is refused with a
message instead of being read as an empty state.  :func:`verify` runs those
checks plus ``PRAGMA quick_check``; :func:`translate` turns a ``sqlite3`` error
into one of our :class:`~clone.errors.StorageError` kinds naming the path and
what to do.  The same format serves the live data directory (``clone.db``) and a
standalone state file written by ``clone backup``.

Versions: 1 (release 0.1.0) is ``kv``, ``log`` and ``meta``; 2 (release 0.2.0)
adds ``conflicts`` (split-brain writes set aside) and a ``release`` row in
``meta`` naming the release that last opened the file for writing.  A reader
that only reads ``kv``/``log``/``meta`` (``--restore``'s check, the pipeline)
accepts every version from :data:`OLDEST_FORMAT` up; a file newer than
:data:`FORMAT_VERSION` is refused with both versions named.  Upgrading a file is
:mod:`clone.storage.migrations`' business.
"""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from clone.errors import DataDirCorrupt, DataDirIncompatible, StorageBusy, StorageError
from clone.release import RELEASE

__all__ = [
    "APPLICATION_ID",
    "DATA_FILE",
    "Entry",
    "CONFLICTS_SQL",
    "FORMAT_VERSION",
    "KV_COLUMNS",
    "OLDEST_FORMAT",
    "RESTORE_HINT",
    "create_schema",
    "connect_readonly",
    "kv_table_sql",
    "precheck_file",
    "check_version",
    "read_position",
    "translate",
    "verify",
]

#: One stored key's frames after the key: sequence (8 bytes, big-endian), uuid,
#: properties, body -- as the server's store holds them (clone.server.store.Entry,
#: not imported: storage sits below the server).
Entry = tuple[bytes, bytes, bytes, bytes]

#: The database file inside a data directory.
DATA_FILE = "clone.db"
APPLICATION_ID = 0x434C4F4E
#: The format this release writes (``PRAGMA user_version``).
FORMAT_VERSION = 2
#: The oldest format this release can migrate from (and read).
OLDEST_FORMAT = 1
RESTORE_HINT = "move it aside or restore from a backup: clone-server --restore FILE"

_SQLITE_MAGIC = b"SQLite format 3\x00"
_HEADER_SIZE = 100

#: Columns of ``kv`` (and ``kv_staging``) in the order of a stored row: key, then an Entry.
KV_COLUMNS = "key, seq, uuid, props, body"


def kv_table_sql(name: str) -> str:
    """DDL of the state table; WITHOUT ROWID since the key is the only lookup."""
    return (
        f"CREATE TABLE {name} (key BLOB PRIMARY KEY, seq BLOB, uuid BLOB, "
        "props BLOB, body BLOB) WITHOUT ROWID"
    )


_LOG_SQL = (
    "CREATE TABLE log (seq INTEGER PRIMARY KEY, key BLOB, uuid BLOB, props BLOB, "
    "body BLOB, term INTEGER, at REAL)"
)
_META_SQL = "CREATE TABLE meta (name TEXT PRIMARY KEY, value)"
#: Format 2: a split-brain write that lost (and the one that won), kept for an operator.
CONFLICTS_SQL = (
    "CREATE TABLE conflicts (id INTEGER PRIMARY KEY, key BLOB NOT NULL, reason TEXT NOT NULL, "
    "loser_uuid BLOB, loser_props BLOB, loser_body BLOB, loser_at REAL, loser_term INTEGER, "
    "winner_seq INTEGER, winner_uuid BLOB, winner_props BLOB, winner_body BLOB, "
    "winner_at REAL, recorded REAL NOT NULL, resolution TEXT)"
)
#: The tables each format has (every later one keeps the earlier ones').
_TABLES = {1: {"kv", "log", "meta"}, 2: {"kv", "log", "meta", "conflicts"}}


def create_schema(conn: sqlite3.Connection, *, sequence: int = 0, term: int = 0) -> None:
    """Write the tables and header marks into an empty database (caller commits)."""
    conn.execute(f"PRAGMA application_id = {APPLICATION_ID}")
    conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
    conn.execute(kv_table_sql("kv"))
    conn.execute(_LOG_SQL)
    conn.execute(_META_SQL)
    conn.execute(CONFLICTS_SQL)
    conn.executemany(
        "INSERT INTO meta (name, value) VALUES (?, ?)",
        [("created", time.time()), ("sequence", sequence), ("term", term),
         ("release", RELEASE)],
    )


def translate(exc: sqlite3.Error | OverflowError, path: Path, doing: str) -> StorageError:
    """Our error for a ``sqlite3`` error met while ``doing`` something with ``path``.

    ``OverflowError`` too: ``sqlite3`` raises it, not one of its own errors, for
    an int that does not fit an SQLite INTEGER; to the server it is a failed
    write like any other, which must stop it rather than confirm from memory.
    """
    name = getattr(exc, "sqlite_errorname", "")
    text = str(exc)
    if (
        name.startswith(("SQLITE_NOTADB", "SQLITE_CORRUPT"))
        or "malformed" in text
        or "not a database" in text
    ):
        return DataDirCorrupt(
            f"{path} is damaged or not a database ({exc}) while {doing}: {RESTORE_HINT}"
        )
    if name == "SQLITE_FULL":
        return StorageError(f"the disk holding {path} is full ({exc}) while {doing}: free space")
    if name.startswith("SQLITE_BUSY"):
        return StorageBusy(f"{doing} {path} failed: {exc} ({name})")
    return StorageError(f"{doing} {path} failed: {exc} ({name or type(exc).__name__})")


def precheck_file(path: Path) -> None:
    """Refuse, before SQLite sees it, a file that cannot be a database at all.

    SQLite treats an empty file as a new empty database; for us an existing but
    empty ``clone.db`` means lost data, never a fresh start.
    """
    try:
        with open(path, "rb") as f:
            header = f.read(_HEADER_SIZE)
    except FileNotFoundError:
        raise StorageError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise StorageError(f"{path} is a directory, not a database file") from None
    except OSError as exc:
        raise StorageError(
            f"cannot read {path}: {exc.strerror}; check its owner and mode"
        ) from exc
    if len(header) < _HEADER_SIZE or not header.startswith(_SQLITE_MAGIC):
        size = os.path.getsize(path)
        raise DataDirCorrupt(
            f"{path} is not a database ({size} bytes, no SQLite header): {RESTORE_HINT}"
        )


def check_version(path: Path, app: int, version: int) -> None:
    """Refuse a file that is not ours, or of a format this release cannot read or migrate."""
    if app != APPLICATION_ID:
        raise DataDirIncompatible(
            f"{path} is not a Clone data directory's database (application_id "
            f"{app:#x}, expected {APPLICATION_ID:#x}): point the server at its own "
            "data directory, or move this file aside"
        )
    if version > FORMAT_VERSION:
        raise DataDirIncompatible(
            f"{path} has format version {version}, written by a newer Clone release; "
            f"this release ({RELEASE}) reads format versions {OLDEST_FORMAT} to "
            f"{FORMAT_VERSION}: run a release that reads format {version}, or, to roll "
            f"back, the copy the upgrade kept ({DATA_FILE}.v{FORMAT_VERSION} or older "
            f"beside it), or {RESTORE_HINT}"
        )
    if version < OLDEST_FORMAT:
        raise DataDirIncompatible(
            f"{path} has format version {version}, which no Clone release wrote "
            f"(this release, {RELEASE}, reads {OLDEST_FORMAT} to {FORMAT_VERSION}): "
            f"{RESTORE_HINT}"
        )


def verify(conn: sqlite3.Connection, path: Path, *, current: bool = False) -> int:
    """Check the header marks, the tables and ``quick_check``; return the format version.

    ``current``: only :data:`FORMAT_VERSION` will do (a file about to be
    written); otherwise any version this release can read is accepted.
    """
    try:
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        check_version(path, app, version)
        if current and version != FORMAT_VERSION:
            raise DataDirIncompatible(
                f"{path} has format version {version}, not {FORMAT_VERSION}: it must be "
                f"migrated first (clone.storage.migrations), or {RESTORE_HINT}"
            )
        problems = [row[0] for row in conn.execute("PRAGMA quick_check")]
        if problems != ["ok"]:
            raise DataDirCorrupt(
                f"{path} failed its integrity check ({'; '.join(problems[:3])}): {RESTORE_HINT}"
            )
        tables = {
            row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        missing = _TABLES[version] - tables
        if missing:
            raise DataDirCorrupt(
                f"{path} lacks the table(s) {', '.join(sorted(missing))} of format "
                f"{version}: {RESTORE_HINT}"
            )
        read_position(conn, path)
    except sqlite3.Error as exc:
        raise translate(exc, path, "checking") from exc
    return int(version)


def read_position(conn: sqlite3.Connection, path: Path) -> tuple[int, int]:
    """The (sequence, term) recorded in ``meta``."""
    meta = dict(conn.execute("SELECT name, value FROM meta WHERE name IN ('sequence', 'term')"))
    sequence, term = meta.get("sequence"), meta.get("term")
    if not isinstance(sequence, int) or not isinstance(term, int):
        raise DataDirCorrupt(
            f"{path} has no valid sequence/term in its meta table "
            f"(sequence={sequence!r}, term={term!r}): {RESTORE_HINT}"
        )
    return sequence, term


def connect_readonly(path: Path, *, precheck: bool = True) -> sqlite3.Connection:
    """A connection to ``path`` that never writes to it (a check or a copy).

    Not ``mode=ro``: a read-only connection to a WAL-mode file leaves behind the
    ``-wal``/``-shm`` files it had to create; ``query_only`` stops our writes
    while SQLite may still tidy those away on close.

    ``precheck=False`` for a database this process already has open through
    SQLite (``Storage.backup_to``): :func:`precheck_file` opens and closes the
    file, and closing any descriptor of a file drops every POSIX lock the
    process holds on it, SQLite's included.  Without its shared lock, another
    process's connection closing as "the last one" checkpoints and deletes the
    ``-wal`` the running server still appends to: every commit after that is
    lost at the next start (``tests/storage/test_commit_mark.py``).
    """
    if precheck:
        precheck_file(path)
    try:
        conn = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error as exc:
        raise translate(exc, path, "opening") from exc
    try:
        conn.execute("PRAGMA query_only = 1")
    except sqlite3.Error as exc:
        conn.close()
        raise translate(exc, path, "opening") from exc
    return conn
