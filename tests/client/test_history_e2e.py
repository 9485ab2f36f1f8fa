"""``changes(since=N)`` and ``clone watch --since N`` against real server processes:
the history replayed, then live changes with no gap and no duplicate; a
failover; a history too short (HistoryCompacted)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from clone import Clone, HistoryCompacted
from clone.client.results import ChangeStream, Entry
from clone.client.status import query_status
from tests.support.servers import ROOT, ServerProcess, Servers
from tests.support.waiting import eventually


def _endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def _client(*servers: ServerProcess) -> Clone:
    client = Clone([_endpoint(s) for s in servers], heartbeat=0.1)
    client.wait_synced(15)
    return client


def _take(stream: ChangeStream, count: int, timeout: float = 20.0) -> list[Entry]:
    """The next ``count`` changes, each within the deadline."""
    out: list[Entry] = []
    deadline = time.monotonic() + timeout
    it: Iterator[Entry] = stream
    while len(out) < count:
        assert time.monotonic() < deadline, f"only {len(out)} of {count} changes came"
        out.append(next(it))
    return out


def test_since_replays_the_history_then_goes_live_without_gap_or_duplicate(
    servers: Servers,
) -> None:
    server = servers.standalone()
    with _client(server) as client:
        for i in range(1, 51):
            client.set(f"/k/{i}", f"v{i}", wait=True)
        assert client.status().sequence == 50
        with client.changes(timeout=60, since=20) as stream:
            replayed = _take(stream, 30)
            assert [e.sequence for e in replayed] == list(range(21, 51))
            assert [e.key for e in replayed] == [f"/k/{i}" for i in range(21, 51)]
            assert replayed[0].value == b"v21"
            # Live writes while it runs, from another thread: exactly each one.
            writer = threading.Thread(
                target=lambda: [client.set(f"/live/{i}", b"x", wait=True) for i in range(40)]
            )
            writer.start()
            live = _take(stream, 40)
            writer.join(30)
            assert [e.sequence for e in live] == list(range(51, 91))
            client.delete("/k/1", wait=True)
            (deleted,) = _take(stream, 1)
            assert deleted.key == "/k/1" and deleted.value is None and deleted.sequence == 91


def test_since_with_a_prefix_yields_only_its_keys(servers: Servers) -> None:
    server = servers.standalone()
    with _client(server) as client:
        for i in range(10):
            client.set(f"/{'a' if i % 2 else 'b'}/{i}", b"v", wait=True)
        with client.changes(timeout=30, prefix="/a/", since=0) as stream:
            assert [e.key for e in _take(stream, 5)] == [f"/a/{i}" for i in (1, 3, 5, 7, 9)]
            client.set("/b/x", b"v", wait=True)
            client.set("/a/x", b"v", wait=True)
            (entry,) = _take(stream, 1)
            assert entry.key == "/a/x" and entry.sequence == 12


def test_after_a_failover_the_new_active_replays_what_was_missed(servers: Servers) -> None:
    primary, backup = servers.pair()
    with _client(primary, backup) as client:
        for i in range(1, 21):
            client.set(f"/k/{i}", f"v{i}", wait=True)
        seen = 8  # a reader that saw up to 8, then went away
        primary.kill9()
        # A client write makes the backup take over (Binary Star).
        client.set("/after", b"failover", wait=True, timeout=20)
        after = client.status().sequence
        assert after == 21
        with client.changes(timeout=60, since=seen) as stream:
            missed = _take(stream, after - seen)
        assert [e.sequence for e in missed] == list(range(seen + 1, after + 1))
        assert [e.key for e in missed] == [*(f"/k/{i}" for i in range(seen + 1, 21)), "/after"]


def _triples(entries: list[Entry]) -> list[tuple[int, str, bytes | None]]:
    return [(e.sequence, e.key, e.value) for e in entries]


def _nothing_more(stream: ChangeStream, quiet: float = 0.5) -> list[Entry]:
    """Whatever the stream still yields in ``quiet`` seconds (close() ends it)."""
    timer = threading.Timer(quiet, stream.close)
    timer.start()
    try:
        return list(stream)
    finally:
        timer.cancel()


def _sequence_of(server: ServerProcess) -> int | None:
    (status,) = query_status([_endpoint(server)], timeout=1.0)
    sequence = status["sequence"]
    return sequence if isinstance(sequence, int) else None


def test_since_across_a_kill9_failover_yields_exactly_the_missed_changes_once(
    servers: Servers,
) -> None:
    """A reader remembers sequence N; the primary dies (the backup holding
    every update); writes go on at the backup.  ``changes(since=N)`` opened
    after the failover, and one left open across the kill, each yield exactly
    the changes after N, in order, once each, then only the live ones."""
    primary, backup = servers.pair()
    written: list[tuple[int, str, bytes | None]] = []

    def write(client: Clone, key: str, value: str, **kw: float) -> None:
        sequence = client.set(key, value, wait=True, **kw)
        assert isinstance(sequence, int)
        written.append((sequence, key, value.encode()))

    with _client(primary, backup) as writer, _client(primary, backup) as reader:
        for i in range(1, 11):
            write(writer, f"/before/{i}", f"b{i}")
        with reader.changes(timeout=60, since=0) as seen_so_far:
            seen = _take(seen_so_far, 10)
        since = seen[-1].sequence  # what the reader had handed on
        assert _triples(seen) == written
        across = reader.changes(timeout=60, since=since)
        for i in range(1, 11):
            write(writer, f"/missed/{i}", f"m{i}")
        writer.delete("/before/3", wait=True)
        written.append((written[-1][0] + 1, "/before/3", None))
        # Before the kill, the backup holds every update: nothing is lost with
        # the primary, so the replay must be complete.
        last = written[-1][0]
        eventually(lambda: _sequence_of(backup) == last, 10, f"the backup at sequence {last}")
        assert _triples(_take(across, 11)) == written[10:]
        primary.kill9()
        # The first write after the kill makes the backup take over.
        write(writer, "/after/1", "a1", timeout=20)
        for i in range(2, 6):
            write(writer, f"/after/{i}", f"a{i}")
        assert [w[0] for w in written] == list(range(1, len(written) + 1))
        expected = written[10:]
        with _client(primary, backup) as late:  # the dead one first, as configured
            with late.changes(timeout=60, since=since) as replay:
                assert _triples(_take(replay, len(expected))) == expected
                assert _nothing_more(replay) == []
        # The stream open across the kill: the rest, once each, then nothing.
        try:
            assert _triples(_take(across, 5)) == written[-5:]
            write(writer, "/after/live", "live")
            assert _triples(_take(across, 1)) == written[-1:]
            assert _nothing_more(across) == []
        finally:
            across.close()


def test_a_history_too_short_raises_history_compacted(servers: Servers) -> None:
    server = servers.standalone("--history", "10")
    with _client(server) as client:
        for i in range(50):
            client.set(f"/k/{i}", b"v", wait=True)
        stream = client.changes(timeout=30, since=5)
        with pytest.raises(HistoryCompacted) as caught:
            next(stream)
        assert (caught.value.requested, caught.value.oldest) == (5, 41)
        assert "starts at sequence 41" in str(caught.value)
        # From the oldest held on, it can be replayed.
        with client.changes(timeout=30, since=40) as ok:
            assert [e.sequence for e in _take(ok, 10)] == list(range(41, 51))


def _watch(server: ServerProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "clone.client.cli", "--heartbeat", "0.1",
         "--servers", _endpoint(server), "watch", *args],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip


def test_cli_watch_since_prints_the_history_then_exits_on_compacted(servers: Servers) -> None:
    server = servers.standalone("--history", "10")
    with _client(server) as client:
        for i in range(1, 16):
            client.set(f"/k/{i}", f"v{i}", wait=True)
    result = _watch(server, "--since", "12", "--duration", "3")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["/k/13=v13", "/k/14=v14", "/k/15=v15"]
    result = _watch(server, "--since", "1", "--duration", "3")
    assert result.returncode == 4
    assert "history starts at sequence 6" in result.stderr
    assert result.stdout == ""
