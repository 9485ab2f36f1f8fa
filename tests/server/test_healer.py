"""The Healer part alone (clone.server.healing): real cores from a split brain,
a fake clock, the loop's next turns run by the test, and plain callbacks in
place of the publisher, the durability part and the snapshot port.

The loser's sends to the winner go over a DEALER and are covered end to end
(test_split_heal_e2e.py); here: the winner's hold and the requests it holds,
and a loser elected again applying its split writes itself."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.core import Role, ServerCore
from clone.server.healing import HOLD_MAX, Healer
from clone.server.shared import Shared
from tests.server.test_split_writes import _split, _value
from tests.support.published import published


class _NoSockets:
    """A healer that never sends opens nothing."""

    def socket(self, kind: int) -> zmq.Socket[Any]:
        raise AssertionError("no socket expected")

    def stream(self, sock: zmq.Socket[Any], handler: Callable[[list[bytes]], None]) -> ZMQStream:
        raise AssertionError("no stream expected")

    def forget(self, stream: ZMQStream) -> None:
        raise AssertionError("no stream expected")


class _Rig:
    def __init__(self, core: ServerCore, *, won: bool = True) -> None:
        self.now = 100.0
        self.core = core
        self.won = won
        self.later: list[Callable[[], None]] = []
        self.published: list[list[bytes]] = []
        self.served: list[tuple[bytes, str, dict[str, Any]]] = []
        self.commits = 0
        self.counters: dict[str, int] = dict.fromkeys(
            (
                "internal_errors",
                "split_writes_applied",
                "split_writes_refused",
                "split_writes_conflicts",
                "split_writes_resent",
                "split_writes_abandoned",
            ),
            0,
        )
        shared = Shared(
            Throttle(logging.getLogger("test.healer"), lambda: self.now),
            clock=lambda: self.now,
            wallclock=lambda: self.now,
            counters=self.counters,
        )
        self.part = Healer(
            ServerConfig(port=5556),
            core,
            shared,
            _NoSockets(),
            next_turn=self._next_turn,
            followed=lambda: "127.0.0.1:5556",
            commit_and_publish=self._commit_and_publish,
            publish=self.published.append,
            won_split=lambda: self.won,
            serve=lambda identity, subtree, options: self.served.append(
                (identity, subtree, options)
            ),
            stopping=lambda: False,
        )

    def _next_turn(self, callback: Callable[[], None]) -> bool:
        self.later.append(callback)
        return True

    def _commit_and_publish(self) -> None:
        self.commits += 1
        self.published.extend(published(self.core))

    def run_turns(self, limit: int = 100) -> None:
        for _ in range(limit):
            if not self.later:
                return
            self.later.pop(0)()
        raise AssertionError("turns never ended")


def _active() -> ServerCore:
    core = ServerCore(standalone=True)
    core.become_active(0.0)
    return core


def test_a_split_brain_won_holds_client_updates_until_the_hold_ends() -> None:
    rig = _Rig(_active())
    rig.part.on_split_brain()
    assert rig.core.holding
    assert rig.part.defers_clients()  # Binary Star showed it: client snapshots wait
    rig.part.hold_request(b"client", "/a/", {"batch": True})
    rig.part.check()
    assert rig.core.holding and rig.served == []
    rig.now += HOLD_MAX
    rig.part.check()
    assert not rig.core.holding and not rig.part.defers_clients()
    assert rig.served == [(b"client", "/a/", {"batch": True})]
    assert rig.commits == 1  # what it held is committed and published at once


def test_a_split_brain_seen_while_stepping_down_holds_nothing() -> None:
    rig = _Rig(_active(), won=False)
    rig.part.on_split_brain()
    assert not rig.core.holding and not rig.part.defers_clients()


def test_the_peers_first_sync_after_a_takeover_holds_updates_not_clients() -> None:
    rig = _Rig(_active())
    rig.part.took_over()
    rig.part.peer_sync_started(stepped_down=False)
    rig.part.peer_sync_served()
    assert rig.core.holding
    # A restarted peer's sync: nothing of this run to forward, clients go on.
    assert not rig.part.defers_clients()
    rig.part.peer_sync_done()
    rig.now += 3.5  # past HOLD_FIRST_CALL after the sync streamed, no call came
    rig.part.check()
    assert not rig.core.holding


def test_a_peer_catching_up_from_before_the_takeover_holds_nothing() -> None:
    # The old active back after a handover: its last update is ours at or
    # before the sequence we took over at, so it has nothing to forward.
    core = ServerCore()
    core.store.sequence = 40
    core.become_active(0.0)
    assert core.promoted_at == 40
    for start in (40, 12):
        rig = _Rig(core)
        rig.part.took_over()
        rig.part.peer_sync_started(stepped_down=True)
        rig.part.peer_sync_served(caught_up_from=start)
        assert not core.holding
    # A catch-up from past the takeover (it wrote on in its own term), or a
    # whole snapshot (its last update is not ours): held, as before.
    for start in (41, None):
        rig = _Rig(core)
        rig.part.took_over()
        rig.part.peer_sync_served(caught_up_from=start)
        assert core.holding
        rig.now += 30.0
        rig.part.check()
        assert not core.holding


def test_a_loser_that_says_so_defers_client_snapshots() -> None:
    rig = _Rig(_active())
    rig.part.took_over()
    rig.part.peer_sync_started(stepped_down=True)
    rig.part.peer_sync_served()
    assert rig.part.defers_clients()


def test_a_loser_elected_again_applies_its_split_writes_over_turns() -> None:
    a, _winner, _ = _split()
    assert a.split_left
    rig = _Rig(a)
    rig.part.demoted()
    assert rig.part.stepped_down
    a.term = 3
    a.become_active(20.0)
    assert a.role is Role.ACTIVE
    rig.part.apply_here()
    rig.run_turns()
    assert not a.split_left and rig.part.queued == 0
    assert _value(a, "/k/2") == b"written on A"
    assert rig.commits >= 1
    assert rig.counters["split_writes_applied"] >= 1
    assert rig.counters["internal_errors"] == 0
