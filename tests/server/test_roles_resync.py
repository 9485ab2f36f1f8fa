"""The role switch marks a durable passive behind its active while it
resyncs after a gap, and a vote then finds it behind (pure, fake parts).

Chaos run seed 1 (before the fix): a backup that had caught up to 231 saw a
gap (the primary was at 233) and resynced; the primary stopped at 239, and a
client's vote 0.2 s later made the backup active on 231 plus its pending list.
Compare-and-sets go to the active only, so no client's pending copy held the
confirmed ones at 233 and 237: they came back as split-brain conflicts.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from bstar import BinaryStarFSM, State
from clone.server.core import Role
from clone.server.roles import RoleSwitch


class _FsmHA:
    """Stands in for :class:`bstar.reactor.BinaryStar`: a real state machine
    driven with explicit times, as the reactor would drive it."""

    def __init__(self) -> None:
        self.fsm = BinaryStarFSM(False, 0.0, heartbeat=0.25, missed=4)  # a backup
        # Heard the active (epoch 1), stands by.
        self.fsm.receive_peer_state(State.ACTIVE, 0.1, epoch=1)
        assert self.fsm.state is State.PASSIVE

    def set_behind_peer(self, behind: bool) -> None:
        self.fsm.set_behind_peer(behind)


def _switch(ha: _FsmHA, *, role: Role, durable: bool) -> tuple[RoleSwitch, list[str]]:
    forwarded: list[str] = []
    switch = RoleSwitch.__new__(RoleSwitch)  # only the parts on_resync/on_synced touch
    switch._ha = cast(Any, ha)
    switch.core = cast(Any, SimpleNamespace(role=role))
    switch.durability = cast(Any, SimpleNamespace(storage=object() if durable else None))
    switch.healer = cast(Any, SimpleNamespace(forward=lambda: forwarded.append("forward")))
    return switch, forwarded


def test_a_durable_passive_resyncing_after_a_gap_refuses_votes_until_synced() -> None:
    ha = _FsmHA()
    switch, forwarded = _switch(ha, role=Role.PASSIVE, durable=True)
    switch.on_synced()  # caught up (231)
    assert not ha.fsm.behind_peer
    switch.on_resync()  # a gap: the active is at 233
    assert ha.fsm.behind_peer
    # The active stops; its expiry passes; clients vote: all refused.
    for now in (1.2, 5.0, 100.0):
        outcome = ha.fsm.client_request(now)
        assert not outcome.accepted and ha.fsm.state is State.PASSIVE
    # Had the resync completed first, the next vote is a normal failover.
    switch.on_synced()
    assert forwarded == ["forward", "forward"]
    outcome = ha.fsm.client_request(101.0)
    assert outcome.accepted and ha.fsm.state is State.ACTIVE


@pytest.mark.parametrize(("role", "durable"), [(Role.PASSIVE, False), (Role.ACTIVE, True)])
def test_in_memory_or_active_servers_are_not_marked(role: Role, durable: bool) -> None:
    # In memory a passive takes over as the Guide's does (docs/failover.md);
    # an active is followed by nobody, a stale callback changes nothing.
    ha = _FsmHA()
    switch, _ = _switch(ha, role=role, durable=durable)
    switch.on_resync()
    assert not ha.fsm.behind_peer
    assert ha.fsm.client_request(100.0).accepted
