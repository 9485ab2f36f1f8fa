"""fsync helpers: a file's bytes and a directory's entries reach the disk.

``os.replace`` is only atomic *and durable* once the directory holding the new
name is fsynced too; every writer in this package does both.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["dir_bytes", "fsync_dir", "fsync_file", "replace_durably"]


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the disk (SQLite closed it without a final sync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush ``path``'s directory entries, so a rename or a new file survives a power cut."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, target: Path) -> None:
    """Move the finished ``tmp`` over ``target``: readers see the old file or the new one."""
    fsync_file(tmp)
    os.replace(tmp, target)
    fsync_dir(target.parent)


def dir_bytes(path: Path) -> int:
    """Bytes the regular files directly in ``path`` take on disk (as ``du`` counts them).

    The data directory holds no subdirectories; its kept copies (``clone.db.v1``,
    ``replaced-*.db``) count, since they take the same disk.  0 if it is unreadable.
    """
    total = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        total += entry.stat(follow_symlinks=False).st_blocks * 512
                except OSError:
                    continue
    except OSError:
        return 0
    return total
