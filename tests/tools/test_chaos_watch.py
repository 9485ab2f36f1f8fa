"""The chaos watcher's records against a real client and a fake CHP server
(real sockets on 127.0.0.1): a change its callback thread records late, after
the client has already resynced past it, keeps the epoch it came in, so the
transitions the resync skipped are judged as skipped by a resync.

A clean-clone CI run failed the chaos run's ``watchers`` check that way: the
watcher stamped each change with its client's resync counters read when the
callback ran, and a callback thread behind its agent (a paused or starved
process) stamped the last live change before a resync with the resync's epoch.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from clone import Clone, Entry
from clone.tools.chaos.checker import check_watchers
from clone.tools.chaos.worker import Recorder, WatchLog
from tests.support.fake_server import FakeServer
from tests.support.waiting import eventually

HB = 0.1
WAIT = 30.0  # bounds a hang only
KEY = "/chaos/counter/0"


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HB) as srv:
        yield srv


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_change_recorded_after_a_resync_keeps_the_epoch_it_came_in(
    server: FakeServer, tmp_path: Path
) -> None:
    path = tmp_path / "history.jsonl"
    rec = Recorder(path, "watch0")
    watch = WatchLog(rec)
    gate = threading.Event()
    by_counters: list[dict[str, Any]] = []  # what the counter-stamped watcher recorded
    with Clone([server.endpoint], heartbeat=HB) as client:
        client.wait_synced(WAIT)

        def on_change(entry: Entry) -> None:
            if entry.key == "/chaos/block":
                gate.wait(WAIT)  # a callback thread behind its agent
            c = client.status().counters
            t = time.monotonic()
            by_counters.append({"proc": "watch0", "f": "update", "key": entry.key,
                                "seq": entry.sequence, "t0": t, "t1": t,
                                "epoch": c["resyncs"] + c["failovers"] + c["gaps"]})
            watch.on_change(entry)

        client.on_change(on_change)
        server.publish("/chaos/block", b"b")  # seq 1: holds the callback thread
        server.publish(KEY, b"1")  # seq 2: told live, recorded late
        server.drop_next_publications = 1
        server.publish(KEY, b"2")  # seq 3: lost on the way
        server.publish(KEY, b"3")  # seq 4: the gap, then the resync's change
        eventually(lambda: client.status().resyncs >= 1 and client.status().state == "active"
                   and client.get(KEY) == b"3", WAIT, "the resync past the lost update")
        gate.set()
        eventually(lambda: any(r.get("seq") == 4 for r in _records(path)), WAIT,
                   "the resync's change to be recorded")
    rec.close()
    history = _records(path)
    updates = [(r["key"], r["seq"], r["epoch"]) for r in history if r["f"] == "update"]
    assert updates == [("/chaos/block", 1, 0), (KEY, 2, 0), (KEY, 4, 1)]
    assert [r["epoch"] for r in history if r["f"] == "resync"] == [1]
    # The writer's record of the update the watcher never saw.
    lost = {"proc": "cas0", "f": "cas", "key": KEY, "seq": 3, "res": "ok", "t0": 0.0, "t1": 0.0}
    verdict = check_watchers([*history, lost])
    assert verdict.status == "PASS" and verdict.checked == 1, verdict.examples
    # Stamped from the counters when the callback ran, the live change looks
    # like the resync's own: the false failure the chaos run reported.
    assert by_counters[1]["epoch"] == by_counters[2]["epoch"] >= 1
    assert check_watchers([*by_counters, lost]).status == "FAIL"


def test_each_resync_starts_an_epoch_even_right_after_another(tmp_path: Path) -> None:
    """A resync tells each key once: a key told again by a resync's change,
    with no live change between, is a second resync (the transitions it
    skipped must be excused by an epoch of their own)."""
    path = tmp_path / "history.jsonl"
    rec = Recorder(path, "watch0")
    watch = WatchLog(rec)
    told = [
        Entry("/a", b"1", 1),
        Entry("/a", b"5", 5, resync=True),
        Entry("/b", b"6", 6, resync=True),
        Entry("/a", b"9", 9, resync=True),  # the next resync
        Entry("/b", b"10", 10),
        Entry("/b", b"12", 12, resync=True),
    ]
    for entry in told:
        watch.on_change(entry)
    rec.close()
    history = _records(path)
    assert [(r["key"], r["epoch"]) for r in history if r["f"] == "update"] == [
        ("/a", 0), ("/a", 1), ("/b", 1), ("/a", 2), ("/b", 2), ("/b", 3)]
    assert [r["epoch"] for r in history if r["f"] == "resync"] == [1, 2, 3]
    writes = [{"proc": "w0", "f": "write", "key": key, "seq": seq, "res": "ok",
               "t0": 0.0, "t1": 0.0} for key, seq in (("/a", 3), ("/a", 7), ("/b", 11))]
    verdict = check_watchers([*history, *writes])
    assert verdict.status == "PASS" and verdict.checked == 3, verdict.examples
