"""One server's on-disk database: the state and a bounded log of updates.

How this works: ``DIR/clone.db`` is a SQLite database in WAL mode with three
tables -- ``kv`` (the state: key -> the stored Entry), ``log`` (recent updates
by sequence, trimmed by the caller's ``keep_from``) and ``meta`` (sequence and
term).  The server's reactor calls :meth:`Storage.append` once per loop turn
with every update of that turn, and the group costs one commit (group commit);
:class:`FsyncPolicy` decides how durable that commit is.  Every call is bounded
plain blocking I/O: the WAL is checkpointed by a :class:`Checkpointer` thread
with its own connection, and a full resync from the peer is streamed in chunks
(:meth:`Storage.begin_replace`, :meth:`Storage.stage`, :meth:`Storage.finish_replace`).

The methods are meant for one thread (the reactor's), except
:meth:`Storage.backup_to`, which reads through its own connection.
"""

from __future__ import annotations

import enum
import gc
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from time import perf_counter
from typing import Any

from clone.errors import StorageError
from clone.release import RELEASE
from clone.storage import conflicts
from clone.storage.checkpointer import Checkpointer
from clone.storage.copying import copy_database
from clone.storage.files import fsync_dir
from clone.storage.lock import DirLock
from clone.storage.mark import CommitMark
from clone.storage.mark import check as check_mark
from clone.storage.migrations import migrate_file
from clone.storage.schema import (
    DATA_FILE,
    KV_COLUMNS,
    Entry,
    kv_table_sql,
    precheck_file,
    read_position,
    translate,
    verify,
)
from clone.storage.statefile import write_state_file

__all__ = ["DATA_FILE", "CommitTiming", "Entry", "FsyncPolicy", "Loaded", "Storage", "Update"]

logger = logging.getLogger(__name__)

#: A row of the log as the server replays it: the 5 KVPUB frames
#: [key, seq8, uuid, props, body] (an empty body is a delete), the term, and ``at``.
Update = tuple[list[bytes], int, float]

#: The log is trimmed once ``keep_from`` has moved this far since the last
#: trim (the first ``keep_from`` after open always trims).  A trim every
#: commit dirtied the log's first page each time: 5.4 WAL pages per
#: single-update commit instead of 4.1 (docs/benchmarks.md, durable writes).  The
#: log then holds up to this many rows more than asked, which a restart's
#: history drops as it loads (it keeps its newest updates).
TRIM_EVERY = 1024
#: ... or once this many bytes (keys, values, properties) went into the log
#: since the last trim: a count alone let 1,024 large updates pile up (the
#: hostile drill's 512 KB writes: 358 MB of log rows in a 1.28 GB database
#: holding 692 MB of values, against ``--history-bytes`` of 64 MiB).
TRIM_EVERY_BYTES = 16 * 1024 * 1024

#: How long the reactor's connection waits, at a time, for a lock another
#: connection holds (the checkpointer's TRUNCATE) before SQLite says SQLITE_BUSY.
BUSY_TIMEOUT = 2.0

#: How long a commit keeps waiting for that lock, in all: a busy checkpoint
#: must never fail a commit (its writes would be lost, and the server would
#: fail-stop), so SQLITE_BUSY at BEGIN is tried again until this much time has
#: gone.  Our checkpointer lets go of the lock within its ``truncate_wait``;
#: only a foreign connection holding the database (an sqlite3 shell left in a
#: transaction) lasts this long, and that is a fault to stop on.
BUSY_CEILING = 30.0

#: The WAL is reset to this size when it restarts, so one burst does not keep a
#: big file around.
_WAL_SIZE_LIMIT = 64 * 1024 * 1024


class FsyncPolicy(enum.Enum):
    """How durable a commit is; the trade is commit latency."""

    #: synchronous=FULL and one commit per append() call (one reactor turn):
    #: now the same group commit as ``batch``, kept as a name for
    #: the configurations that say it.  Redis's ``appendfsync always`` also
    #: fsyncs once per event loop, not once per command; a commit per update
    #: cost up to 1,000 fsyncs back to back in one turn (a 10 s stall).
    #: Either way nothing is published, so confirmed, before the fsync that
    #: covers it.
    ALWAYS = "always"
    #: synchronous=FULL and one commit per append() call (one reactor turn).
    BATCH = "batch"
    #: synchronous=OFF: survives a killed process, not a power cut or a kernel crash.
    OFF = "off"


@dataclass(frozen=True, slots=True)
class Loaded:
    """What a server starts from: the state, its position and the recent log."""

    entries: dict[bytes, Entry]
    sequence: int
    term: int
    #: The log, oldest first.
    history: list[Update]
    #: Whether the data was last written while the server followed its peer
    #: (meta's ``following`` row; absent, as in files written before it: no).
    following: bool = False


@dataclass(slots=True)
class CommitTiming:
    """Where a commit's time goes, summed since open: the statements (``write_s``)
    and the COMMIT itself (``sync_s``, which waits for the WAL's fsync unless
    ``--fsync off``).  Two clock reads per commit; the server reports them in
    its stats (``commit_*``), the benchmark reads them (docs/benchmarks.md)."""

    commits: int = 0
    write_s: float = 0.0
    sync_s: float = 0.0
    max_s: float = 0.0


class Storage:
    """An open, locked data directory.  Use :meth:`open`; call :meth:`close`."""

    def __init__(
        self,
        data_dir: Path,
        lock: DirLock,
        conn: sqlite3.Connection,
        fsync: FsyncPolicy,
        checkpointer: Checkpointer,
        sequence: int,
        term: int,
        mark: CommitMark,
    ) -> None:
        self._dir = data_dir
        self._db_path = data_dir / DATA_FILE
        self._lock = lock
        self._conn: sqlite3.Connection | None = conn
        self._fsync = fsync
        self._checkpointer = checkpointer
        #: The position last committed, kept outside SQLite (clone.storage.mark).
        self._mark = mark
        self._sequence = sequence
        self._term = term
        self.timing = CommitTiming()
        #: Times a transaction met SQLITE_BUSY at BEGIN and waited again (stats, tests).
        self.busy_waits = 0
        self._trimmed_from: int | None = None  # the keep_from of the last trim
        self._logged_bytes = 0  # written to the log since the last trim

    # -- opening and closing -------------------------------------------------

    @classmethod
    def open(
        cls,
        data_dir: str | os.PathLike[str],
        *,
        fsync: FsyncPolicy = FsyncPolicy.BATCH,
        create: bool = True,
        checkpoint_interval: float = 1.0,
    ) -> Storage:
        """Lock ``data_dir`` and open (or, with ``create``, make) its database.

        Raises a :class:`~clone.errors.StorageError` kind that says what to do;
        on any failure nothing is left locked or open.
        """
        if not isinstance(fsync, FsyncPolicy):
            raise TypeError(f"fsync must be a FsyncPolicy, got {fsync!r}")
        path = Path(data_dir)
        _ensure_dir(path, create)
        lock = DirLock(path)
        lock.acquire()
        conn: sqlite3.Connection | None = None
        mark: CommitMark | None = None
        try:
            db_path = path / DATA_FILE
            if not db_path.exists():
                if not create:
                    raise StorageError(
                        f"{path} holds no {DATA_FILE}: start with create enabled for a "
                        "new server, or restore one: clone-server --restore FILE"
                    )
                # Built aside and renamed into place: a crash mid-creation never
                # leaves a clone.db that looks like an empty state.
                write_state_file(db_path, {}, sequence=0, term=0)
                logger.info("created a new database %s", db_path)
                lock.hold_database(db_path)
            else:
                # Held on the database itself: a deleted LOCK file lets no second
                # server in (clone.storage.lock).
                lock.hold_database(db_path)
                # An older format is upgraded here, after a copy is kept beside it;
                # a newer one is refused (clone.storage.migrations).
                migrate_file(db_path)
            # Read before anything below writes: the last position committed.
            mark = CommitMark.open(path)
            conn = _connect(db_path, fsync)
            sequence, term = read_position(conn, db_path)
            check_mark(mark.path, db_path, mark.position, sequence, term)
            mark.write(sequence, term)
        except BaseException:
            if conn is not None:
                conn.close()
            if mark is not None:
                mark.close()
            lock.release()
            raise
        checkpointer = Checkpointer(db_path, checkpoint_interval, truncate_above=_WAL_SIZE_LIMIT)
        checkpointer.start()
        logger.info("opened %s at sequence %d, term %d (fsync=%s)",
                    db_path, sequence, term, fsync.value)
        return cls(path, lock, conn, fsync, checkpointer, sequence, term, mark)

    def close(self) -> None:
        """Stop the checkpointer, checkpoint the WAL away and release the lock; idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._checkpointer.stop()
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                logger.warning("final WAL checkpoint of %s failed; the next open "
                               "replays the WAL", self._db_path, exc_info=True)
            conn.close()
        finally:
            self._mark.close()
            self._lock.release()

    def close_within(self, timeout: float) -> bool:
        """:meth:`close` on a thread of its own, waited for at most ``timeout``
        seconds; whether it finished.  A server's stop must end within a
        second (operations.md, "Shutdown"), and the final checkpoint of a large
        WAL on a busy disk took half of one: one left running when the process
        exits is harmless (a checkpoint is crash-safe; the next open replays
        the WAL), and an in-process server's finishes on its own."""

        def close() -> None:
            try:
                self.close()
            except (sqlite3.Error, OSError) as exc:
                logger.error("closing the data directory failed: %s", exc)

        closer = threading.Thread(target=close, name="clone-storage-close", daemon=True)
        closer.start()
        closer.join(timeout)
        return not closer.is_alive()

    def __enter__(self) -> Storage:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- reading -------------------------------------------------------------

    @property
    def path(self) -> Path:
        """The data directory."""
        return self._dir

    @property
    def fsync(self) -> FsyncPolicy:
        return self._fsync

    @property
    def sequence(self) -> int:
        """The sequence last committed."""
        return self._sequence

    @property
    def term(self) -> int:
        """The term last committed."""
        return self._term

    def wal_truncations(self) -> tuple[int, int, float]:
        """The checkpointer's TRUNCATEs: done, given up within its short wait,
        and the longest one's seconds (what a commit may have waited)."""
        c = self._checkpointer
        return c.truncations, c.truncations_busy, c.truncate_max_s

    def logical_bytes(self) -> int:
        """The bytes the state takes in the store (key, seq, uuid, props, body of each row).

        SQLite answers ``length()`` of a blob from the record header, so this
        reads no values: cheap enough to check a budget before :meth:`load`.
        """
        try:
            row = self._live().execute(
                "SELECT coalesce(sum(length(key) + length(seq) + length(uuid)"
                " + length(props) + length(body)), 0) FROM kv"
            ).fetchone()
        except sqlite3.Error as exc:
            raise translate(exc, self._db_path, "measuring") from exc
        return int(row[0])

    def load(self) -> Loaded:
        """Read the whole state and log (once, at start)."""
        conn = self._live()
        # A million new tuples are each tracked by the garbage collector until a
        # collection looks at them; the collections those allocations trigger
        # walk the growing dict again and again, which doubled the load time.
        # One load at start: pause the collector for it (the next collection
        # untracks the tuples, as they hold only bytes).
        collecting = gc.isenabled()
        gc.disable()
        try:
            cur = conn.cursor()
            cur.row_factory = None
            # Straight from the cursor: no intermediate list of a million rows.
            entries: dict[bytes, Entry] = {
                key: (seq, uuid, props, body)
                for key, seq, uuid, props, body in cur.execute(f"SELECT {KV_COLUMNS} FROM kv")
            }
            history: list[Update] = [
                ([key, seq.to_bytes(8, "big"), uuid, props, body], term, at)
                for seq, key, uuid, props, body, term, at in cur.execute(
                    "SELECT seq, key, uuid, props, body, term, at FROM log ORDER BY seq"
                )
            ]
            sequence, term = read_position(conn, self._db_path)
            row = conn.execute("SELECT value FROM meta WHERE name = 'following'").fetchone()
        except (sqlite3.Error, OverflowError) as exc:
            raise translate(exc, self._db_path, "loading") from exc
        finally:
            if collecting:
                gc.enable()
        return Loaded(entries, sequence, term, history, following=row is not None and row[0] == 1)

    # -- writing -------------------------------------------------------------

    def append(
        self,
        updates: Sequence[Sequence[bytes]],
        *,
        term: int,
        at: float | Sequence[float],
        keep_from: int | None = None,
        conflict_rows: Sequence[Sequence[object]] = (),
        conflict_drops: Sequence[int] = (),
    ) -> None:
        """Commit one group of updates (5 KVPUB frames each), in order.

        The state, the log, and meta's sequence (the last update's) and term
        change together.  ``at`` is one time for all or one per update;
        ``keep_from`` trims the log below that sequence in the same commit,
        once it has moved :data:`TRIM_EVERY` since the last trim or
        :data:`TRIM_EVERY_BYTES` went into the log meanwhile.  The
        turn's conflict changes (:meth:`write_conflicts`) go in the same
        commit: one writer, one transaction per turn.
        """
        ats = _times(at, len(updates))
        for update in updates:
            if len(update) != 5 or len(update[1]) != 8:
                raise ValueError(
                    "an update is the 5 KVPUB frames [key, seq8, uuid, props, body]; "
                    f"got {len(update)} frames"
                    + (f", a {len(update[1])}-byte sequence" if len(update) == 5 else "")
                )
        if not updates:
            if term != self._term:
                self.set_position(self._sequence, term)
            self.write_conflicts(conflict_rows, conflict_drops)
            return
        # One transaction, so one fsync, for the whole group under every policy.
        self._write_group(updates, ats, term, keep_from, conflict_rows, conflict_drops)

    def _write_group(
        self,
        updates: Sequence[Sequence[bytes]],
        ats: Sequence[float],
        term: int,
        keep_from: int | None,
        conflict_rows: Sequence[Sequence[object]] = (),
        conflict_drops: Sequence[int] = (),
    ) -> None:
        # Within one transaction only each key's last update matters to kv, so
        # sets and deletes can go in two executemany calls without reordering.
        last: dict[bytes, Sequence[bytes]] = {}
        for update in updates:
            last[bytes(update[0])] = update
        sets = [(k, u[1], u[2], u[3], u[4]) for k, u in last.items() if u[4]]
        deletes = [(k,) for k, u in last.items() if not u[4]]
        log_rows = [
            (int.from_bytes(u[1], "big"), u[0], u[2], u[3], u[4], term, a)
            for u, a in zip(updates, ats, strict=True)
        ]
        sequence = log_rows[-1][0]
        self._lower_mark(sequence, term)
        with self._transaction("appending to") as conn:
            if sets:
                conn.executemany(f"INSERT OR REPLACE INTO kv ({KV_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                                 sets)
            if deletes:
                conn.executemany("DELETE FROM kv WHERE key = ?", deletes)
            # OR REPLACE: after a failover a sequence may be written again under a
            # newer term, and the newer update is the one that counts.
            conn.executemany(
                "INSERT OR REPLACE INTO log (seq, key, uuid, props, body, term, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?)",
                log_rows,
            )
            _set_meta(conn, sequence, term)
            trimmed = self._trimmed_from
            self._logged_bytes += sum(len(u[0]) + len(u[3]) + len(u[4]) for u in updates)
            trim = keep_from is not None and (
                trimmed is None
                or keep_from - trimmed >= TRIM_EVERY
                or (keep_from > trimmed and self._logged_bytes >= TRIM_EVERY_BYTES)
            )
            if trim:
                conn.execute("DELETE FROM log WHERE seq < ?", (keep_from,))
            if conflict_rows:
                conflicts.write_conflicts(conn, conflict_rows)
            if conflict_drops:
                conflicts.delete_conflicts(conn, conflict_drops)
        self._committed(sequence, term)
        if trim:
            self._trimmed_from = keep_from
            self._logged_bytes = 0

    def set_position(self, sequence: int, term: int) -> None:
        """Record a new sequence and term alone (e.g. a promotion bumps the term)."""
        self._lower_mark(sequence, term)
        with self._transaction("recording the position in") as conn:
            _set_meta(conn, sequence, term)
        self._committed(sequence, term)

    def record_following(self, following: bool) -> None:
        """Record whether the server now follows its peer (passive) or writes
        (active).  A server that restarts from data it wrote while following
        knows the peer may hold newer confirmed writes (docs/failover.md,
        "Cold start and ranks")."""
        with self._transaction("recording the role in") as conn:
            conn.execute(
                "INSERT OR REPLACE INTO meta (name, value) VALUES ('following', ?)",
                (1 if following else 0,),
            )

    # -- full resync from the peer --------------------------------------------

    def begin_replace(self) -> None:
        """Start staging a new state (an empty ``kv_staging``; a previous one is dropped)."""
        with self._transaction("starting a resync in") as conn:
            conn.execute("DROP TABLE IF EXISTS kv_staging")
            conn.execute(kv_table_sql("kv_staging"))

    def stage(self, items: Iterable[tuple[bytes, Entry]]) -> None:
        """Add one chunk of the new state; committed, so chunks stay short."""
        rows = [(key, *entry) for key, entry in items]
        with self._transaction("staging a resync chunk in") as conn:
            conn.executemany(
                f"INSERT OR REPLACE INTO kv_staging ({KV_COLUMNS}) VALUES (?, ?, ?, ?, ?)", rows
            )

    def finish_replace(self, sequence: int, term: int) -> None:
        """Swap the staged state in, empty the log and record the position: one commit."""
        self._lower_mark(sequence, term)
        with self._transaction("finishing a resync in") as conn:
            if not _has_table(conn, "kv_staging"):
                raise ValueError("finish_replace() without begin_replace()")
            conn.execute("DROP TABLE kv")
            conn.execute("ALTER TABLE kv_staging RENAME TO kv")
            conn.execute("DELETE FROM log")
            _set_meta(conn, sequence, term)
        self._committed(sequence, term)
        self._trimmed_from = None
        self._logged_bytes = 0

    def abort_replace(self) -> None:
        """Drop the staged state, if any; the current one is untouched."""
        with self._transaction("aborting a resync in") as conn:
            conn.execute("DROP TABLE IF EXISTS kv_staging")

    # -- backup ----------------------------------------------------------------

    def backup_to(self, target: str | os.PathLike[str]) -> None:
        """Write a consistent copy of the database to ``target`` (atomically replaced).

        Reads through its own connection (a WAL snapshot), so it neither blocks
        nor is blocked by :meth:`append`, and may run in another thread.
        """
        self._live()
        copy_database(self._db_path, Path(target), live=True)

    # -- split-brain conflicts (clone.storage.conflicts) -----------------------

    def write_conflicts(
        self,
        rows: Sequence[Sequence[object]],
        dropped: Sequence[int] = (),
        *,
        busy_timeout: float | None = None,
    ) -> None:
        """Record new or resolved conflicts and delete dropped ones, in one transaction.

        ``busy_timeout`` (seconds) replaces the connection's wait for a lock
        held elsewhere (the checkpointer's) for this transaction alone: a
        caller that can try again later waits less.  A lock still held raises
        :class:`~clone.errors.StorageBusy`, with nothing written.
        """
        if not rows and not dropped:
            return
        with self._transaction("recording conflicts in", busy_timeout) as conn:
            if rows:
                conflicts.write_conflicts(conn, rows)
            if dropped:
                conflicts.delete_conflicts(conn, dropped)

    def read_conflicts(self) -> list[tuple[Any, ...]]:
        """Every conflict the data directory holds, oldest first."""
        try:
            return conflicts.read_conflicts(self._live())
        except sqlite3.Error as exc:
            raise translate(exc, self._db_path, "reading conflicts from") from exc

    # -- helpers -------------------------------------------------------------

    def _lower_mark(self, sequence: int, term: int) -> None:
        """Before a commit that moves the position back (a resync onto the
        peer's older state, a sequence written again after a failover), move
        the mark back first: it must never be ahead of the database, or the
        next open would refuse a database that lost nothing."""
        marked = self._mark.position
        if marked is not None and sequence < marked[0]:
            self._mark.write(sequence, term)

    def _committed(self, sequence: int, term: int) -> None:
        """The commit of ``(sequence, term)`` returned: record it in memory and in the mark."""
        self._sequence, self._term = sequence, term
        self._mark.write(sequence, term)

    def _live(self) -> sqlite3.Connection:
        if self._conn is None:
            raise ValueError(f"storage of {self._dir} is closed")
        return self._conn

    @contextmanager
    def _transaction(
        self, doing: str, busy_timeout: float | None = None
    ) -> Iterator[sqlite3.Connection]:
        conn = self._live()
        try:
            started = perf_counter()
            if busy_timeout is not None:
                conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
                try:
                    conn.execute("BEGIN IMMEDIATE")
                finally:
                    conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT * 1000)}")
            else:
                self._begin_waiting(conn, started, doing)
            try:
                yield conn
            except BaseException:
                # SQLite has rolled back already after a full disk or an I/O
                # error: a ROLLBACK then fails and hides the cause.
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
            written = perf_counter()
            conn.execute("COMMIT")
            done = perf_counter()
            timing = self.timing
            timing.commits += 1
            timing.write_s += written - started
            timing.sync_s += done - written
            if done - started > timing.max_s:
                timing.max_s = done - started
        except (sqlite3.Error, OverflowError) as exc:
            # OverflowError: a number too large for an SQLite INTEGER, which
            # sqlite3 raises as it binds it; the write is lost all the same.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise translate(exc, self._db_path, doing) from exc

    def _begin_waiting(self, conn: sqlite3.Connection, started: float, doing: str) -> None:
        """BEGIN IMMEDIATE, waiting out a lock held elsewhere for up to
        :data:`BUSY_CEILING`: nothing is written before BEGIN, so trying again
        is safe, and the connection's own wait (:data:`BUSY_TIMEOUT`) is
        shorter than a checkpoint's TRUNCATE may hold the lock on a slow disk."""
        logged = -1.0
        while True:
            attempt = perf_counter()
            try:
                conn.execute("BEGIN IMMEDIATE")
                return
            except sqlite3.OperationalError as exc:
                if not getattr(exc, "sqlite_errorname", "").startswith("SQLITE_BUSY"):
                    raise
                now = perf_counter()
                if now - started >= BUSY_CEILING:
                    raise
                self.busy_waits += 1
                if now - logged >= 1.0:  # each wait is BUSY_TIMEOUT long: rarely more
                    logged = now
                    logger.warning("%s %s waits for the database lock (%.1f s so far,"
                                   " up to %.0f s): %s", doing, self._db_path,
                                   now - started, BUSY_CEILING, exc)
                if now - attempt < 0.01:
                    time.sleep(0.01)  # a BUSY that did not wait: no hot loop


def _ensure_dir(path: Path, create: bool) -> None:
    try:
        if path.is_dir():
            return
        if path.exists():
            raise StorageError(f"data directory {path} exists but is not a directory: "
                               "give --data-dir a directory path")
        if not create:
            raise StorageError(f"data directory {path} does not exist")
        path.mkdir(parents=True)
        fsync_dir(path.parent)
    except OSError as exc:
        raise StorageError(
            f"cannot create or use data directory {path}: {exc.strerror}; check the "
            "path and that this user may write there"
        ) from exc


#: SQLite's page cache for the reactor's connection, in KiB (SQLite's default
#: is 2,000).  The connection only writes: the map is served from memory, so
#: the cache saves a B-tree page read from the OS's page cache now and then,
#: and its 2 MB were a fifth of a durable server's memory over key+value at
#: 100,000 keys (20 of 290-327 B a key).  At 256 KiB, measured side by side
#: (docs/benchmarks.md, "Memory per key, durable, at 100k"): 267-274 B a key,
#: and no slower to load 1,000,000 keys or to commit 20,000 updates.
PAGE_CACHE_KIB = 256


def _connect(db_path: Path, fsync: FsyncPolicy) -> sqlite3.Connection:
    """Open and check an existing database, set up for the reactor's writes."""
    precheck_file(db_path)
    try:
        # check_same_thread=False: opened at start, then used by the reactor thread.
        conn = sqlite3.connect(db_path, isolation_level=None, timeout=BUSY_TIMEOUT,
                               check_same_thread=False)
    except sqlite3.Error as exc:
        raise translate(exc, db_path, "opening") from exc
    try:
        verify(conn, db_path, current=True)  # before journal_mode=WAL writes to the header
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode != "wal":
            raise StorageError(
                f"{db_path} cannot use WAL journaling (got {mode!r}): put the data "
                "directory on a local file system"
            )
        sync = "OFF" if fsync is FsyncPolicy.OFF else "FULL"
        conn.execute(f"PRAGMA synchronous = {sync}")
        conn.execute("PRAGMA wal_autocheckpoint = 0")
        conn.execute(f"PRAGMA cache_size = -{PAGE_CACHE_KIB}")
        conn.execute(f"PRAGMA journal_size_limit = {_WAL_SIZE_LIMIT}")
        # A resync interrupted by a crash leaves its staging table behind.
        conn.execute("DROP TABLE IF EXISTS kv_staging")
        # The release that last wrote the file, for an operator reading it later.
        conn.execute("INSERT OR REPLACE INTO meta (name, value) VALUES ('release', ?)",
                     (RELEASE,))
    except sqlite3.Error as exc:
        conn.close()
        raise translate(exc, db_path, "opening") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def _set_meta(conn: sqlite3.Connection, sequence: int, term: int) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO meta (name, value) VALUES ('sequence', ?), ('term', ?)",
        (sequence, term),
    )


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)
    ).fetchone()
    return row is not None


def _times(at: float | Sequence[float], count: int) -> Sequence[float]:
    if isinstance(at, (int, float)):
        return [float(at)] * count
    if len(at) != count:
        raise ValueError(f"at has {len(at)} times for {count} updates")
    return at
