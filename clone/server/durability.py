"""The data directory: load it at start, commit every loop turn's changes to it.

How this works: the core records every change it makes in its journal
(:mod:`.journal`).  At the end of each handler -- a drained batch of client
updates, an expiry pass, a promotion, a turn of following the peer -- the
reactor takes that record and writes it to the database (:mod:`clone.storage`)
in one transaction: a *group commit*.  Only then are the updates published.
A KVPUB is what confirms a write to its client, so a confirmed write is on
the active server's disk (with ``--fsync batch`` or ``always``, fsynced).  The
passive journals what it applies from the active the same way, so either
server can be the one that survives.

Each commit also records the *term* it was written under (the Binary Star
epoch of the active server that sequenced it) and the sequence.  Binary Star
announces ``(term, sequence)`` as this server's rank, and when both servers
start together the one with the newer data becomes active (docs/failover.md,
"Cold start").

A write that fails (disk full, I/O error) stops the server: its memory now
holds updates it could not make durable, and it must not confirm them.  The
peer takes over, as after a crash.  Without a data directory (``--in-memory``)
the journal is still taken each turn, for publishing, and nothing is written.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import astuple

from clone.errors import StorageBusy, StorageError
from clone.server.budget import check_fits
from clone.server.config import ServerConfig
from clone.server.conflicts import ConflictRecord
from clone.server.core import ServerCore
from clone.server.journal import OpKind, published
from clone.server.shared import Shared
from clone.storage import FsyncPolicy, Storage, restore_into

__all__ = ["CONFLICTS_BUSY_WAIT", "Durability"]

log = logging.getLogger("clone.server.reactor")

#: How long a turn's conflicts-only write waits for a lock the checkpointer
#: holds before leaving them for a later turn (seconds): the loop's turn, not
#: the 2 s an update's commit may wait.
CONFLICTS_BUSY_WAIT = 0.05


class Durability:
    """Open, load, commit and close the data directory (a part of the server).

    It owns the :class:`~clone.storage.Storage`, the term our stored data was
    last written under and the write error that stopped the server (set
    once: fail-stop).  Built with the core whose journal it commits and four
    callbacks: ``publish`` (the publisher's, for :meth:`commit_and_publish`),
    ``ha_term`` (the term new writes go under while paired: our epoch while
    active, the peer's while following; None unpaired, when the stored term
    stays), ``committed`` (the updates of each commit, for the views' counts
    and the monitoring ring) and ``stop`` (the server's, at a write error).
    ``tests/server/test_durability_part.py`` drives it alone.
    """

    def __init__(
        self,
        config: ServerConfig,
        core: ServerCore,
        shared: Shared,
        *,
        publish: Callable[[list[bytes]], None],
        ha_term: Callable[[], int | None],
        committed: Callable[[list[list[bytes]]], None],
        stop: Callable[[], None],
    ) -> None:
        self.config = config
        self.core = core
        self.counters = shared.counters
        self._throttle = shared.throttle
        self._clock = shared.clock
        self._wallclock = shared.wallclock
        self._publish = publish
        self._ha_term = ha_term
        self._committed = committed
        self.request_stop = stop
        self._storage: Storage | None = None
        self._data_term = 0  # the term our stored data was last written under
        # Whether our stored data was last written while we followed the peer.
        self._data_following = False
        self._storage_error: BaseException | None = None  # set once: fail-stop

    @property
    def storage(self) -> Storage | None:
        """The open data directory (None in memory, or before start and after stop)."""
        return self._storage

    @property
    def data_term(self) -> int:
        """The term our stored data was last written under (Binary Star's epoch at start)."""
        return self._data_term

    @property
    def data_following(self) -> bool:
        """Whether our stored data was last written as the pair's passive: then
        a restart waits for the peer instead of serving alone."""
        return self._data_following

    @property
    def error(self) -> BaseException | None:
        """The write error that stopped the server (fail-stop), or None."""
        return self._storage_error

    # -- start and stop ------------------------------------------------------

    def open(self) -> None:
        """Open the data directory (restoring a backup into it first, if asked)
        and load its state into the core.  Raises StorageError with a message
        an operator can act on; the server then does not start."""
        cfg = self.config
        if cfg.data_dir is None:
            log.warning(
                "in-memory mode: nothing is written to disk; the state is lost when both "
                "servers stop"
            )
            return
        if cfg.restore is not None:
            moved = restore_into(cfg.data_dir, cfg.restore)
            log.warning(
                "restored %s into %s%s",
                cfg.restore,
                cfg.data_dir,
                f"; the previous state was moved to {moved}" if moved else "",
            )
        started = time.monotonic()
        storage = Storage.open(cfg.data_dir, fsync=FsyncPolicy(cfg.fsync))
        try:
            check_fits(storage, cfg.core.max_bytes)
            loaded = storage.load()
            self.core.load(
                loaded.entries, loaded.sequence, loaded.history, self._wallclock(), self._clock()
            )
            kept = [ConflictRecord(*row) for row in storage.read_conflicts()]
            self.core.conflicts.load(kept)
            if kept:
                log.warning(
                    "data directory %s holds %d split-brain conflicts, %d unresolved"
                    " (clone conflicts lists them)",
                    cfg.data_dir,
                    len(kept),
                    self.core.conflicts.unresolved,
                )
        except BaseException:
            storage.close()
            raise
        self._storage = storage
        self._data_term = loaded.term
        self._data_following = loaded.following
        self.core.term = loaded.term
        log.info(
            "data directory %s: %d keys at sequence %d (term %d), %d updates of history,"
            " loaded in %.2f s; fsync %s",
            cfg.data_dir,
            len(self.core.store),
            loaded.sequence,
            loaded.term,
            len(loaded.history),
            time.monotonic() - started,
            cfg.fsync,
        )

    def close(self) -> None:
        storage, self._storage = self._storage, None
        if storage is not None:
            try:
                storage.close()
            except (sqlite3.Error, OSError) as exc:
                log.error("closing the data directory failed: %s", exc)

    # -- the rank Binary Star announces ----------------------------------------

    def rank(self) -> tuple[int, int]:
        """How new our data is: (term of the last write, sequence)."""
        return (self._data_term, self.core.store.sequence)

    def _current_term(self) -> int:
        """The term new writes are recorded under: our epoch while active,
        the active peer's while we follow it."""
        term = self._ha_term()
        return self._data_term if term is None else term

    # -- group commit --------------------------------------------------------

    def commit(self) -> list[list[bytes]]:
        """Write this turn's changes in one transaction; return the updates,
        in order, which may now be published.  Nothing on a write failure.

        The conflicts recorded, resolved or dropped this turn go in the
        transaction of the turn's updates; in a turn without updates (a
        heal's conflicts change no key) in one of their own, which waits
        briefly for the checkpointer's lock and, if it is still held, is
        tried again next turn: a conflict is in memory and answered already,
        so a late row risks only a crash in between (its writer was told all
        the same), and a busy database must not stop the server.
        """
        ops = self.core.journal.take()
        book = self.core.conflicts
        if book.dropped != self.counters.get("split_conflicts_dropped", 0):
            self._conflicts_dropped(book.dropped)
        dirty = book.take_dirty()
        dropped = book.take_dropped()
        storage = self._storage
        if storage is None or self._storage_error is not None:
            dirty, dropped = [], []
        rows = [astuple(r) for r in dirty]
        if (
            storage is not None
            and (rows or dropped)
            and not any(op.kind is OpKind.UPDATES for op in ops)
        ):
            try:
                storage.write_conflicts(rows, dropped, busy_timeout=CONFLICTS_BUSY_WAIT)
            except StorageBusy as exc:
                book.put_back(dirty, dropped)
                self.counters["conflict_writes_deferred"] = (
                    self.counters.get("conflict_writes_deferred", 0) + 1
                )
                self._throttle.log(
                    "conflicts-busy",
                    logging.WARNING,
                    "recording split-brain conflicts waits: %s; they are kept in memory and"
                    " written at a later turn",
                    exc,
                )
            except (sqlite3.Error, OSError, StorageError) as exc:
                self._storage_failed(exc)
                return []
            rows, dropped = [], []
        if not ops:
            return []
        updates = published(ops)
        if storage is None or self._storage_error is not None:
            if self._storage_error is not None:
                return []
            self._committed(updates)
            return updates
        term = self._current_term()
        try:
            for op in ops:
                kind = op.kind
                if kind is OpKind.UPDATES:
                    storage.append(
                        op.updates,
                        term=term,
                        at=self._wallclock(),
                        keep_from=self.core.history.keep_from,
                        conflict_rows=rows,
                        conflict_drops=dropped,
                    )
                    rows, dropped = [], []
                elif kind is OpKind.STAGE:
                    storage.stage(op.staged)
                elif kind is OpKind.BEGIN_REPLACE:
                    storage.begin_replace()
                else:
                    storage.finish_replace(op.sequence, term)
        except (sqlite3.Error, OSError, StorageError) as exc:
            self._storage_failed(exc)
            return []
        self._data_term = term
        self._committed(updates)
        return updates

    def _conflicts_dropped(self, dropped: int) -> None:
        """Unresolved conflicts went over ``--max-conflict-bytes``: counted
        (``clone_split_conflicts_dropped_total``), warned at most once per interval."""
        self.counters["split_conflicts_dropped"] = dropped
        self._throttle.log(
            "conflicts-dropped",
            logging.WARNING,
            "%d unresolved split-brain conflicts dropped since start, the oldest first:"
            " they held more than --max-conflict-bytes (%d); resolve them sooner"
            " (clone conflicts) or raise the budget",
            dropped,
            self.core.conflicts.max_bytes,
        )

    def commit_only(self) -> None:
        """Commit this turn's changes, publish nothing (a passive's turn of following)."""
        self.commit()

    def commit_and_publish(self) -> None:
        publish = self._publish
        for frames in self.commit():
            publish(frames)

    def record_term(self) -> None:
        """A promotion: later writes carry our new epoch; record it even
        before the first one, so our rank says we were elected after the peer."""
        storage = self._storage
        term = self._current_term()
        if storage is None or term == self._data_term or self._storage_error is not None:
            return
        try:
            storage.set_position(self.core.store.sequence, term)
        except (sqlite3.Error, OSError, StorageError) as exc:
            self._storage_failed(exc)
            return
        self._data_term = term

    def record_following(self, following: bool) -> None:
        """A role change: record whether we now follow the peer, before we
        publish as the active or apply the peer's first update as the passive.
        Restarted from data written as a follower, we wait for the peer
        instead of serving alone (``BinaryStar(behind_peer=True)``)."""
        storage = self._storage
        if storage is None or following == self._data_following or self._storage_error is not None:
            return
        try:
            storage.record_following(following)
        except (sqlite3.Error, OSError, StorageError) as exc:
            self._storage_failed(exc)
            return
        self._data_following = following

    def _storage_failed(self, exc: BaseException) -> None:
        """Fail-stop: what is in memory can no longer be made durable."""
        self._storage_error = exc
        self.counters["storage_errors"] += 1
        log.critical(
            "cannot write to the data directory %s: %s; stopping so that nothing"
            " unwritten is confirmed (the peer takes over). Fix the disk, then restart.",
            self.config.data_dir,
            exc,
        )
        self.request_stop()
