"""A daemon thread that checkpoints the WAL, so the reactor's commits never do.

How this works: the reactor's connection runs with ``wal_autocheckpoint=0``, so
a commit only appends to ``clone.db-wal``.  This thread has its own connection
and every ``interval`` seconds runs ``PRAGMA wal_checkpoint(PASSIVE)``, which
copies committed pages into the database file without waiting for (or blocking)
the writer.  Once the whole WAL is copied, the writer's next commit starts it
again from the top, so the file stays small.  :meth:`stop` wakes it through an
``Event`` and joins it.

Under a steady stream of writes that restart seldom comes: every passive
checkpoint copies what was there when it began, the writer has appended more
by then, and the WAL never empties.  Measured with 512 KB values, 692 MB of data
took 4.96 GB on disk while the server ran (the WAL), 760 MB after it stopped.
So once the WAL holds over ``truncate_above`` bytes of frames the thread runs
``wal_checkpoint(RESTART)``, which copies the rest and makes the writer's next
commit start the WAL again from the top; that commit also cuts the file to the
writer's ``journal_size_limit`` (:mod:`clone.storage.db` sets it to
``truncate_above``), so the file stays near that size.  It blocks the writer:
it takes the writer lock first, and while holding it copies what the passive
left, syncs the database file and waits (its busy handler) for every reader to
leave the WAL.  So the thread restarts the WAL only when little is left to
copy -- the passive pass before it left at most ``catch_up_frames`` frames
(1 MiB) behind; else it runs another passive pass at 0.25 s later, each
copying only what the writer added during the last -- and its connection
waits at most ``truncate_wait`` (0.5 s, half the 1 s it waited before) for the
lock and for readers.

Why RESTART and not TRUNCATE, which cut the file to zero bytes: the
``ftruncate`` of a 64 MiB WAL, with the lock held, took 43-63 ms on the
2-core VM, against 0.4-0.5 ms for a RESTART of the same WAL
(docs/benchmarks.md, "The WAL's cut without the stall"); a commit waiting
for it (and SQLite's busy handler's sleeps) set the durable server's p99 at
2,000 updates/s.  The counters keep their names (``truncations``, the
metrics' ``wal_truncations``): they count these cuts.  Other readers:
a reader pinned to an old snapshot (a ``clone backup`` copying the database)
makes it give up and try again later, counted in ``truncations_busy``, rather
than hold the lock for the reader's lifetime.  The writer's commit waits for
the lock the RESTART holds, however long, and never fails on it
(``clone.storage.db``, ``BUSY_CEILING``).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from enum import Enum
from pathlib import Path

__all__ = ["Checkpointer", "Next", "plan"]

logger = logging.getLogger(__name__)

#: Frames a passive pass may leave uncopied for a RESTART to follow it (1 MiB
#: of 4 KiB pages): the RESTART copies them with the writer locked out.
CATCH_UP_FRAMES = 256

#: A WAL frame's header, before its page (sqlite.org/fileformat.html, "WAL File Format").
_FRAME_HEADER = 24

#: The pause between passive passes while catching up with the writer: each
#: pass syncs the WAL file, which the writer's commits sync too.
CATCH_UP_PAUSE = 0.25


class Next(Enum):
    """What the thread does after a passive checkpoint."""

    #: Nothing until the next interval: the WAL is small, or the pass was busy.
    WAIT = "wait"
    #: Another passive pass soon: the WAL is over its limit but too much is
    #: left to copy for a RESTART to hold the writer lock briefly.
    CATCH_UP = "catch-up"
    #: RESTART now: the WAL is over its limit and almost all of it is copied.
    RESTART = "restart"


def plan(
    busy: int,
    wal_frames: int,
    copied: int,
    wal_bytes: int,
    truncate_above: int,
    copied_before: int = -1,
    catch_up_frames: int = CATCH_UP_FRAMES,
) -> Next:
    """Decide from one passive checkpoint's result (``busy``, the WAL's
    frames, the frames copied), the WAL's size (its frames, in bytes) and the frames the pass
    before had copied (``copied_before``, -1 if none) what comes next.

    A pass that copied what the one before had is held back by a reader
    (a passive checkpoint copies nothing past the oldest reader's snapshot):
    passing again at once would only spin, and a RESTART would wait for it."""
    if busy or wal_bytes <= truncate_above:
        return Next.WAIT
    if wal_frames < 0 or copied < 0:  # not in WAL mode: nothing to cut
        return Next.WAIT
    if wal_frames - copied <= catch_up_frames:
        return Next.RESTART
    if copied != copied_before:  # moved on (or the WAL started again from the top)
        return Next.CATCH_UP
    return Next.WAIT


class Checkpointer:
    """Runs passive WAL checkpoints of ``db_path`` on a timer in its own thread."""

    def __init__(
        self,
        db_path: Path,
        interval: float,
        truncate_above: int = 64 * 1024 * 1024,
        truncate_wait: float = 0.5,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"checkpoint interval must be > 0 seconds, got {interval!r}")
        self._db_path = db_path
        self._interval = interval
        self._truncate_above = truncate_above
        self._truncate_wait = truncate_wait
        self._frame_bytes = 4096 + _FRAME_HEADER  # read from the database when the thread starts
        self._stopping = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"clone-checkpoint:{db_path.parent.name}", daemon=True
        )
        #: Checkpoints run, and the WAL frames the last one had copied (for tests and stats).
        self.runs = 0
        self.last_copied = 0
        #: RESTART checkpoints that cut a WAL grown past ``truncate_above``.
        self.truncations = 0
        #: RESTARTs that gave up within ``truncate_wait`` (the writer or a reader held on).
        self.truncations_busy = 0
        #: The longest RESTART, seconds: what a commit may have waited for it.
        self.truncate_max_s = 0.0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Wake the thread and wait for it; safe to call more than once."""
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("checkpoint thread for %s did not stop in %.1f s",
                               self._db_path, timeout)

    def _run(self) -> None:
        try:
            conn = sqlite3.connect(self._db_path, isolation_level=None,
                                   timeout=self._truncate_wait)
        except sqlite3.Error:
            logger.exception("checkpoint thread cannot open %s; the WAL will grow "
                             "until close()", self._db_path)
            return
        try:
            try:
                self._frame_bytes = conn.execute("PRAGMA page_size").fetchone()[0] + _FRAME_HEADER
            except sqlite3.Error:
                pass  # the default's
            pause = self._interval
            while not self._stopping.wait(pause):
                pause = self._interval
                if self._checkpoint(conn) is Next.CATCH_UP:
                    pause = min(CATCH_UP_PAUSE, self._interval)
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> Next:
        try:
            busy, wal_frames, copied = conn.execute(
                "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except sqlite3.Error:
            logger.warning("WAL checkpoint of %s failed", self._db_path, exc_info=True)
            return Next.WAIT
        self.runs += 1
        copied_before, self.last_copied = self.last_copied, copied
        if busy:
            logger.debug("WAL checkpoint of %s was busy", self._db_path)
            return Next.WAIT
        # The WAL's live frames, not its file: after a RESTART the writer
        # starts again from the top of a file that keeps its size (up to its
        # journal_size_limit), and that size would call for another at once.
        wal = max(0, wal_frames) * self._frame_bytes
        step = plan(busy, wal_frames, copied, wal, self._truncate_above, copied_before)
        if step is not Next.RESTART:
            return step
        started = time.monotonic()
        try:
            busy, _wal_frames, _copied = conn.execute(
                "PRAGMA wal_checkpoint(RESTART)").fetchone()
        except sqlite3.Error:
            logger.warning("restarting the WAL of %s failed", self._db_path, exc_info=True)
            return Next.WAIT
        took = time.monotonic() - started
        self.truncate_max_s = max(self.truncate_max_s, took)
        if busy:
            self.truncations_busy += 1
            logger.debug("restarting the %d-byte WAL of %s was busy", wal, self._db_path)
            return Next.WAIT
        self.truncations += 1
        logger.debug("restarted the %d-byte WAL of %s", wal, self._db_path)
        return Next.WAIT
