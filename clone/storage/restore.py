"""``clone-server --restore FILE``: put a state file into a data directory.

The file is checked before anything changes, and the old database's commit
mark (``COMMITTED``) is removed: the restored state may be older, by choice.
The old database stays reachable the whole time: it is hard-linked to ``replaced-<UTC time>.db``
(its WAL moved along), and only then is the restored copy renamed over
``clone.db``, so a crash at any point leaves a ``clone.db`` -- never none, which
would start the server empty.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from clone.errors import StorageError
from clone.storage.copying import copy_database, temp_path
from clone.storage.files import fsync_dir, replace_durably
from clone.storage.lock import DirLock
from clone.storage.mark import MARK_FILE
from clone.storage.schema import DATA_FILE
from clone.storage.statefile import check_state_file

__all__ = ["restore_into"]

logger = logging.getLogger(__name__)

_SIDE_FILES = ("-wal", "-shm")


def restore_into(
    data_dir: str | os.PathLike[str], backup_file: str | os.PathLike[str]
) -> Path | None:
    """Make ``backup_file`` the database of ``data_dir``; return where the old one went."""
    source = Path(backup_file)
    keys, sequence, term = check_state_file(source)
    directory = Path(data_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorageError(f"cannot create data directory {directory}: {exc.strerror}") from exc
    db = directory / DATA_FILE
    staged = directory / (DATA_FILE + ".restore")
    lock = DirLock(directory)
    lock.acquire()
    try:
        if db.exists():
            lock.hold_database(db)  # a server whose LOCK file was deleted still refuses us
        copy_database(source, staged)
        # The old database's commit mark (clone.storage.mark) would refuse an
        # older restored state: the operator chose it.  Gone before the swap,
        # so a crash in between leaves the old database without a mark.
        mark = directory / MARK_FILE
        if mark.exists():
            mark.unlink()
            fsync_dir(directory)
        aside = _set_aside(db) if db.exists() else None
        replace_durably(staged, db)
        logger.info("restored %s into %s: %d keys, sequence %d, term %d%s",
                    source, db, keys, sequence, term,
                    f" (the old database is now {aside})" if aside else "")
        return aside
    except OSError as exc:
        raise StorageError(f"restoring {source} into {directory} failed: {exc}") from exc
    finally:
        staged.unlink(missing_ok=True)
        temp_path(staged).unlink(missing_ok=True)
        lock.release()


def _set_aside(db: Path) -> Path:
    """Link the old database to a ``replaced-*`` name and move its WAL with it."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    aside = db.with_name(f"replaced-{stamp}.db")
    n = 1
    while aside.exists():
        n += 1
        aside = db.with_name(f"replaced-{stamp}-{n}.db")
    os.link(db, aside)
    for suffix in _SIDE_FILES:
        side = db.with_name(db.name + suffix)
        if side.exists():
            # The WAL must leave with its database: replayed onto the restored
            # file it would corrupt it.
            os.replace(side, aside.with_name(aside.name + suffix))
    fsync_dir(db.parent)
    return aside
