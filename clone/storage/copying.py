"""Copying a database file whole: ``backup_to`` and ``restore_into`` both do it.

SQLite's online backup API, in one step, copies a consistent snapshot even
while the live server commits (in WAL mode a reader never blocks the writer).
The copy is switched to a rollback journal so it is one self-contained file,
then fsynced and renamed over the target, so the target is never half written.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from clone.errors import StorageError
from clone.storage.files import replace_durably
from clone.storage.schema import connect_readonly, translate

__all__ = ["copy_database", "temp_path"]


def temp_path(target: Path) -> Path:
    """Where ``target`` is built before it is renamed into place."""
    return target.with_name(target.name + ".tmp")


def copy_database(source: Path, target: Path, *, live: bool = False) -> None:
    """Copy the database ``source`` to ``target`` atomically and durably.

    ``live``: this process has ``source`` open (a running Storage), so no
    descriptor of it may be opened and closed outside SQLite
    (:func:`~clone.storage.schema.connect_readonly`).
    """
    tmp = temp_path(target)
    try:
        tmp.unlink(missing_ok=True)
        src = connect_readonly(source, precheck=not live)
        try:
            dst = sqlite3.connect(tmp, isolation_level=None)
            try:
                src.backup(dst)  # pages=-1: one step, one consistent snapshot
                dst.execute("PRAGMA journal_mode = DELETE")
            finally:
                dst.close()
        finally:
            src.close()
        replace_durably(tmp, target)
    except sqlite3.Error as exc:
        tmp.unlink(missing_ok=True)
        raise translate(exc, source, f"copying to {target}") from exc
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(
            f"cannot write {target}: {exc.strerror}; check the path, free space and modes"
        ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
