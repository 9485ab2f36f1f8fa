"""The commit writer (clone.server.committing) and the durability part's handoff to it.

A real data directory and core, the writer's real thread, and a gate on the
storage's ``append`` standing for a slow disk; the loop is played by the test:
what the writer asks the loop to run is collected and run by hand, so each
test says exactly when a commit lands.  No sockets: ``pause`` and ``resume``
are recorded (the loop reads on while a commit is in flight, and pauses only
when what gathers for the next one passes its bound: clone.server.gathering).
"""

from __future__ import annotations

import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from clone.server import durability
from clone.server.committing import CommitJob, CommitWriter
from clone.server.core import Role
from clone.storage import Storage
from tests.server.test_durability_part import _Rig
from tests.support.waiting import eventually

WAIT = 30.0  # generous: the machine is shared


class _Loop:
    """What the writer thread hands the loop, run when the test says."""

    def __init__(self) -> None:
        self.callbacks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()

    def schedule(self, callback: Callable[[], None]) -> None:
        self.callbacks.put(callback)

    def run_next(self) -> None:
        self.callbacks.get(timeout=WAIT)()


class _Gate:
    """The storage's append, held until opened (a slow disk), or failing."""

    def __init__(self, storage: Storage, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.error: BaseException | None = None
        self.threads: list[str] = []
        real = storage.append

        def append(*args: object, **kwargs: object) -> None:
            self.threads.append(threading.current_thread().name)
            self.entered.set()
            assert self.open.wait(WAIT), "the test never opened the gate"
            if self.error is not None:
                raise self.error
            real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(storage, "append", append)


@dataclass
class _Writing:
    rig: _Rig
    loop: _Loop
    gate: _Gate
    pauses: list[str]


class _Clock:
    """Monotonic seconds that the test moves."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, clock: _Clock
) -> Iterator[_Writing]:
    rig = _Rig(tmp_path / "data", clock=clock)
    rig.part.open()
    loop = _Loop()
    pauses: list[str] = []  # the sockets' state changes (pausing twice is pausing once)

    def note(state: str) -> None:
        if not pauses or pauses[-1] != state:
            pauses.append(state)

    rig.part.start_writer(
        loop.schedule, pause=lambda: note("pause"), resume=lambda: note("resume")
    )
    storage = rig.part.storage
    assert storage is not None
    gate = _Gate(storage, monkeypatch)
    try:
        yield _Writing(rig, loop, gate, pauses)
    finally:
        gate.open.set()
        rig.part.close()


def _keys(published: list[list[bytes]]) -> list[bytes]:
    return [frames[0] for frames in published]


def test_an_update_is_published_only_when_its_commit_lands(writing: _Writing) -> None:
    rig, loop, gate, pauses = writing.rig, writing.loop, writing.gate, writing.pauses
    rig.write("/a", b"1")
    rig.write("/b", b"2")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    # Written on the writer's thread; the loop goes on reading, sends nothing.
    assert gate.threads == ["clone-commit"]
    assert rig.part.in_flight and pauses == []
    assert not rig.part.settled
    assert rig.published == [] and rig.committed == []
    assert rig.core.store.sequence == 2 and rig.part.announced_sequence() == 0
    gate.open.set()
    loop.run_next()
    assert _keys(rig.published) == [b"/a", b"/b"] and rig.committed == [rig.published]
    assert not rig.part.in_flight and pauses == [] and rig.part.settled
    assert rig.part.announced_sequence() == 2
    storage = rig.part.storage
    assert storage is not None and storage.sequence == 2


def test_what_changes_meanwhile_goes_in_the_next_commit(writing: _Writing) -> None:
    rig, loop, gate, pauses = writing.rig, writing.loop, writing.gate, writing.pauses
    confirmed: list[str] = []
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    rig.part.when_published(lambda: confirmed.append("a"))
    assert gate.entered.wait(WAIT)
    # Two turns of writes while the first commit is in flight: the loop
    # reads on, and both gather into the next job.
    rig.write("/c", b"3")
    rig.part.commit_and_publish()  # one in flight at a time: it waits
    rig.part.when_published(lambda: confirmed.append("c"))
    rig.write("/d", b"4")
    rig.part.commit_and_publish()
    rig.part.when_published(lambda: confirmed.append("d"))
    assert rig.part.announced_sequence() == 0 and rig.published == []
    assert pauses == []
    gate.open.set()
    loop.run_next()  # the first lands; the gathered two go to the writer as one
    assert _keys(rig.published) == [b"/a"] and confirmed == ["a"]
    assert rig.part.in_flight and pauses == []
    assert rig.part.announced_sequence() == 1
    loop.run_next()
    assert _keys(rig.published) == [b"/a", b"/c", b"/d"] and confirmed == ["a", "c", "d"]
    assert pauses == [] and not rig.part.in_flight
    storage = rig.part.storage
    assert storage is not None and storage.timing.commits == 2


def test_a_full_gathering_pauses_the_sockets_until_the_commit_lands(writing: _Writing) -> None:
    """Past its bound in updates (or bytes), what gathers behind a commit in
    flight stops the reading; the landing hands it to the writer whole and
    reads again."""
    rig, loop, gate, pauses = writing.rig, writing.loop, writing.gate, writing.pauses
    rig.part._gate.max_rows = 3  # the production bound is 8,192 updates
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    for n in range(3):  # three turns of one update each: at the bound, not past it
        rig.write(f"/g{n}", b"x")
        rig.part.commit_and_publish()
    assert pauses == []
    rig.write("/g3", b"x")
    rig.part.commit_and_publish()  # the fourth: past it
    assert pauses == ["pause"] and rig.counters["commit_gather_pauses"] == 1
    rig.write("/timer", b"y")  # a timer's turn while paused: gathered too, no second pause
    rig.part.commit_and_publish()
    assert pauses == ["pause"] and rig.counters["commit_gather_pauses"] == 1
    gate.open.set()
    loop.run_next()
    assert _keys(rig.published) == [b"/a"]
    assert pauses == ["pause", "resume"] and rig.part.in_flight
    loop.run_next()
    assert _keys(rig.published)[1:] == [b"/g0", b"/g1", b"/g2", b"/g3", b"/timer"]
    storage = rig.part.storage
    assert storage is not None and storage.timing.commits == 2


def test_a_byte_bound_pauses_as_the_row_bound_does(writing: _Writing) -> None:
    rig, gate, pauses = writing.rig, writing.gate, writing.pauses
    rig.part._gate.max_bytes = 1000
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    rig.write("/big", b"v" * 900)
    rig.part.commit_and_publish()
    assert pauses == []  # 900 bytes of value plus its key, uuid and sequence: under 1000
    rig.write("/big2", b"v" * 200)
    rig.part.commit_and_publish()
    assert pauses == ["pause"]
    assert rig.core.journal.nbytes > 1000 and rig.core.journal.rows == 2


def test_what_waited_for_a_commit_is_released_a_turn_s_budget_at_a_time(
    writing: _Writing, clock: _Clock
) -> None:
    """200 snapshot requests that came in during one commit are not all
    served in the turn it lands: each turn runs what fits its budget, in order."""
    rig, loop, gate = writing.rig, writing.loop, writing.gate
    ran: list[int] = []

    def request(n: int) -> Callable[[], None]:
        def serve() -> None:
            ran.append(n)
            clock.now += 0.004  # each takes 4 ms of the loop

        return serve

    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    for n in range(10):
        rig.part.when_published(request(n))
    gate.open.set()
    loop.run_next()  # lands: 10 ms of the 40 it would take
    assert _keys(rig.published) == [b"/a"] and ran == [0, 1, 2]
    late: list[str] = []
    rig.part.when_published(lambda: late.append("late"))  # behind those released
    assert late == []
    turns = 1
    while not late:
        loop.run_next()
        turns += 1
    assert ran == list(range(10)) and late == ["late"]  # in order, the late one last
    assert turns == 4  # 3, 3, 3, then the tenth and the late one


def test_a_failed_commit_stops_the_server_and_confirms_nothing(writing: _Writing) -> None:
    rig, loop, gate, pauses = writing.rig, writing.loop, writing.gate, writing.pauses
    confirmed: list[str] = []
    gate.error = sqlite3.OperationalError("database or disk is full")
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    rig.part.when_published(lambda: confirmed.append("a"))
    gate.open.set()
    loop.run_next()
    assert rig.stops == 1 and rig.counters["storage_errors"] == 1
    assert rig.part.error is not None
    assert rig.published == [] and confirmed == []
    assert pauses == ["pause"]  # fail-stop: paused until the server stops
    rig.write("/b", b"2")
    rig.part.commit_and_publish()
    rig.part.when_published(lambda: confirmed.append("b"))
    assert rig.published == [] and confirmed == [] and not rig.part.in_flight


def test_a_commit_on_the_loop_waits_for_the_one_in_flight(writing: _Writing) -> None:
    """A role change commits on the loop thread: the commit in flight lands
    (published, in order) before the loop uses the storage itself."""
    rig, gate, pauses = writing.rig, writing.gate, writing.pauses
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    rig.write("/b", b"2")
    opener = threading.Thread(target=gate.open.set)
    opener.start()
    batch = rig.part.commit()
    opener.join()
    assert _keys(rig.published) == [b"/a"] and _keys(batch) == [b"/b"]
    assert gate.threads == ["clone-commit", threading.current_thread().name]
    assert not rig.part.in_flight and pauses == []


def test_the_stop_finishes_the_commit_in_flight(
    tmp_path: Path, writing: _Writing, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig, gate = writing.rig, writing.gate
    monkeypatch.setattr(durability, "STOP_WAIT", WAIT)  # a busy machine's thread may be slow
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    threading.Thread(target=gate.open.set).start()
    rig.part.close()  # waits for the writer: the transaction is never cut
    assert rig.published == []  # written, never confirmed: the server stopped
    again = _Rig(tmp_path / "data")
    again.part.open()
    try:
        assert again.core.store.sequence == 1 and again.core.store.get("/a") is not None
    finally:
        again.part.close()


def test_the_stop_does_not_wait_long_for_a_stuck_commit(
    writing: _Writing, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM stops the server at once even while its disk is stuck: the
    commit is left as a kill would leave it (SQLite keeps it whole or not at all)."""
    rig, gate = writing.rig, writing.gate
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    assert gate.entered.wait(WAIT)
    started = time.monotonic()
    rig.part.close()  # the gate stays shut: the disk never answers
    assert time.monotonic() - started < WAIT / 2
    assert rig.part.storage is None and rig.published == []
    assert "did not finish within" in caplog.text


def test_the_stop_gives_the_commit_and_the_close_what_is_left_of_its_budget(
    writing: _Writing, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handover that spent most of the stop's budget leaves the commit in
    flight and the final checkpoint the rest, never less than the minimum:
    a stuck disk and a stuck passive together must not make SIGTERM take
    their two waits one after the other."""
    from clone.server.committing import CommitWriter
    from clone.storage import Storage

    rig, gate = writing.rig, writing.gate
    gate.open.set()
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    given: dict[str, float] = {}
    real_writer_close, real_close_within = CommitWriter.close, Storage.close_within

    def writer_close(self: CommitWriter, timeout: float | None = None) -> bool:
        given["commit"] = float(timeout or 0)
        return real_writer_close(self, timeout)

    def close_within(self: Storage, timeout: float) -> bool:
        given["close"] = timeout
        return real_close_within(self, timeout)

    monkeypatch.setattr(CommitWriter, "close", writer_close)
    monkeypatch.setattr(Storage, "close_within", close_within)
    rig.part.close(durability.STOP_WAIT - 0.49)  # a handover took 0.49 s of 0.5
    assert given["commit"] == durability.MIN_STOP_WAIT
    assert given["close"] == durability.MIN_STOP_WAIT


def test_the_stop_does_not_wait_long_for_a_stuck_final_checkpoint(
    writing: _Writing, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The commit landed, but closing the data directory (its final WAL
    checkpoint) hangs on the disk: the stop goes on within STOP_WAIT, as a
    loaded run saw a SIGTERM take 1.09 s when it waited for it."""
    rig, gate = writing.rig, writing.gate
    gate.open.set()
    rig.write("/a", b"1")
    rig.part.commit_and_publish()
    storage = rig.part.storage
    assert storage is not None
    release = threading.Event()
    entered = threading.Event()
    real_close = storage.close

    def stuck_close() -> None:
        entered.set()
        release.wait(WAIT)
        real_close()

    monkeypatch.setattr(storage, "close", stuck_close)
    try:
        rig.part.close()
        assert entered.is_set() and not release.is_set()  # returned while it hung
        assert rig.part.storage is None
        assert "closing the data directory did not finish within" in caplog.text
    finally:
        release.set()


def test_the_writer_runs_jobs_in_order_and_nothing_after_a_failure() -> None:
    ran: list[int] = []
    landed = threading.Semaphore(0)
    writer = CommitWriter(landed.release)

    def job(n: int, fail: bool = False) -> CommitJob:
        def write() -> None:
            ran.append(n)
            if fail:
                raise OSError(28, "No space left on device")

        return CommitJob(write)

    jobs = [job(1), job(2, fail=True), job(3)]
    for j in jobs:
        writer.submit(j)
    for j in jobs:
        assert writer.wait(j, WAIT)
    assert writer.close(WAIT)
    assert ran == [1, 2]  # the third was never written
    assert jobs[0].error is None
    assert isinstance(jobs[1].error, OSError) and jobs[2].error is jobs[1].error
    for _ in jobs:
        assert landed.acquire(timeout=WAIT)  # the loop was asked to land each one
    with pytest.raises(ValueError):
        writer.submit(job(4))
    eventually(lambda: not writer.alive, WAIT, "the writer thread to end")


def test_a_passive_turn_is_committed_on_the_writer_and_not_published(writing: _Writing) -> None:
    rig, loop, gate, pauses = writing.rig, writing.loop, writing.gate, writing.pauses
    rig.write("/a", b"1")
    rig.part.commit_only()  # a turn of following the active
    assert gate.entered.wait(WAIT) and gate.threads == ["clone-commit"]
    rig.write("/b", b"2")  # the next turn of following, read while the first commits
    rig.core.role = Role.PASSIVE  # (the rig's core applies as a standalone one)
    rig.part.commit_only()
    assert pauses == []
    gate.open.set()
    loop.run_next()
    assert rig.published == [] and rig.part.in_flight  # the second went to the writer
    loop.run_next()
    assert rig.published == [] and pauses == []
    storage = rig.part.storage
    assert storage is not None and storage.sequence == 2
