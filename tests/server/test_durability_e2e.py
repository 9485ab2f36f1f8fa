"""Durability end to end: real ``clone-server`` pairs on data directories.

What a data directory must guarantee, with processes killed by SIGKILL:

* a confirmed write survives the loss of both servers, whichever dies first, at
  every ``--fsync`` policy, and the sequence never goes back;
* when both start, the newer data serves (whatever the roles), and the other
  server follows it, by catch-up from its own sequence when the active's history
  reaches back that far, by a full snapshot when it does not;
* a lone server waits ``--peer-wait`` for its peer before it serves its own,
  possibly older, state;
* a data directory that is locked, corrupt or of another version is refused
  with a message naming it, and left as it was;
* ``--in-memory`` keeps nothing (so the other tests really test the disk).

A check of the passive's copy goes through a failover: the passive does not
answer snapshot requests, so the active is killed and the passive, promoted by
a client vote, is asked.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from clone import Clone
from clone.errors import CloneError
from clone.storage.db import Storage
from clone.storage.mark import MARK_FILE, format_mark, parse_mark
from tests.support.clients import raw_peer, synced_client
from tests.support.servers import (
    ServerProcess,
    Servers,
    log_line,
    read_stats,
    set_arg,
    start_both,
    wait_role,
)
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

HB = 0.1
KEYS = 30
PREFIX = "/d/"





class _Writer:
    """Overwrites ``/d/0`` .. ``/d/{KEYS-1}`` with confirmed writes ``v<n>``, round
    robin; remembers the last confirmed ``n`` of every key and the highest
    sequence the client saw."""

    def __init__(self, c: Clone) -> None:
        self.client = c
        self.confirmed: dict[str, int] = {}
        self.count = 0  # confirmed writes
        self.written = 0  # writes sent, confirmed or not: no value is >= this
        self.max_sequence = 0
        self._stop = threading.Event()
        self._go = threading.Event()
        self._go.set()
        self._idle = threading.Event()
        self.thread = threading.Thread(target=self._run, name="writer", daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            if not self._go.is_set():
                self._idle.set()
                self._go.wait(0.1)
                continue
            self._idle.clear()
            key = f"{PREFIX}{n % KEYS}"
            self.written = n + 1
            try:
                self.client.set(key, f"v{n}", wait=True, timeout=1.0)
                entry = self.client.entry(key)
            except CloneError:
                pass  # not confirmed (a takeover, or nobody up): written again next round
            else:
                self.confirmed[key] = n
                self.count += 1
                if entry is not None:
                    self.max_sequence = max(self.max_sequence, entry.sequence)
            n += 1

    def flow(self, count: int = 100, timeout: float = 15.0) -> None:
        """Until ``count`` more writes were confirmed."""
        start = self.count
        eventually(lambda: self.count - start >= count, timeout, f"{count} confirmed writes")

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No write in flight inside the block."""
        self._idle.clear()
        self._go.clear()
        try:
            assert self._idle.wait(10), "the writer did not pause"
            yield
        finally:
            self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the writer did not stop"

    def __enter__(self) -> _Writer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _snapshot(
    server: ServerProcess, subtree: bytes, timeout: float = 10.0
) -> tuple[dict[bytes, bytes], int]:
    """``(key -> value, sequence)`` from a raw ICANHAZ? to ``server``."""
    with raw_peer() as peer:
        peer.use_snapshot_server(server.port)
        snap = peer.snapshot(subtree, timeout=timeout)
    return {k: v.body for k, v in snap.entries.items()}, snap.sequence


def _counters(server: ServerProcess) -> dict[str, int]:
    """The writer's keys the server serves, as their write counters."""
    values, _ = _snapshot(server, PREFIX.encode())
    return {k.decode(): int(v.decode().removeprefix("v")) for k, v in values.items()}


def _assert_kept(w: _Writer, server: ServerProcess) -> None:
    """Every confirmed write there (its value or a later one's) and the served
    sequence not behind what the client saw."""
    assert w.confirmed, "no write was ever confirmed"
    final = _counters(server)
    lost = {k: (final.get(k), n) for k, n in w.confirmed.items() if final.get(k, -1) < n}
    assert not lost, f"confirmed writes lost on {server.name} (key: (held, confirmed)): {lost}"
    bogus = {k: n for k, n in final.items() if n >= w.written}
    assert not bogus, f"values nobody wrote: {bogus}"
    _, sequence = _snapshot(server, b"/--none--/")
    assert sequence >= w.max_sequence, (
        f"{server.name} serves sequence {sequence}, a client saw {w.max_sequence}"
    )


def _assert_one_active(active: ServerProcess, passive: ServerProcess) -> None:
    roles = {s.name: read_stats(s)["role"] for s in (active, passive)}
    assert roles == {active.name: "active", passive.name: "passive"}, roles


def _kill_both(w: _Writer, first: ServerProcess, second: ServerProcess) -> None:
    """SIGKILL both servers while the writer writes, then stop the writer."""
    w.flow(100)
    first.kill9()
    second.kill9()
    w.stop()


def _loaded_term(server: ServerProcess, offset: int) -> int:
    """The term of the data the server loaded at its start past ``offset``."""
    line = log_line(server, "data directory ", after=offset)
    return int(re.search(r"\(term (\d+)\)", line).group(1))  # type: ignore[union-attr]


def _start_both(a: ServerProcess, b: ServerProcess) -> tuple[ServerProcess, ServerProcess]:
    """Restart both stopped servers; ``(active, passive)``.  A long ``--peer-wait``
    so that they meet and the data ranks decide, however slowly one starts."""
    offsets = [s.log_size() for s in (a, b)]
    for s in (a, b):
        set_arg(s, "--peer-wait", "10")
    active, passive = start_both(a, b)
    for s, offset in zip((a, b), offsets, strict=True):
        assert b"serving without having heard the peer" not in s.log_path.read_bytes()[offset:]
    return active, passive


def _take_over(survivor: ServerProcess, offset: int) -> None:
    """A client vote (a raw ICANHAZ?) promotes ``survivor``, whose peer is dead.

    Or it serves already: both servers starved past the pair's expiry
    earlier, it took a vote and won the split brain (docs/failover.md, "Fast
    failover on a lost connection"), its "now ACTIVE" logged before
    ``offset``.  Its role says it either way; a line after ``offset`` did not."""
    survivor.wait_serving()
    wait_role(survivor, "active")
    if b"now ACTIVE" not in survivor.log_path.read_bytes()[offset:]:
        assert b"now ACTIVE" in survivor.log_path.read_bytes(), "active, never said so"


def _backup_active_primary_following(
    primary: ServerProcess, backup: ServerProcess, w: _Writer
) -> None:
    """Writes flowing, make the backup the active one and the primary its
    (synced) follower, and let more writes through."""
    w.flow(50)
    offset = backup.log_size()
    primary.kill9()
    _take_over(backup, offset)
    offset = primary.log_size()
    primary.start()
    # Its role, not a "now PASSIVE" line: the same starved split brain can
    # make it active first and passive again later (_take_over).
    wait_role(primary, "passive")
    wait_role(backup, "active")
    primary.wait_log("synced from", after=offset)
    w.flow(50)


def _check_through_failover(w: _Writer, active: ServerProcess, passive: ServerProcess) -> None:
    """The passive's copy too: kill the active, promote the passive, read it."""
    offset = passive.log_size()
    active.kill9()
    _take_over(passive, offset)
    _assert_kept(w, passive)


# -- 1. both killed, in either order ------------------------------------------


@pytest.mark.parametrize("primary_first", [True, False], ids=["primary-first", "backup-first"])
def test_kill9_of_both_keeps_every_confirmed_write(servers: Servers, primary_first: bool) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        order = (primary, backup) if primary_first else (backup, primary)
        _kill_both(w, *order)
    active, passive = _start_both(primary, backup)
    _assert_one_active(active, passive)
    _assert_kept(w, active)
    _check_through_failover(w, active, passive)


# -- 2. the newer data serves, whatever the roles -----------------------------


@pytest.mark.parametrize("newer", ["backup", "primary"])
def test_cold_start_of_both_picks_the_newer_data(servers: Servers, newer: str) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        w.flow(100)
        if newer == "primary":
            # First make the backup the active one and the primary its follower.
            offset = backup.log_size()
            primary.kill9()
            _take_over(backup, offset)
            w.flow(50)
            offset = primary.log_size()
            primary.start()
            primary.wait_log("synced from", 15, after=offset)
            w.flow(50)
            old, new = backup, primary
        else:
            old, new = primary, backup
        with w.paused():
            # Nothing in flight: the old active's data is a prefix of the new
            # one's, so that it can catch up when it follows.
            top = read_stats(old)["sequence"]
            eventually(lambda: read_stats(new)["sequence"] == top, 10, "the passive to follow")
            old.kill9()
        # The writer's next snapshot request is the client vote that fails
        # over, or the roles were swapped already (_take_over).  Either way
        # it serves alone from here, and what it serves from now on is the
        # newer data.
        eventually(lambda: read_stats(new)["role"] == "active", 15, f"{new.name} to serve")
        w.flow(100)
        new.kill9()
    offsets = {s.name: s.log_size() for s in (primary, backup)}
    active, passive = _start_both(primary, backup)
    assert active is new, f"{active.name} serves, but {new.name} has the newer data"
    terms = {s.name: _loaded_term(s, offsets[s.name]) for s in (primary, backup)}
    assert terms[new.name] > terms[old.name], terms
    _assert_one_active(active, passive)
    synced = log_line(passive, "synced from", after=offsets[passive.name])
    assert f":{active.port} (catch-up)" in synced, synced
    _assert_kept(w, active)
    _check_through_failover(w, active, passive)


# -- 3. a lone server waits for its peer --------------------------------------


def test_a_lone_server_waits_for_its_peer_then_serves_its_state(servers: Servers) -> None:
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c:
        for i in range(KEYS):
            c.set(f"{PREFIX}{i}", f"v{i}", wait=True, timeout=5.0)
    before, sequence = _snapshot(primary, PREFIX.encode())
    backup.terminate()
    primary.terminate()

    set_arg(primary, "--peer-wait", "2")
    offset = primary.log_size()
    started = time.monotonic()
    primary.start()
    with raw_peer() as peer:
        peer.use_snapshot_server(primary.port)
        assert peer.no_snapshot_reply(1.0), "served before its --peer-wait was over"
    primary.wait_serving(10)
    waited = time.monotonic() - started
    line = log_line(primary, "serving without having heard the peer", after=offset)
    assert "2.0 s of --peer-wait" in line, line
    assert waited >= 2.0, f"served after {waited:.2f} s"
    assert _snapshot(primary, PREFIX.encode()) == (before, sequence)

    offset = backup.log_size()
    backup.start()
    wait_role(backup, "passive")
    backup.wait_log("synced from", after=offset)
    synced = log_line(backup, "synced from", after=offset)
    assert f":{primary.port} " in synced, synced
    _assert_one_active(primary, backup)


def test_a_lone_server_that_stopped_as_the_passive_waits_for_its_peer(
    servers: Servers,
) -> None:
    """Chaos run seed 7: the passive fail-stopped (a full disk), the active went
    on confirming writes, then fail-stopped too and could not start for a while.
    The old passive, started alone, served its older state after --peer-wait,
    and when the other came back its newer data lost to that later election:
    its confirmed writes were gone and every client saw keys go back.  A server
    restarted from data written as a follower now waits for its peer."""
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        _backup_active_primary_following(primary, backup, w)
        # The follower dies; the active confirms writes it alone holds.
        primary.kill9()
        w.flow(100)
        backup.kill9()
    assert w.max_sequence > 0

    set_arg(primary, "--peer-wait", "0.5")
    offset = primary.log_size()
    primary.start()
    with raw_peer() as peer:
        peer.use_snapshot_server(primary.port)

        def refused() -> bool:
            # Each ICANHAZ? is a vote; refused ones are never answered.
            assert peer.no_snapshot_reply(0.3), "the old passive served alone"
            tail = primary.log_path.read_bytes()[offset:]
            return b"refusing client votes until the peer is heard" in tail

        eventually(refused, 20, "the lone old passive to refuse a vote")
        # Well past its --peer-wait, it still refuses.
        assert peer.no_snapshot_reply(1.5), "the old passive served alone"
    tail = primary.log_path.read_bytes()[offset:]
    assert b"now ACTIVE" not in tail, tail.decode(errors="replace")[-2000:]

    backup.start()
    wait_role(backup, "active")
    wait_role(primary, "passive")
    _assert_one_active(backup, primary)
    _assert_kept(w, backup)


def test_a_server_that_stopped_as_the_active_forwards_what_a_lone_peer_lacks(
    servers: Servers,
) -> None:
    """A chaos run (restart storm, full disk): the active backup died, the
    primary took over and confirmed writes, then died and could not start; the
    backup, started alone from data it wrote as the active, served after
    --peer-wait; the primary came back, found it active, went passive and took
    its older state: 15 confirmed writes were gone.  A server restarted from
    data it wrote as the active and made passive is a split brain's loser in
    all but name: it sends the active the writes it confirmed that the active
    lacks, and they are applied (or listed as conflicts)."""
    primary, backup = servers.pair()
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        _backup_active_primary_following(primary, backup, w)
        # The active dies; the primary takes over and confirms writes that
        # only it holds; then it dies too.
        offset = primary.log_size()
        backup.kill9()
        _take_over(primary, offset)
        w.flow(100)
        w.stop()
        primary.kill9()
    assert w.max_sequence > 0

    # The backup alone, from data it wrote as the active: it serves after
    # its start wait (a client's vote), its older state.
    set_arg(backup, "--peer-wait", "0.5")
    offset = backup.log_size()
    backup.start()
    _take_over(backup, offset)

    offset = primary.log_size()
    primary.start()
    wait_role(primary, "passive")
    primary.wait_log("sending the active", after=offset)
    _assert_one_active(backup, primary)
    eventually(lambda: int(str(read_stats(primary)["split_writes_queued"])) == 0, 60,
               "the primary's writes forwarded")  # fmt: skip
    # Nothing wrote those keys on the backup since: every one is applied.
    assert int(str(read_stats(backup)["split_writes_conflicts"])) == 0
    _assert_kept(w, backup)


def _grow_offline(data: Path, count: int) -> None:
    """``count`` more keys under ``/big/`` in a stopped server's data directory,
    written as its own (so that a sync of its state takes seconds)."""
    storage = Storage.open(data)
    try:
        first = storage.sequence + 1
        updates = [
            [b"/big/%d" % i, (first + i).to_bytes(8, "big"), i.to_bytes(16, "big"), b"", b"x" * 32]
            for i in range(count)
        ]
        storage.append(updates, term=storage.term, at=time.time(), keep_from=first + count - 10)
    finally:
        storage.close()


def test_a_passive_that_has_not_synced_yet_never_takes_over(servers: Servers) -> None:
    """Chaos run seed 7 again, with the first fix: the primary, restarted
    behind, heard the active backup and went passive; 0.65 s later, before its
    sync had completed, the backup fail-stopped and a client's vote made the
    primary active on its older state; the backup's confirmed writes were lost
    when it came back under the lower term.  Until its first sync from the
    active completes, a passive takes no vote."""
    primary, backup = servers.pair()
    primary.terminate()
    backup.terminate()
    _grow_offline(servers.data_dir("primary"), 200_000)
    offset = primary.log_size()
    primary.start()
    primary.wait_serving(60)  # alone, its data written as the active: after --peer-wait
    wait_role(primary, "active")

    offset = backup.log_size()
    backup.start()
    backup.wait_log("now PASSIVE", 60, after=offset)
    primary.kill9()  # long before 200,000 keys are synced
    tail = backup.log_path.read_bytes()[offset:]
    assert b"synced from" not in tail, "the sync was over before the kill: no test"
    with raw_peer() as peer:
        peer.use_snapshot_server(backup.port)

        def refused() -> bool:
            assert peer.no_snapshot_reply(0.3), "the passive took over before its sync"
            return b"refusing client votes until our sync" in backup.log_path.read_bytes()[offset:]

        eventually(refused, 20, "the unsynced passive to refuse a vote")
    assert b"now ACTIVE" not in backup.log_path.read_bytes()[offset:]

    offsets = {s.name: s.log_size() for s in (primary, backup)}
    primary.start()
    wait_role(primary, "active")
    backup.wait_log("synced from", 120, after=offsets[backup.name])
    _assert_one_active(primary, backup)


def test_a_standalone_start_makes_the_old_passives_data_its_own(servers: Servers) -> None:
    """The way out when the peer of a server that stopped as the passive is
    gone for good: one start as ``--standalone`` records it as the writer."""
    data = servers.data_dir("old-passive")
    storage = Storage.open(data)
    storage.record_following(True)
    storage.close()
    server = servers.standalone("--data-dir", str(data), name="old-passive")
    server.wait_log("serving alone data last written as a pair's passive", 10)
    assert server.terminate() == 0
    storage = Storage.open(data)
    try:
        assert not storage.load().following
    finally:
        storage.close()


# -- 4. catch-up from the passive's sequence, or a full snapshot --------------


# -- 4. catch-up from the passive's sequence, or a full snapshot --------------


def _write_raw(server: ServerProcess, keys: range, value: bytes, marker: bytes) -> None:
    """KVSETs straight to ``server``'s collector; back once all are applied."""
    with raw_peer() as peer:
        peer.connect(server.port, collectors=[server.port])
        for i in keys:
            peer.kvset(b"/big/%d" % i, value)
        peer.kvset(b"/marker/" + marker, b"1")  # the collector applies in order
        eventually(
            lambda: b"/marker/" + marker in peer.snapshot(b"/marker/", timeout=10.0).entries,
            20,
            f"the writes up to marker {marker!r}",
        )


@pytest.mark.parametrize("history", [None, 100], ids=["catch-up", "history-too-short"])
def test_a_restarted_passive_catches_up_from_its_sequence(
    servers: Servers, history: int | None
) -> None:
    extra = () if history is None else ("--history", str(history))
    primary, backup = servers.pair(*extra)
    _write_raw(primary, range(3000), b"x" * 32, b"preload")
    _write_raw(primary, range(10), b"followed", b"followed")
    top = _snapshot(primary, b"/--none--/")[1]
    # On the backup's disk, not only in its map: the kill below must not take the last ones.
    eventually(lambda: read_stats(backup)["committed_sequence"] == top, 10,
               "the backup to commit what it followed")  # fmt: skip
    served_before = read_stats(primary)["catchups_served"]
    assert isinstance(served_before, int)

    backup.kill9()
    _write_raw(primary, range(1000), b"y" * 32, b"missed")
    offset = backup.log_size()
    backup.start()
    backup.wait_log("synced from", 15, after=offset)
    synced = log_line(backup, "synced from", after=offset)
    stats = read_stats(backup)
    served = read_stats(primary)["catchups_served"]
    assert isinstance(served, int)
    if history is None:
        assert "(catch-up)" in synced, synced
        assert served > served_before
        assert (stats["syncs_full"], stats["syncs_catchup"]) == (0, 1), stats
        catchup = stats["catchup_updates_received"]
        assert isinstance(catchup, int) and catchup >= 1001, catchup
    else:
        assert "(full)" in synced, synced
        assert served == served_before
        assert (stats["syncs_full"], stats["syncs_catchup"]) == (1, 0), stats

    state = _snapshot(primary, b"")
    assert len(state[0]) == 3000 + 3
    offset = backup.log_size()
    primary.kill9()
    _take_over(backup, offset)
    assert _snapshot(backup, b"") == state


# -- 5. data directories that are refused -------------------------------------


def _refused(server: ServerProcess) -> str:
    """The exit code is non-zero; the log of this (only) start."""
    code = server.process.wait(15)
    assert code is not None, f"{server.name} is still running"
    assert code != 0, f"{server.name} exited with 0"
    return server.log_text()


def test_a_data_dir_in_use_is_refused(servers: Servers) -> None:
    first = servers.standalone(name="first")
    second = servers.standalone(
        "--data-dir", str(servers.data_dir("first")), name="second", wait=False
    )
    log = _refused(second)
    assert "lock" in log.lower() and str(first.pid) in log, log[-2000:]
    first.wait_serving(5)  # the first one carries on


def test_a_garbage_database_is_refused_and_left_alone(servers: Servers, tmp_path: Path) -> None:
    data = tmp_path / "garbage.data"
    data.mkdir()
    db = data / "clone.db"
    garbage = b"this is not a database\n" * 500
    db.write_bytes(garbage)
    stamp = db.stat().st_mtime_ns
    log = _refused(servers.standalone("--data-dir", str(data), name="garbage", wait=False))
    assert str(db) in log, log[-2000:]
    assert db.read_bytes() == garbage and db.stat().st_mtime_ns == stamp
    assert sorted(p.name for p in data.iterdir() if p.name != "LOCK") == ["clone.db"]


def test_a_data_dir_of_another_version_is_refused(servers: Servers) -> None:
    server = servers.standalone(name="versioned")
    assert server.terminate() == 0
    db = servers.data_dir("versioned") / "clone.db"
    with sqlite3.connect(db) as conn:
        conn.execute("PRAGMA user_version = 999")
    conn.close()
    offset = server.log_size()
    server.start()
    _refused(server)
    log = server.log_text()[offset:]
    assert "version 999" in log, log[-2000:]


def test_a_database_behind_its_commit_mark_is_refused(servers: Servers) -> None:
    """A data directory whose database lost committed updates (issue 30) is not
    served: the start exits with both positions named; moving the mark aside
    (accepting the loss, as the message says) starts it."""
    server = servers.standalone(name="marked")
    with synced_client(server, heartbeat=HB) as c:
        for i in range(5):
            c.set(f"{PREFIX}{i}", f"v{i}", wait=True, timeout=5.0)
    _, sequence = _snapshot(server, PREFIX.encode())
    assert server.terminate() == 0
    data = servers.data_dir("marked")
    assert parse_mark((data / MARK_FILE).read_bytes())[0] == sequence  # type: ignore[index]
    # The database as if its last 3 commits were lost: the mark is ahead of it.
    (data / MARK_FILE).write_bytes(format_mark(sequence + 3, 1))
    offset = server.log_size()
    server.start()
    _refused(server)
    log = server.log_text()[offset:]
    assert f"holds sequence {sequence} " in log and "3 committed" in log, log[-2000:]
    assert str(data / MARK_FILE) in log
    (data / MARK_FILE).rename(data / "COMMITTED.aside")
    server.start()
    server.wait_serving()
    assert _snapshot(server, PREFIX.encode())[1] == sequence


# -- 6. every fsync policy survives a killed process --------------------------


@pytest.mark.parametrize("fsync", ["always", "off"])
def test_every_fsync_policy_keeps_confirmed_writes_across_kill9(
    servers: Servers, fsync: str
) -> None:
    primary, backup = servers.pair("--fsync", fsync)
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        w.flow(100)
        backup.kill9()
        # The last writes are only in the primary's data directory.
        _kill_both(w, primary, backup)
    offset = primary.log_size()
    active, passive = _start_both(primary, backup)
    assert log_line(primary, "data directory ", after=offset).endswith(f"fsync {fsync}")
    _assert_kept(w, active)
    _check_through_failover(w, active, passive)


# -- 7. in memory, nothing survives -------------------------------------------


def test_in_memory_servers_forget_everything_when_both_die(servers: Servers) -> None:
    primary, backup = servers.pair("--in-memory")
    with synced_client(primary, backup, heartbeat=HB) as c, _Writer(c) as w:
        _kill_both(w, primary, backup)
    assert w.confirmed
    active, _ = start_both(primary, backup)
    assert _snapshot(active, b"") == ({}, 0)
    assert not servers.data_dir("primary").exists() and not servers.data_dir("backup").exists()


# -- 8. --fsync always: group commits, and a kill right after confirmations ---


def test_fsync_always_confirms_whole_turns_and_a_kill9_right_after_loses_none(
    servers: Servers,
) -> None:
    """`always` commits a turn's updates in one transaction now.  A
    writer blasts 3,000 KVSETs (so turns hold many updates); a subscriber
    reads the KVPUBs, which confirm them; the moment it has 500 the server
    is killed -9.  On restart every confirmed update is there, and the stats
    show fewer commits than updates (groups, not a commit per update)."""
    import zmq

    from clone.wire.protocol import COLLECTOR_OFFSET, PUBLISHER_OFFSET

    server = servers.standalone("--fsync", "always")
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"/g/")
    sub.connect(f"tcp://127.0.0.1:{server.port + PUBLISHER_OFFSET}")
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(f"tcp://127.0.0.1:{server.port + COLLECTOR_OFFSET}")
    confirmed: dict[bytes, int] = {}
    try:
        # Until the subscription is in: a probe write comes back.
        def probe() -> bool:
            pub.send_multipart([b"/g/probe", bytes(8), uuid4_bytes(), b"", b"p"])
            return bool(sub.poll(100))

        eventually(probe, 10, "the subscription in place")
        while sub.poll(200):
            sub.recv_multipart()
        for i in range(3000):
            pub.send_multipart([b"/g/%d" % (i % 700), bytes(8), uuid4_bytes(), b"", b"v%d" % i])
        deadline = time.monotonic() + 30
        while len(confirmed) < 500 and time.monotonic() < deadline:
            if sub.poll(100):
                key, seq, _uuid, _props, _body = sub.recv_multipart()
                confirmed[key] = int.from_bytes(seq, "big")
        server.kill9()  # right after the 500th confirmation
        while sub.poll(0):  # KVPUBs already sent before the kill: confirmed too
            key, seq, _uuid, _props, _body = sub.recv_multipart()
            confirmed[key] = int.from_bytes(seq, "big")
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()
    assert len(confirmed) >= 500, "the writes were not confirmed in time"
    server.restart()
    server.wait_serving()
    with raw_peer() as peer:
        peer.use_snapshot_server(server.port)
        snap = peer.snapshot(b"/g/", timeout=10)
    lost = {k: n for k, n in confirmed.items()
            if k not in snap.entries or snap.entries[k].sequence < n}
    assert not lost, f"confirmed updates lost after kill -9 with --fsync always: {lost}"
    # Groups, not a commit per update: 2,000 more in a burst, counted by the server.
    before = read_stats(server)
    _bulk_write(server, 2000)
    after = read_stats(server)
    updates = after["sequence"] - before["sequence"]
    assert updates >= 2000 and after["commits"] - before["commits"] < updates / 2, after


def _bulk_write(server: ServerProcess, n: int) -> None:
    """``n`` KVSETs as fast as they go, then until the last one's KVPUB is back."""
    import zmq

    from clone.wire.protocol import COLLECTOR_OFFSET, PUBLISHER_OFFSET

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"/bulk/last")
    sub.connect(f"tcp://127.0.0.1:{server.port + PUBLISHER_OFFSET}")
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(f"tcp://127.0.0.1:{server.port + COLLECTOR_OFFSET}")
    try:
        time.sleep(0.3)  # the subscription reaches the server (the last one is resent anyway)
        for i in range(n):
            pub.send_multipart([b"/bulk/%d" % i, bytes(8), uuid4_bytes(), b"", b"x" * 100])

        def last_back() -> bool:
            pub.send_multipart([b"/bulk/last", bytes(8), uuid4_bytes(), b"", b"end"])
            return bool(sub.poll(200))

        eventually(last_back, 30, "the burst applied")
    finally:
        sub.close(linger=0)
        pub.close(linger=0)
        ctx.term()


def uuid4_bytes() -> bytes:
    import uuid

    return uuid.uuid4().bytes
