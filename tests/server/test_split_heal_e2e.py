"""A split brain of 100,000 writes heals in bounded steps.

Real processes: a durable pair with the server default heartbeat (250 ms),
whose Binary Star link (and only that) runs through a :class:`CuttableLink` on
loopback.  The test cuts the link, votes the backup active (a raw ICANHAZ?),
writes 100,000 keys to the primary's collector alone, and heals the link: the
primary, elected earlier, steps down, resyncs from the backup and has 100,000
split writes to deliver.  That is the issue's real sequence (a partition of the
HA link only, clients writing on both sides) rather than a backlog built inside
a server by hand, and on loopback it needs no root: the partition drill does
the same with network namespaces (``scripts/drill --scenario partition-split
--split-writes N``), too slowly for a test.  The island client's writes go to
the primary only (a raw PUB, as a client cut off from the backup would).

What it shows: during the heal no heartbeat of either server is held back by
its own loop by more than one interval (each server logs ``heartbeat ran N ms
late, W ms of it waiting for a CPU`` at WARNING when the loop's part, N - W, is;
its counters count from its start, which includes the start itself and the
100,000 writes, so the test reads the log lines written once the loser has
stepped down and starts sending: the step-down's commits wait for the disk on
the loop, which the heal does not bound).
The wait for a CPU is the kernel's figure for the loop's thread (schedstat): at
load 20-30 on this 2-core machine the heartbeats ran 0.5-1.2 s late however
short the loop's steps, which a probe of the test's own wake-ups (150-400 ms)
did not cover, and which measured the scheduler, not the server.  So is the
loop's time off CPU while the server's other Python threads waited for a CPU
(at most the smaller of the two): the loop waiting for the interpreter lock
that a starved thread of ours (the commit writer) held; every write reaches
the state of the server that ends active, whether the winner applies the
forwarded writes or (the backup killed part-way) the loser, voted active again,
applies the rest itself; and SIGTERM stops a server within 1 s in the middle of
a heal.  The tests that end the heal part-way (the winner killed, SIGTERM)
take a backlog of 25,000 (:data:`PART_WAY_WRITES`): what they check does not
depend on its size.
"""

from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.support.ports import free_base_port, free_port
from tests.support.servers import (
    ServerProcess,
    Servers,
    answers_icanhaz,
    log_line,
    read_stats,
    server_pool,
)
from tests.support.tcp_link import CuttableLink
from tests.support.waiting import eventually

SPLIT_WRITES = 100_000
#: The backlog of the tests that stop the heal part-way (the winner killed,
#: SIGTERM): what they check does not grow with the backlog, only their cost
#: does, so they take a quarter of it.  25,000 writes are still a hundred of
#: the heal's 256-write steps, and a server that blocked its loop for the
#: whole backlog (the fault behind the SIGTERM tests, once more than 50 s at
#: 100,000) would still hold SIGTERM seconds past its 1 s bound.  Each 100,000
#: cost some 12 CPU-seconds of the suite's CPU-bound run.
PART_WAY_WRITES = 25_000
HEARTBEAT_MS = 250  # the server's default: the bound is one interval of it

# 100,000 writes, a split and its heal: about 40 s on an idle 2-core machine,
# several times that when it is shared.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    with server_pool(tmp_path, request, heartbeat_ms=HEARTBEAT_MS) as pool:
        yield pool


def _num(server: ServerProcess, name: str) -> int:
    value = read_stats(server)[name]
    assert isinstance(value, int)
    return value


class _SchedulerProbe:
    """How late the host wakes a sleeping thread (ms), at worst, while it runs.

    On a machine with far more runnable processes than cores no process is
    scheduled on time, whatever its loop does: a heartbeat cannot be more
    punctual than the host lets it be.  So a server's heartbeat may be late
    by one interval plus what this probe, in the test process, saw at worst
    meanwhile; with an idle host that is the bound itself.
    """

    def __init__(self) -> None:
        self.worst_ms = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sched-probe", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            before = time.monotonic()
            time.sleep(0.01)
            late = (time.monotonic() - before - 0.01) * 1000
            self.worst_ms = max(self.worst_ms, late)

    def __enter__(self) -> _SchedulerProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


_LATE = re.compile(r"heartbeat ran (\d+) ms late, (\d+) ms of it waiting for a CPU")
_OFF_CPU = re.compile(r"was off CPU (\d+) ms;.* its other Python threads waited (\d+) ms for a CPU")


def _own_ms(line: str) -> int | None:
    """Of a late-heartbeat warning, the ms the loop itself held the heartbeat
    back (None: not such a warning): the lateness less the loop thread's wait
    for a CPU, and less its time off CPU while the server's other Python threads
    waited for one (the interpreter lock held by a thread the host did not
    run: clone.server.lateness).  What is left is the loop's running and
    whatever else it blocked on (the disk, a lock of its own)."""
    m = _LATE.search(line)
    if m is None:
        return None
    own = int(m.group(1)) - int(m.group(2))
    if (off := _OFF_CPU.search(line)) is not None:
        own -= min(int(off.group(1)), int(off.group(2)))
    return own


def _late_lines(server: ServerProcess, after: int) -> list[str]:
    """The server's late-heartbeat warnings since ``after`` in which the loop
    itself held the heartbeat back by more than an interval (:func:`_own_ms`):
    on a loaded host most of a heartbeat's lateness is the wait for a CPU
    however short the loop's steps are."""
    with open(server.log_path, "rb") as f:
        f.seek(after)
        text = f.read().decode(errors="replace")
    return [
        line
        for line in text.splitlines()
        if (own := _own_ms(line)) is not None and own > HEARTBEAT_MS
    ]


def test_the_loops_own_part_leaves_out_the_hosts_waits() -> None:
    """The judgement itself, on warnings as the server writes them."""
    head = "heartbeat ran 1025 ms late, 753 ms of it waiting for a CPU: the reactor was blocked"
    tail = "all the process's threads ran 31 ms, its other Python threads waited {} ms for a CPU"
    split = ("(of the last 1090 ms the loop thread ran {} ms, waited 754 ms for a CPU"
             " and was off CPU {} ms; ")
    # The loop ran 26 ms; off CPU 310 ms while the commit writer, holding the
    # interpreter lock, waited 280 ms for a CPU: 1025 - 753 - 280.
    assert _own_ms(f"{head} {split.format(26, 310)}{tail.format(280)})") == -8
    # Off CPU with nothing of ours waiting: blocked on its own (a disk, a lock).
    assert _own_ms(f"{head} {split.format(26, 310)}{tail.format(0)})") == 272
    # Running is always the loop's own.
    assert _own_ms(f"{head} {split.format(290, 46)}{tail.format(900)})") == 272 - 46
    # Without the kernel's split, the lateness less the loop's wait.
    assert _own_ms(head) == 272
    assert _own_ms("stats: {}") is None


class _Split:
    """A pair whose HA link goes through two cuttable links."""

    def __init__(self, servers: Servers, writes: int) -> None:
        p_port, b_port = free_base_port(), free_base_port()
        p_ha, b_ha = free_port(), free_port()
        # The primary's SUB reaches the backup's HA PUB through to_backup, and
        # the backup's reaches the primary's through to_primary.
        self.to_backup = CuttableLink(b_ha)
        self.to_primary = CuttableLink(p_ha)

        def args(role: str, port: int, ha: int, peer: int, link: int) -> list[str]:
            return [
                f"--{role}",
                "--port", str(port),
                "--peer", f"127.0.0.1:{peer}",
                "--ha-port", str(ha),
                "--peer-ha", f"127.0.0.1:{link}",
                "--bind", "127.0.0.1",
                "--heartbeat", str(HEARTBEAT_MS),
                "--verbose",
                "--data-dir", str(servers.data_dir(role)),
                "--peer-wait", "0.5",
                # The split writes must fit the loser's history to be found.
                "--history", str(writes + 20_000),
            ]  # fmt: skip

        self.primary = servers.spawn(
            "primary", args("primary", p_port, p_ha, b_port, self.to_backup.port), p_port, p_ha
        )
        self.backup = servers.spawn(
            "backup", args("backup", b_port, b_ha, p_port, self.to_primary.port), b_port, b_ha
        )
        self.primary.wait_log("now ACTIVE", 30)
        self.backup.wait_log("synced from", 30)

    def close(self) -> None:
        self.to_backup.close()
        self.to_primary.close()

    def cut(self) -> None:
        self.to_backup.cut()
        self.to_primary.cut()

    def heal(self) -> None:
        self.to_backup.heal()
        self.to_primary.heal()


def _write_to(server: ServerProcess, count: int) -> None:
    """``count`` KVSETs to ``server``'s collector only, as fast as it takes them."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 0)  # queue, never drop
        pub.connect(f"tcp://127.0.0.1:{server.port + 2}")
        before = _num(server, "sequence")
        probe = 0

        def subscribed() -> bool:
            # A PUB drops what it sends before the SUB's subscription arrives.
            nonlocal probe
            probe += 1
            pub.send_multipart(
                [b"/split/probe", bytes(8), (10**9 + probe).to_bytes(16, "big"), b"", b"p"]
            )
            return _num(server, "sequence") > before

        eventually(subscribed, 30, "the collector to take a probe write")
        # The probes the PUB sent before the server's subscription reached it
        # were dropped, and how many is the host's pace (seven of nine at load
        # 10): the sequence cannot say when the writes are in.  The number of
        # keys can: the probes share one key, each write has its own, so a
        # probe still on its way adds none.
        keys = _num(server, "keys")
        for n in range(count):
            key = f"/split/{n:06d}".encode()
            pub.send_multipart([key, bytes(8), (n + 1).to_bytes(16, "big"), b"", b"v%d" % n])
        eventually(lambda: _num(server, "keys") >= keys + count, 180, "the writes applied")
    finally:
        ctx.destroy(linger=0)


def _split_with_backlog(servers: Servers, writes: int) -> tuple[_Split, int]:
    """Cut, vote the backup active, write ``writes`` keys to the primary, heal: returns the
    pair and the primary's log offset once it has stepped down and starts
    sending.  The step-down itself is a role change, whose commits wait for
    their fsync on the loop, and its resync is the ordinary one: neither is
    what the heal bounds (docs/failover.md, "Healing in bounded steps"); at
    load 30 one such step-down took 1.3 s, 0.65 s of it a commit."""
    pair = _Split(servers, writes)
    pair.cut()
    backup = pair.backup
    assert answers_icanhaz(backup.port, 30, b"/nothing/"), "backup not voted active"
    backup.wait_log("now ACTIVE", 30)
    _write_to(pair.primary, writes)
    offset = pair.primary.log_size()
    pair.heal()
    sending = pair.primary.wait_log("stepped down after a split brain: sending", 60, after=offset)
    return pair, sending


def _items(port: int) -> dict[bytes, bytes]:
    """The server's /split/ keys, by a raw snapshot (an active server answers)."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"ICANHAZ?", b"/split/"])
        out: dict[bytes, bytes] = {}
        while dealer.poll(30_000):
            frames = dealer.recv_multipart()
            if frames[0] == b"KTHXBAI":
                return out
            out[frames[0]] = frames[4]
        raise AssertionError("no KTHXBAI within 30 s")
    finally:
        ctx.destroy(linger=0)


def _assert_all_written(port: int, writes: int) -> None:
    items = _items(port)
    missing = [n for n in range(writes) if items.get(b"/split/%06d" % n) != b"v%d" % n]
    assert not missing, f"{len(missing)} split writes missing, first {missing[:5]}"


def test_the_winner_takes_100k_split_writes_with_every_heartbeat_on_time(
    servers: Servers,
) -> None:
    pair, offset = _split_with_backlog(servers, SPLIT_WRITES)
    try:
        primary, backup = pair.primary, pair.backup
        b_offset = backup.log_size()
        eventually(
            lambda: _num(primary, "split_writes_queued") == 0,
            600,
            "the split writes delivered",
        )
        assert _num(primary, "split_writes_applied") >= SPLIT_WRITES
        assert _num(primary, "split_writes_abandoned") == 0
        _assert_all_written(backup.port, SPLIT_WRITES)
        # Resends were of the few in flight, not of the whole backlog.
        assert _num(primary, "split_writes_resent") < SPLIT_WRITES // 10
        late = _late_lines(primary, offset) + _late_lines(backup, b_offset)
        assert late == [], "a loop held its heartbeat back by more than an interval"
    finally:
        pair.close()


def _stamp(server: ServerProcess, text: str, after: int) -> float:
    """The wall-clock time of the server's first log line with ``text`` past ``after``."""
    line = log_line(server, text, after=after)
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")
    return stamp.timestamp()


def _elect_the_loser_again(pair: _Split, offset: int) -> None:
    """The winner dies mid-heal and a client votes for the loser."""
    pair.backup.kill9()
    assert answers_icanhaz(pair.primary.port, 30, b"/nothing/"), "primary not voted active"
    pair.primary.wait_log("elected again with", 30, after=offset)


def test_the_loser_voted_active_again_applies_the_rest_itself(servers: Servers) -> None:
    pair, offset = _split_with_backlog(servers, PART_WAY_WRITES)
    try:
        primary = pair.primary
        # The winner has taken some; then it dies, and a client votes for the loser.
        eventually(lambda: _num(primary, "split_writes_applied") >= 1000, 120, "some delivered")
        _elect_the_loser_again(pair, offset)
        eventually(lambda: _num(primary, "split_writes_queued") == 0, 600, "the rest applied here")
        _assert_all_written(primary.port, PART_WAY_WRITES)
        late = _late_lines(primary, offset)
        assert late == [], "a loop held its heartbeat back by more than an interval"
    finally:
        pair.close()


@pytest.mark.parametrize("side", ["sending", "applying"])
def test_sigterm_stops_a_server_within_1s_in_the_middle_of_a_heal(
    servers: Servers, side: str
) -> None:
    """``sending``: the loser is delivering its writes to the winner;
    ``applying``: voted active again, it is applying them itself (the state
    in which a server was once seen to leave SIGTERM ignored for more than 50 s)."""
    pair, offset = _split_with_backlog(servers, PART_WAY_WRITES)
    try:
        primary = pair.primary
        if side == "applying":
            _elect_the_loser_again(pair, offset)
        queued = _num(primary, "split_writes_queued")
        assert queued > PART_WAY_WRITES // 2, f"only {queued} left: not the middle of a heal"
        proc = primary.proc
        assert proc is not None
        with _SchedulerProbe() as host:
            sent = time.time()
            primary.signal(signal.SIGTERM)
            proc.wait(timeout=30)
            took = time.time() - sent
        # The server's own account (its log's wall-clock stamps, this host's
        # clock): the loop takes the signal as a callback of its own, so a
        # blocked loop would log it late; "server stopped" follows the close of
        # every socket and of the database.
        received = _stamp(primary, "SIGTERM received", offset)
        stopped = _stamp(primary, "server stopped", offset)
        assert received - sent <= 1.0 and stopped - sent <= 1.0, (
            f"the loop took SIGTERM {received - sent:.2f} s after it was sent and had"
            f" stopped {stopped - sent:.2f} s after"
        )
        # And the process is gone within 1 s, plus what the host's scheduler
        # adds on a busy machine (the interpreter's exit frees 100,000 keys).
        assert took <= 1.0 + host.worst_ms / 1000, (
            f"the process exited {took:.2f} s after SIGTERM (the host woke a sleeping"
            f" thread up to {host.worst_ms:.0f} ms late)"
        )
    finally:
        pair.close()
