"""The data directory's lock: one server process per directory.

How this works: ``DIR/LOCK`` is opened and locked with ``flock(LOCK_EX|LOCK_NB)``.
The kernel drops the lock when the holder's descriptor is closed, also when the
process is killed, so a stale lock file never needs cleaning up.  The holder
writes its pid into the file so that the refusal can say who holds it.  A flock
belongs to an open file description, so a second :class:`DirLock` on the same
directory fails within one process too.
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

    __slots__ = ("_fd", "path")

    def __init__(self, data_dir: Path) -> None:
        self.path = data_dir / LOCK_FILE
        self._fd: int | None = None

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

    def release(self) -> None:
        """Drop the lock; idempotent.  The file stays: deleting it would race a new holder."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the last descriptor releases the flock
