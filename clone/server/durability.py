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
from collections import deque
from collections.abc import Callable
from dataclasses import astuple, dataclass

from clone.errors import StorageBusy, StorageError
from clone.server.budget import check_fits
from clone.server.committing import CommitJob, CommitWriter
from clone.server.config import ServerConfig
from clone.server.conflicts import ConflictRecord
from clone.server.core import Role, ServerCore
from clone.server.gathering import Gate, GateAction, GateEvent
from clone.server.heap import freeze_state
from clone.server.journal import Op, OpKind, published
from clone.server.shared import TURN_BUDGET, Shared
from clone.storage import FsyncPolicy, Storage, restore_into

__all__ = ["CONFLICTS_BUSY_WAIT", "MIN_STOP_WAIT", "STOP_WAIT", "Durability"]

log = logging.getLogger("clone.server.reactor")

#: How long a turn's conflicts-only write waits for a lock the checkpointer
#: holds before leaving them for a later turn (seconds): the loop's turn, not
#: the 2 s an update's commit may wait.
CONFLICTS_BUSY_WAIT = 0.05

#: Seconds the stop waits, from the SIGTERM, for a handover, the commit in
#: flight and the close, together: it must end within a second even while
#: both the disk and the passive are stuck.  The close always gets the minimum.
STOP_WAIT, MIN_STOP_WAIT = 0.5, 0.05


@dataclass(slots=True)
class _Turn:
    """One turn's changes, gathered on the loop, written on either thread."""

    ops: list[Op]
    updates: list[list[bytes]]  # what its commit lets us publish
    dirty: list[ConflictRecord]
    dropped: list[int]
    term: int
    at: float = 0.0
    keep_from: int | None = None
    busy: StorageBusy | None = None  # its conflicts-only write found the lock held
    publish: bool = True  # False: a passive's turn of following, committed only


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
        # The commit writer (clone.server.committing), once the loop runs.
        self._writer: CommitWriter | None = None
        self._job: CommitJob | None = None  # the commit in flight
        self._waiters: list[Callable[[], None]] = []  # for the next job
        self._published_through = 0  # while a job is in flight: what HUGZ may announce
        self._next_publish = False  # whether the next job's updates are published
        # Committed, waiting for their turn (:meth:`_release`).
        self._ready: deque[Callable[[], None]] = deque()
        self._ready_scheduled = False
        self._schedule: Callable[[Callable[[], None]], object] | None = None
        # Whether the loop reads while a commit is in flight (clone.server.gathering).
        self._gate = Gate()

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
            return freeze_state()  # the empty store's dict, as it grows (clone.server.heap)
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
        freeze_state()  # the loaded store, out of the collector's walks (clone.server.heap)

    def close(self, wait: float = STOP_WAIT) -> None:
        """Wait for the commit in flight (it is finished, not published:
        nothing is confirmed after the stop), then close the data directory.

        At most ``wait`` seconds for both (the rest of :data:`STOP_WAIT`): a
        commit stuck on a slow disk is left to finish or not as the process
        exits, as if it had been killed in the middle of it (SQLite rolls an
        unfinished transaction back at the next start; its writers were never
        told), so that SIGTERM still stops the server at once."""
        wait = max(MIN_STOP_WAIT, wait)
        writer, self._writer = self._writer, None
        self._job = None
        self._waiters.clear()  # nothing is answered after the stop
        self._ready.clear()
        started = time.monotonic()
        if writer is not None and not writer.close(wait):
            log.warning("the commit in flight did not finish within %.2f s of the stop; exiting"
                        " without it (its updates were not confirmed; SQLite keeps or rolls it"
                        " back whole at the next start)", wait)  # fmt: skip
            self._storage = None
            return
        # The final checkpoint shares the bound (clone.storage.db.Storage.close_within).
        storage, self._storage = self._storage, None
        left = max(MIN_STOP_WAIT, wait - (time.monotonic() - started))
        if storage is not None and not storage.close_within(left):
            log.warning("closing the data directory did not finish within %.2f s of the stop;"
                        " exiting without it (the next start replays its WAL)", wait)

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
        """Write this turn's changes in one transaction, on the loop thread,
        after any commit in flight has landed; return the updates, in order,
        which may now be published.  Nothing on a write failure.

        The conflicts recorded, resolved or dropped this turn go in the
        transaction of the turn's updates; in a turn without updates (a
        heal's conflicts change no key) in one of their own, which waits
        briefly for the checkpointer's lock and, if it is still held, is
        tried again next turn: a conflict is in memory and answered already,
        so a late row risks only a crash in between (its writer was told all
        the same), and a busy database must not stop the server.
        """
        self.drain()
        turn = self._gather()
        waiters, self._waiters = self._waiters, []
        storage = self._storage
        updates: list[list[bytes]] = []
        if turn is not None and self._storage_error is None:
            if storage is None:
                updates = turn.updates
                if updates:
                    self._committed(updates)
            else:
                try:
                    self._write(storage, turn)
                except (sqlite3.Error, OSError, StorageError) as exc:
                    self._finish(turn, exc)
                else:
                    updates = self._finish(turn, None)
        if self._storage_error is None:
            self._release(waiters)  # committed: what waited may go
        return updates

    def _gather(self) -> _Turn | None:
        """On the loop: take this turn's changes from the journal and the conflicts book."""
        ops = self.core.journal.take()
        book = self.core.conflicts
        if book.dropped != self.counters.get("split_conflicts_dropped", 0):
            self._conflicts_dropped(book.dropped)
        dirty = book.take_dirty()
        dropped = book.take_dropped()
        if self._storage is None or self._storage_error is not None:
            dirty, dropped = [], []
        if not ops and not dirty and not dropped:
            return None
        return _Turn(
            ops,
            published(ops) if ops else [],
            dirty,
            dropped,
            self._current_term(),
            self._wallclock(),
            self.core.history.keep_from,
        )

    @staticmethod
    def _write(storage: Storage, turn: _Turn) -> None:
        """Write a gathered turn (on the loop or the writer thread); raises on a write error."""
        rows: list[tuple[object, ...]] = [astuple(r) for r in turn.dirty]
        dropped = turn.dropped
        ops = turn.ops
        if (rows or dropped) and not any(op.kind is OpKind.UPDATES for op in ops):
            try:
                storage.write_conflicts(rows, dropped, busy_timeout=CONFLICTS_BUSY_WAIT)
            except StorageBusy as exc:
                turn.busy = exc
            rows, dropped = [], []
        term = turn.term
        for op in ops:
            kind = op.kind
            if kind is OpKind.UPDATES:
                storage.append(
                    op.updates,
                    term=term,
                    at=turn.at,
                    keep_from=turn.keep_from,
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

    def _finish(self, turn: _Turn, error: BaseException | None) -> list[list[bytes]]:
        """On the loop, once a turn's write returned: the updates to publish."""
        if turn.busy is not None:
            self.core.conflicts.put_back(turn.dirty, turn.dropped)
            self.counters["conflict_writes_deferred"] = (
                self.counters.get("conflict_writes_deferred", 0) + 1
            )
            self._throttle.log("conflicts-busy", logging.WARNING, "recording split-brain"
                               " conflicts waits: %s; they are kept in memory and written at a"
                               " later turn", turn.busy)  # fmt: skip
        if error is not None:
            self._storage_failed(error)
            return []
        if not turn.ops:
            return []
        self._data_term = turn.term
        self._committed(turn.updates)
        return turn.updates

    # -- the commit writer (clone.server.committing) ----------------------------

    def start_writer(
        self,
        schedule: Callable[[Callable[[], None]], object],
        *,
        pause: Callable[[], None],
        resume: Callable[[], None],
    ) -> None:
        """From now on :meth:`commit_and_publish` commits on the writer thread.

        ``schedule`` runs a callback on the loop and is safe from any thread
        (tornado's ``add_callback``); ``pause`` and ``resume`` stop and restart
        reading the server's sockets, as the gate says (clone.server.gathering).
        Without a data directory there is nothing to write and no thread."""
        if self._storage is None or self._writer is not None:
            return
        self._gate = Gate(pause, resume)
        self._schedule = schedule

        def notify() -> None:
            try:
                schedule(self._land)
            except RuntimeError:
                pass  # the loop is closed: close() waits for the writer instead

        self._writer = CommitWriter(notify)

    @property
    def in_flight(self) -> bool:
        """Whether a commit is being written on the writer thread."""
        return self._job is not None

    def announced_sequence(self) -> int:
        """The sequence a HUGZ may announce: the last one published.  While a
        commit is in flight its updates are applied but not yet sent."""
        return self._published_through if self._job is not None else self.core.store.sequence

    @property
    def settled(self) -> bool:
        """Whether every change applied so far is published: a reply that
        tells the state (a retry's ``ok``, a ``conflict``) may go at once."""
        return self._job is None and not self.core.journal

    def when_published(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` once every change made so far is committed and
        published: now if nothing waits, else when the commit holding them
        lands.  Never after a write error (nothing unwritten is confirmed)."""
        if self._storage_error is not None:
            return
        if self._job is None and not self.core.journal:
            if self._ready:
                self._ready.append(callback)  # after what was released before it
            else:
                callback()
        elif self._job is not None and not self.core.journal:
            self._job.waiters.append(callback)
        else:
            self._waiters.append(callback)  # in the next job
            if self._job is None:
                self.commit_and_publish()

    def drain(self) -> None:
        """Block until no commit is in flight, publishing each as it lands
        (a role change, which writes on the loop thread next)."""
        while self._job is not None and self._writer is not None:
            self._writer.wait(self._job)
            self._land(more=False)  # what changed since is the caller's to commit

    def _submit(self, publish: bool = True) -> None:
        """Hand what was gathered to the writer; publish it when the commit
        lands if ``publish``.  The loop reads on meanwhile (the gate)."""
        writer, storage = self._writer, self._storage
        assert writer is not None and storage is not None
        self._next_publish = False
        turn = self._gather()
        waiters, self._waiters = self._waiters, []
        if turn is None or self._storage_error is not None:
            if self._storage_error is None:
                self._release(waiters)
            return
        turn.publish = publish
        updates = turn.updates
        before = int.from_bytes(updates[0][1], "big") - 1 if updates else self.core.store.sequence
        self._published_through = before
        job = CommitJob(
            lambda: self._write(storage, turn),
            turn=turn,
            through=self.core.store.sequence,
            waiters=waiters,
        )
        self._job = job
        writer.submit(job)

    def _land(self, more: bool = True) -> None:
        """On the loop: the job in flight was written; publish it, tell its
        waiters, hand over what was gathered meanwhile (if ``more``), and
        read again if the gathering had filled."""
        job = self._job
        if job is None or not job.done.is_set():
            return
        self._job = None
        updates = self._finish(job.turn, job.error)
        if self._storage_error is not None:
            return  # fail-stop: the sockets are paused until the server stops
        if job.turn.publish:
            publish = self._publish
            for frames in updates:
                publish(frames)
        self._published_through = job.through
        self._release(job.waiters)
        if more and self._job is None and (self.core.journal or self._waiters):
            # Only a passive's turns of following are committed without publishing.
            self._submit(publish=self._next_publish or self.core.role is not Role.PASSIVE)
        self._gate.handle(GateEvent.LANDED)

    def _release(self, callbacks: list[Callable[[], None]]) -> None:
        """Run what waited for a commit, in order, at most a turn's budget
        now and the rest in the next turns: a storm of snapshot requests that
        came in during one commit must not all be served in one turn."""
        if not callbacks:
            return
        self._ready.extend(callbacks)
        if not self._ready_scheduled:
            self._run_ready()

    def _run_ready(self) -> None:
        self._ready_scheduled = False
        ready = self._ready
        stop_at = self._clock() + TURN_BUDGET
        while ready:
            if self._storage_error is not None:
                ready.clear()  # fail-stop: nothing more is confirmed
                return
            self._run_waiter(ready.popleft())
            if ready and self._schedule is not None and self._clock() >= stop_at:
                self._ready_scheduled = True
                self._schedule(self._run_ready)
                return

    def _run_waiter(self, callback: Callable[[], None]) -> None:
        try:
            callback()
        except Exception:
            self.counters["internal_errors"] = self.counters.get("internal_errors", 0) + 1
            log.exception("internal error in %s", getattr(callback, "__name__", callback))

    def _conflicts_dropped(self, dropped: int) -> None:
        """Unresolved conflicts went over ``--max-conflict-bytes``: counted
        (``clone_split_conflicts_dropped_total``), warned at most once per interval."""
        self.counters["split_conflicts_dropped"] = dropped
        self._throttle.log("conflicts-dropped", logging.WARNING, "%d unresolved split-brain"
                           " conflicts dropped since start, the oldest first: they held more than"
                           " --max-conflict-bytes (%d); resolve them sooner (clone conflicts) or"
                           " raise the budget", dropped, self.core.conflicts.max_bytes)  # fmt: skip

    def commit_only(self) -> None:
        """Commit this turn's changes, publish nothing (a passive's turn of
        following): on the writer thread as :meth:`commit_and_publish`."""
        if self._writer is None:
            self.commit()
        elif self._storage_error is not None:
            self._gather()  # fail-stop: dropped, never written
        elif self._job is None:
            self._submit(publish=False)
        else:
            self._gathered()

    def commit_and_publish(self) -> None:
        """Commit this turn's changes and publish them once committed: on the
        writer thread once :meth:`start_writer` ran (later, when the commit
        lands; one in flight at a time, what comes meanwhile goes in the
        next), else here and now."""
        if self._writer is None:
            publish = self._publish
            for frames in self.commit():
                publish(frames)
            return
        if self._storage_error is not None:
            self._gather()  # fail-stop: dropped, never written nor published
        elif self._job is None:
            self._submit()
        else:
            # In the next job, published when it lands; a passive's journal
            # holds what it follows, never published by it.
            self._next_publish = self._next_publish or self.core.role is not Role.PASSIVE
            self._gathered()

    def _gathered(self) -> None:
        """A turn ended while a commit is in flight: past the gathering's
        bounds, stop reading until it lands (clone.server.gathering)."""
        j, gate = self.core.journal, self._gate
        if gate.turn_ended(in_flight=True, nbytes=j.nbytes, rows=j.rows) is GateAction.PAUSE:
            self.counters["commit_gather_pauses"] = gate.pauses
            self._throttle.log("commit-gather", logging.INFO, "the next commit holds %d B, %d"
                               " updates while one is in flight: reading waits for the disk"
                               " (%d times)", j.nbytes, j.rows, gate.pauses)  # fmt: skip

    def record_term(self) -> None:
        """A promotion: later writes carry our new epoch; record it even
        before the first one, so our rank says we were elected after the peer."""
        self.drain()
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
        self.drain()
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
        self._gate.handle(GateEvent.FAILED)  # fail-stop: nothing more is read
        log.critical(
            "cannot write to the data directory %s: %s; stopping so that nothing"
            " unwritten is confirmed (the peer takes over). Fix the disk, then restart.",
            self.config.data_dir,
            exc,
        )
        self.request_stop()
