"""A promotion whose writes hold the loop longer than a lease's ttl keeps the
lease: its clock starts when the new active can first be reached (pure: a
real ServerCore, fake parts and clock).

Seen in a CI run: a backup's promotion waited for its disk 4.5 s (an
in-flight commit, its term, its following flag); the 1.5 s lease it had
rebuilt at the start had run out before its holder's keepalive could arrive.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

from clone.server.core import Role, ServerCore
from clone.server.roles import RoleSwitch
from tests.server.test_lease_ownership import ALICE, Caller
from tests.server.test_server_core import _snapshot_of

TTL = 1.5
DISK = 2.0  # seconds each of the promotion's writes waits for the disk


def _passive_holding_a_lease() -> tuple[ServerCore, str]:
    old = ServerCore(standalone=True)
    lease = Caller(old, ALICE).grant(ttl=TTL).lease
    new = ServerCore()
    new.become_passive()
    new.start_sync()
    for frames in _snapshot_of(old):
        new.on_snapshot_reply(frames, 0.0)
    return new, lease


def _switch(core: ServerCore, clock: list[float]) -> RoleSwitch:
    """The role switch with every part but the core faked; each of the
    durability's writes advances the clock by DISK, as a slow disk does."""

    def slow_write(*_: object) -> list[list[bytes]]:
        clock[0] += DISK
        return []

    switch = RoleSwitch.__new__(RoleSwitch)
    switch.core = core
    switch.config = cast(Any, SimpleNamespace(effective_peer_wait=1.0))
    switch.shared = cast(Any, SimpleNamespace())
    switch._clock = lambda: clock[0]
    switch._wallclock = lambda: 1.7e9 + clock[0]
    switch._ha = cast(Any, SimpleNamespace(heard_peer=True, epoch=2))
    switch._collector = cast(Any, SimpleNamespace(closed=True))
    switch.follower = None
    switch.durability = cast(
        Any,
        SimpleNamespace(
            commit=slow_write,
            record_term=slow_write,
            record_following=slow_write,
            data_term=2,
        ),
    )
    nothing = lambda *_: None  # noqa: E731
    switch.healer = cast(Any, SimpleNamespace(apply_here=nothing, took_over=nothing))
    switch.monitor = cast(Any, SimpleNamespace(note_role=nothing, note_failover=nothing))
    switch.publisher = cast(Any, SimpleNamespace(publish_bulk=nothing, publish=nothing))
    switch.votes = cast(Any, SimpleNamespace(recheck_soon_if_held=nothing))
    switch._heartbeat_ms = 250
    return switch


def test_a_slow_promotion_does_not_end_the_leases_it_rebuilt() -> None:
    core, lease = _passive_holding_a_lease()
    clock = [10.0]
    _switch(core, clock).on_active()
    assert core.role is Role.ACTIVE
    served_at = clock[0]
    assert served_at >= 10.0 + 3 * DISK > 10.0 + DISK + TTL  # the rebuild's ttl is long gone
    core.tick(1.7e9 + served_at + TTL - 0.01, served_at + TTL - 0.01)
    assert lease in core.leases  # a whole ttl from when it could be kept alive
    assert Caller(core, ALICE).call("lease-keepalive", served_at + 1.0, lease=lease).ok
    core.tick(1.7e9 + served_at + 1.0 + TTL, served_at + 1.0 + TTL)
    assert lease not in core.leases  # and it still runs out when nobody keeps it
