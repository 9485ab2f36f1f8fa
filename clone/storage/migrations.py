"""Upgrading a database file in place, one format version at a time.

How this works: every change of the format is a :class:`Migration` from
version N to N+1, listed in :data:`MIGRATIONS`, so a file of any earlier
version reaches :data:`~clone.storage.schema.FORMAT_VERSION` by running the
steps in turn.  :func:`migrate_file` runs at open, under the data directory's
lock and before anything else writes:

1. a file of the current version is left alone; one newer than this release
   knows is refused with both versions named (never read as if it were ours);
2. an older one is first copied whole beside itself (``clone.db.v1`` for a
   format-1 file; SQLite's backup API, so a WAL still holding commits is
   copied consistently), and the copy is fsynced before anything changes --
   that copy is the rollback, since the older release refuses the migrated
   file;
3. then every step and the new ``user_version`` are applied in one
   transaction: a crash half-way leaves the old version, and the next start
   migrates again.

A step only adds (tables, ``meta`` rows): what the older release wrote stays
readable as it was.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from clone.errors import StorageError
from clone.release import RELEASE
from clone.storage.copying import copy_database
from clone.storage.schema import (
    CONFLICTS_SQL,
    FORMAT_VERSION,
    OLDEST_FORMAT,
    check_version,
    precheck_file,
    translate,
)

__all__ = ["MIGRATIONS", "Migration", "Migrated", "kept_copy_path", "migrate_file", "steps_from"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Migration:
    """One step of the format: from ``version`` to ``version + 1``."""

    version: int
    #: What the step changes, for the log.
    summary: str
    #: Applies the step inside the caller's transaction.
    apply: Callable[[sqlite3.Connection], None]


@dataclass(frozen=True, slots=True)
class Migrated:
    """What :func:`migrate_file` did to a file of an older format."""

    from_version: int
    to_version: int
    #: The untouched copy of the file as it was (the rollback).
    kept: Path


def _v1_to_v2(conn: sqlite3.Connection) -> None:
    conn.execute(CONFLICTS_SQL)
    conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('release', ?)", (RELEASE,))


#: Every step, keyed by the version it starts from.
MIGRATIONS: dict[int, Migration] = {
    1: Migration(1, "add the conflicts table and meta's release row", _v1_to_v2),
}


def steps_from(version: int) -> list[Migration]:
    """The steps that take a file of ``version`` to :data:`FORMAT_VERSION`, in order."""
    if version < OLDEST_FORMAT or version > FORMAT_VERSION:
        raise ValueError(f"no migration path from format {version} to {FORMAT_VERSION}")
    return [MIGRATIONS[v] for v in range(version, FORMAT_VERSION)]


def kept_copy_path(db_path: Path, version: int) -> Path:
    """Where the copy of a format-``version`` file goes: ``clone.db.v1``, never over one.

    An earlier copy (from an upgrade rolled back and tried again) is kept: the
    new one gets a numbered name instead.
    """
    base = db_path.with_name(f"{db_path.name}.v{version}")
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}.{n}")
    return path


def migrate_file(db_path: Path, *, timeout: float = 2.0) -> Migrated | None:
    """Bring ``db_path`` to :data:`FORMAT_VERSION`; None if it already was.

    The caller holds the data directory's lock (or owns the file alone).  Raises
    :class:`~clone.errors.DataDirIncompatible` for a newer (or foreign) file
    and another :class:`~clone.errors.StorageError` kind for the rest.
    """
    precheck_file(db_path)
    version = _read_version(db_path, timeout)
    if version == FORMAT_VERSION:
        return None
    steps = steps_from(version)
    kept = kept_copy_path(db_path, version)
    copy_database(db_path, kept)
    logger.info("format %d file %s: kept a copy as %s before migrating it to format %d "
                "(release %s); release %s cannot open the migrated file, the copy rolls back",
                version, db_path, kept, FORMAT_VERSION, RELEASE, _release_of(version))
    started = time.monotonic()
    try:
        _apply(db_path, version, steps, timeout)
    except BaseException:
        # The file is still at its old format: the copy is of no use, and a start
        # that fails again must not leave one more behind each time.
        kept.unlink(missing_ok=True)
        logger.error("migrating %s from format %d failed; it is unchanged and the copy "
                     "%s was removed", db_path, version, kept)
        raise
    logger.info("migrated %s from format %d to %d in %.3f s (the old file is %s)",
                db_path, version, FORMAT_VERSION, time.monotonic() - started, kept)
    return Migrated(version, FORMAT_VERSION, kept)


def _apply(db_path: Path, version: int, steps: list[Migration], timeout: float) -> None:
    """Every step and the new ``user_version`` in one transaction."""
    try:
        conn = sqlite3.connect(db_path, isolation_level=None, timeout=timeout)
    except sqlite3.Error as exc:
        raise translate(exc, db_path, "opening to migrate") from exc
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Read again inside the transaction: the version it changes.
            now = conn.execute("PRAGMA user_version").fetchone()[0]
            if now != version:
                raise StorageError(f"{db_path} changed format ({version} -> {now}) while "
                                   "being migrated: is another process writing it?")
            for step in steps:
                step.apply(conn)
                logger.info("migrating %s: format %d -> %d: %s",
                            db_path, step.version, step.version + 1, step.summary)
            conn.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES ('migrated', ?)",
                (f"format {version} -> {FORMAT_VERSION} by release {RELEASE} at "
                 f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",),
            )
            conn.execute(f"PRAGMA user_version = {FORMAT_VERSION}")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        raise translate(exc, db_path, f"migrating (format {version} -> {FORMAT_VERSION})") from exc
    finally:
        conn.close()


def _read_version(db_path: Path, timeout: float) -> int:
    """The file's format version, after checking it is ours and not too new."""
    try:
        conn = sqlite3.connect(db_path, isolation_level=None, timeout=timeout)
    except sqlite3.Error as exc:
        raise translate(exc, db_path, "opening") from exc
    try:
        conn.execute("PRAGMA query_only = 1")
        app = conn.execute("PRAGMA application_id").fetchone()[0]
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    except sqlite3.Error as exc:
        raise translate(exc, db_path, "reading the format of") from exc
    finally:
        conn.close()
    check_version(db_path, app, version)
    return int(version)


#: The release that wrote each older format, for the log and the messages.
_RELEASES = {1: "0.1.0"}


def _release_of(version: int) -> str:
    return _RELEASES.get(version, f"the one writing format {version}")
