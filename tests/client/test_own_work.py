"""Our own work is not a freeze: the freeze rule (``freeze_gap``) counts only
time in which this process did not run, however long a turn's work took.

At 10M keys a turn of the agent's loop (a large ITEMS, the side map's dict
growing) or the application's thread holding the GIL (unpacking those rows)
took from 1.5 to 60 s; measured from the previous tick, that looked like a
freeze, which resyncs: ``clone dump`` took a second 10M-key snapshot while it
held the first.  Pure tests with a fake clock, and one end to end.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from clone import Clone
from clone.client.fsm import AgentConfig, AgentFSM, RequestSnapshot, State
from clone.wire.batch import encode_kvbatch
from clone.wire.codec import Hugz, encode_kthxbai
from tests.support.clients import endpoint
from tests.support.servers import Servers

CFG = AgentConfig(server_timeout=2.5, freeze_gap=1.5)


def _batch(first: int, n: int) -> list[bytes]:
    keys = [f"/k/{i:07d}".encode() for i in range(first, first + n)]
    entries = [((i + 1).to_bytes(8, "big"), bytes(16), b"", b"v") for i in range(first, first + n)]
    return encode_kvbatch(keys, entries)


def _syncing() -> AgentFSM:
    fsm = AgentFSM(None, CFG, now=0.0)
    fsm.connect("tcp://127.0.0.1:5556", 0.0)
    fsm.connect("tcp://127.0.0.1:5566", 0.0)
    fsm.tick(0.0)
    fsm.idle_from(0.0)
    return fsm


def test_a_long_turn_of_our_own_work_is_neither_a_freeze_nor_silence() -> None:
    """A turn that handles a batch for 20 s: the next tick, right after the
    next poll, sees no freeze, and the server's messages queued meanwhile
    (read before that tick) keep it ours: the sync goes on and completes."""
    fsm = _syncing()
    fsm.snapshot_batch(0, [_batch(0, 100)], 0.1)  # the first data
    fsm.tick(0.1)
    fsm.idle_from(20.1)  # that turn's work ended 20 s later
    # The next turn: what the server sent meanwhile was waiting in our sockets.
    fsm.update(0, Hugz(0, heartbeat=0.25), 20.11)
    fsm.snapshot_batch(0, [_batch(100, 100)], 20.12)
    assert fsm.tick(20.11) == []
    assert fsm.counters.self_freezes == 0 and fsm.counters.failovers == 0
    assert fsm.counters.retries == 0 and fsm.counters.resyncs == 0
    fsm.snapshot_batch(0, [encode_kthxbai(200, "")], 20.2)
    assert fsm.state is State.ACTIVE and len(fsm) == 200 and fsm.counters.syncs_full == 1


def test_time_we_did_not_run_after_our_work_is_still_a_freeze() -> None:
    """The same turn, then 5 s in which we did not run (SIGSTOP, a starved
    machine): a freeze, judged from the end of the work, not blamed on the server."""
    fsm = _syncing()
    fsm.snapshot_batch(0, [_batch(0, 100), encode_kthxbai(100, "")], 0.1)
    assert fsm.state is State.ACTIVE
    fsm.tick(0.1)
    fsm.idle_from(20.1)
    actions = fsm.tick(25.1)  # 5 s after the work ended: more than freeze_gap
    assert fsm.counters.self_freezes == 1 and fsm.counters.failovers == 0
    assert [a.server for a in actions if isinstance(a, RequestSnapshot)] == [0]


def test_idle_from_only_moves_forward() -> None:
    """An earlier time (the CPU our process spent while we waited, added to
    the end of a turn that tick already passed) never brings back a gap."""
    fsm = _syncing()
    fsm.snapshot_batch(0, [_batch(0, 10), encode_kthxbai(10, "")], 0.1)
    fsm.tick(10.0)  # a real gap: counted once
    assert fsm.counters.self_freezes == 1
    fsm.snapshot_batch(0, [_batch(0, 10), encode_kthxbai(10, "")], 10.1)
    fsm.tick(10.2)
    fsm.idle_from(3.0)  # earlier than the last tick: ignored
    fsm.tick(10.5)
    assert fsm.counters.self_freezes == 1


def test_a_starved_wait_counts_less_the_cpu_our_other_threads_used() -> None:
    """The loop's own arithmetic (clone.client.agent): after a poll, the idle
    point is the end of the last turn plus our process's CPU time meanwhile;
    30 s of another thread's work within a 30.5 s wait is no freeze, 1 s of it
    within the same wait is."""
    for cpu, frozen in ((30.0, 0), (1.0, 1)):
        fsm = _syncing()
        fsm.snapshot_batch(0, [_batch(0, 10), encode_kthxbai(10, "")], 0.1)
        fsm.tick(0.1)
        ended, now = 0.2, 30.7
        fsm.idle_from(min(now, ended + cpu))
        fsm.tick(now)
        assert fsm.counters.self_freezes == frozen, (cpu, frozen)


def test_without_idle_from_the_old_rule_holds() -> None:
    """A caller that never says (a fake clock in tests, a loop of its own):
    ticks far apart are a freeze, as before."""
    fsm = _syncing()
    fsm.snapshot_batch(0, [_batch(0, 10), encode_kthxbai(10, "")], 0.1)
    fsm.tick(0.5)
    fsm.tick(10.0)
    assert fsm.counters.self_freezes == 1


@pytest.mark.slow
def test_a_long_listing_in_the_agent_is_not_taken_for_a_freeze(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real sockets and server: the agent spends 3 s in one ITEMS (what
    sorting and packing 10M rows took), a turn of its own work; before,
    the next tick counted those 3 s as a freeze of our process and resynced."""
    server = servers.standalone("--in-memory")
    real_rows = AgentFSM.rows

    def slow_rows(self: AgentFSM, prefix: str = "") -> list[tuple[str, Any]]:
        time.sleep(3.0)  # the length of the agent's turn is the input here
        return real_rows(self, prefix)

    monkeypatch.setattr(AgentFSM, "rows", slow_rows)
    with Clone([endpoint(server)]) as client:
        client.wait_synced(30)
        client.set("/own/k", b"v", wait=True)
        # From here: a resync at the client's start is not the listing's.
        # Its subscription may not be live on the server yet when the first
        # update is published (a slow joiner: the next HUGZ shows the hole,
        # and the client resyncs, as it must; seen under two CPU hogs); once
        # this write is confirmed, the subscription is live.
        before = client.status().counters
        assert client.items("/own/") == [("/own/k", b"v")]
        # The turn that takes this write ticks after the listing's turn (a
        # STATUS drained with the listing's would be answered before it);
        # its confirmation comes in a later turn, and this STATUS after that.
        client.set("/own/k", b"w", wait=True)
        counters = client.status().counters
    assert counters["self_freezes"] == 0, counters
    assert counters["resyncs"] == before["resyncs"], (before, counters)
    assert counters["failovers"] == before["failovers"] == 0, counters
