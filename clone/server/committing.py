"""The commit writer: a turn's commit on a thread of its own, its publication on the loop.

Why: a turn's commit (the SQLite transaction of its updates and, with
``--fsync batch`` or ``always``, its fsync) used to run on the loop thread.
On a slow or full disk, or on a machine whose page cache is being written
back, one commit took seconds, and for all that time the loop sent no HUGZ
and answered no Binary Star message: the backup took over from a primary that
was only waiting for its disk (the hostile drill's ``disk`` attack).

How this works: the durability part (:mod:`.durability`) gathers a turn's
changes on the loop, as before, and hands their write to the one
:class:`CommitWriter` thread as a :class:`CommitJob`.  The writer runs the
jobs in the order given, one at a time, records each one's error (if any),
sets its ``done`` event and asks the loop, through ``notify`` (tornado's
``add_callback``, which is safe from any thread), to *land* it: only then are
its updates published and the replies that waited for it sent.  So an update
is still published only after its commit, and in sequence order.

While a job is in flight the loop goes on reading and applying: what
changes meanwhile is *gathered* in the core's journal and is the next job,
handed to the writer as soon as this one lands (one job in flight, one
gathering: a double buffer, :mod:`.gathering`).  Only when the gathering
holds more than its bound in bytes or updates are the server's streams
paused (:meth:`.sockets.ServerSockets.pause`) until the job in flight lands.
So the loop's work on the next turn overlaps this one's fsync.  The timers
run: the heartbeat announces the sequence published so far, and Binary
Star's own sockets are read as always.  A reply that names a sequence waits
until everything applied before it is published (the caller's ``settled``).
A job's write may use the storage's connection only from the writer thread;
the loop waits for the writer (:meth:`CommitWriter.wait`) before it uses the
storage itself (a role change, the close).

A write error is kept by the writer: every job after it fails with the same
error without touching the disk, so nothing is written past a failed commit
(the server fail-stops when the loop lands the first failed job).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["CommitJob", "CommitWriter"]

log = logging.getLogger("clone.server.reactor")


class CommitJob:
    """One turn's commit: ``write`` runs on the writer thread; the rest is
    the loop's (what to publish and whom to tell once it has landed)."""

    __slots__ = ("done", "error", "through", "turn", "waiters", "write")

    def __init__(
        self,
        write: Callable[[], None],
        *,
        turn: Any = None,
        through: int = 0,
        waiters: list[Callable[[], None]] | None = None,
    ) -> None:
        self.write = write
        #: What the loop gathered for this job (the durability part's record).
        self.turn = turn
        #: The store's sequence once this job's updates are published.
        self.through = through
        #: Run on the loop, in order, once the job's updates are published.
        self.waiters: list[Callable[[], None]] = waiters if waiters is not None else []
        #: Set by the writer once the write returned or raised.
        self.done = threading.Event()
        #: What the write raised, or None.
        self.error: BaseException | None = None


class CommitWriter:
    """The thread that runs every commit of one server, in order.

    ``notify`` is called from the writer thread after each job, to have the
    loop land it; it must be thread-safe and must not raise (a closed loop:
    nothing to land).
    """

    def __init__(self, notify: Callable[[], None], *, name: str = "clone-commit") -> None:
        self._notify = notify
        self._jobs: queue.SimpleQueue[CommitJob | None] = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._closed = False
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: CommitJob) -> None:
        """Write ``job`` after every job submitted before it."""
        if self._closed:
            raise ValueError("the commit writer is closed")
        self._jobs.put(job)

    def wait(self, job: CommitJob, timeout: float | None = None) -> bool:
        """Block until ``job`` was written (or failed); whether it was, within ``timeout``."""
        return job.done.wait(timeout)

    def close(self, timeout: float | None = None) -> bool:
        """Write what was submitted, then end the thread; whether it ended within ``timeout``.

        Nothing is abandoned half written: a job whose write runs is finished
        (SQLite's transaction commits or rolls back) before the storage may be
        closed.
        """
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._failed is not None:
                # Fail-stop: nothing is written past a failed commit.
                job.error = self._failed
            else:
                try:
                    job.write()
                except BaseException as exc:  # handed to the loop, which stops the server
                    job.error = self._failed = exc
            job.done.set()
            try:
                self._notify()
            except Exception:
                log.exception("the commit writer could not reach the loop")
