"""The data directory's lock: one server process per directory.

How this works: ``DIR/LOCK`` is opened and locked with ``flock(LOCK_EX|LOCK_NB)``.
The kernel drops the lock when the holder's descriptor is closed, also when the
process is killed, so a stale lock file never needs cleaning up.  The holder
writes its pid into the file so that the refusal can say who holds it.  A flock
belongs to an open file description, so a second :class:`DirLock` on the same
directory fails within one process too.

The ``LOCK`` file alone is not enough: deleting it (an operator tidying up, a
script's ``rm``) lets a second server create a new ``LOCK``, lock that and open
the same database.  So the holder also takes ``flock`` on the database file
itself (:meth:`DirLock.hold_database`), a lock that lives on the database's
inode: nothing short of replacing the database can drop it.  SQLite's own locks
are POSIX ``fcntl`` locks, which on Linux are independent of ``flock``, so the
two never interfere, and SQLite closing its descriptors does not drop ours.
"""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from clone.errors import DataDirLocked, StorageError

__all__ = ["LOCK_FILE", "DirLock"]

logger = logging.getLogger(__name__)

LOCK_FILE = "LOCK"


def _holder(fd: int) -> str:
    """The pid written by the holder, or ``"unknown"`` (it may not have written it yet)."""
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


class DirLock:
    """An exclusive lock on a data directory, held from :meth:`acquire` to :meth:`release`."""

    __slots__ = ("_db_fd", "_fd", "path")

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None
        self._db_fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`DataDirLocked` naming the holder's pid."""
        if self._fd is not None:
            raise ValueError(f"{self.path} is already held by this DirLock")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(
                f"cannot open the lock file {self.path}: {exc.strerror}; "
                "check that the data directory exists and is writable by this user"
            ) from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _holder(fd)
            os.close(fd)
            raise DataDirLocked(
                f"data directory {self.path.parent} is in use by another server "
                f"(pid {pid} holds {self.path}): stop that server, or give this one "
                "another --data-dir"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot lock {self.path}: {exc.strerror}") from exc
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot write our pid into {self.path}: {exc.strerror}") from exc
        self._fd = fd
        logger.debug("locked %s (pid %d)", self.path, os.getpid())

    def hold_database(self, db_path: Path) -> None:
        """Also lock the database file ``db_path`` itself; raise :class:`DataDirLocked` if held.

        Called once the database exists, after :meth:`acquire`.  Calling it again
        (the file was replaced by a rename) moves the hold to the new file.
        """
        if self._fd is None:
            raise ValueError(f"hold_database() before acquire() of {self.path}")
        try:
            fd = os.open(db_path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise StorageError(f"cannot open {db_path} to lock it: {exc.strerror}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DataDirLocked(
                f"database {db_path} is in use by another process (its {LOCK_FILE} file "
                "was probably deleted while a server held it): stop that server, or give "
                "this one another --data-dir"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot lock {db_path}: {exc.strerror}") from exc
        old, self._db_fd = self._db_fd, fd
        if old is not None:
            os.close(old)

    def release(self) -> None:
        """Drop the lock; idempotent.  The file stays: deleting it would race a new holder."""
        db_fd, self._db_fd = self._db_fd, None
        if db_fd is not None:
            os.close(db_fd)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock
