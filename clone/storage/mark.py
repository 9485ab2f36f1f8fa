"""The commit mark: the last position this data directory committed, kept outside SQLite.

How this works: ``DIR/COMMITTED`` is one fixed-size record, ``sequence`` and
``term``, rewritten in place (one ``pwrite`` at offset 0, no new block) after
every commit that moves the position (:class:`~clone.storage.db.Storage`), so
it is never ahead of the database: a commit that lowers the position (a resync
onto a peer's older state) lowers the mark first.  At open the mark is read
before anything else writes; a database whose sequence is *below* the mark has
lost committed -- so published, so confirmed -- updates, and the server must
not serve it as if nothing happened (a chaos run's primary reopened
five committed updates short after a kill -9 around a full disk, and nothing
said so).  :func:`check` raises :class:`~clone.errors.DataDirBehind` naming
both positions and what to do.

Why a file and not a row: the row is in the database whose loss it must
detect.  Why no fsync: the updates a mark covers were fsynced by their commit
(``--fsync batch``/``always``) before the mark is written, so after a power cut
the mark is at most as new as the WAL; against a killed process the page cache
is enough.  Only ``--fsync off`` can lose a WAL tail the mark covers, and then
the refusal is true.

A data directory without a mark (written before this release, or just
restored) starts one at its position; a mark that cannot be parsed is reported
and replaced, never trusted.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from pathlib import Path

from clone.errors import DataDirBehind, StorageError

__all__ = ["MARK_FILE", "MARK_SIZE", "CommitMark", "check", "format_mark", "parse_mark"]

logger = logging.getLogger(__name__)

MARK_FILE = "COMMITTED"
#: One record, always this long: rewritten in place, it never needs a new block.
MARK_SIZE = 64
_FORMAT = re.compile(rb"clone-committed (\d{20}) (\d{20})\n *\n\Z")


def format_mark(sequence: int, term: int) -> bytes:
    """The record for ``(sequence, term)``, :data:`MARK_SIZE` bytes."""
    if sequence < 0 or term < 0:
        raise ValueError(f"a position is never negative: ({sequence}, {term})")
    text = b"clone-committed %020d %020d\n" % (sequence, term)
    return text + b" " * (MARK_SIZE - 1 - len(text)) + b"\n"


def parse_mark(data: bytes) -> tuple[int, int] | None:
    """``(sequence, term)`` from a record, or None if it is not one (empty, torn, foreign)."""
    match = _FORMAT.match(data) if len(data) == MARK_SIZE else None
    if match is None:
        return None
    return int(match[1]), int(match[2])


def check(path: Path, db_path: Path, marked: tuple[int, int] | None, sequence: int,
          term: int) -> None:
    """Refuse a database that holds less than the mark says was committed."""
    if marked is None or sequence >= marked[0]:
        return
    raise DataDirBehind(
        f"{db_path} holds sequence {sequence} (term {term}), but this data directory had "
        f"committed up to sequence {marked[0]} (term {marked[1]}, recorded in {path}): "
        f"{marked[0] - sequence} committed and possibly confirmed updates are missing from "
        "the database (its -wal file lost or replaced, or an older clone.db copied in). "
        "Do not serve it alone: let the peer serve and restore this server from a backup "
        "of it (clone backup, then clone-server --restore FILE), or, to accept the loss, "
        f"move {path} aside and start again"
    )


class CommitMark:
    """The open ``COMMITTED`` file of a locked data directory."""

    __slots__ = ("_fd", "path", "position")

    def __init__(self, fd: int, path: Path, position: tuple[int, int] | None) -> None:
        self._fd: int | None = fd
        self.path = path
        #: The position the file holds (None: no valid record yet).
        self.position = position

    @classmethod
    def open(cls, data_dir: Path) -> CommitMark:
        """Open (creating it empty if absent) and read the mark; the caller holds the lock."""
        path = data_dir / MARK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise StorageError(f"cannot open {path}: {exc.strerror}; check the data "
                               "directory's owner, mode and free space") from exc
        try:
            data = os.pread(fd, MARK_SIZE + 1, 0)
        except OSError as exc:
            os.close(fd)
            raise StorageError(f"cannot read {path}: {exc.strerror}") from exc
        position = parse_mark(data)
        if position is None and data:
            logger.warning("%s does not hold a commit mark (%d bytes); it is replaced by "
                           "the database's position", path, len(data))
        return cls(fd, path, position)

    def write(self, sequence: int, term: int) -> None:
        """Record ``(sequence, term)``; raises StorageError (the caller fail-stops)."""
        if self.position == (sequence, term):
            return
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.path} is closed")
        try:
            written = os.pwrite(fd, format_mark(sequence, term), 0)
        except OSError as exc:
            hint = "; free space" if exc.errno == errno.ENOSPC else ""
            raise StorageError(f"cannot write the commit mark {self.path}: {exc.strerror}"
                               f"{hint}") from exc
        if written != MARK_SIZE:
            raise StorageError(f"cannot write the commit mark {self.path}: {written} of "
                               f"{MARK_SIZE} bytes written (disk full?)")
        self.position = (sequence, term)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
