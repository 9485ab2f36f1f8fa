"""The disk gate: a snapshot's KTHXBAI and a catch-up wait for the commit.

Pure: the committed sequence, the store's and the durability's
``when_published`` are fakes the test moves by hand (the e2e with a real
server and a held commit is tests/server/test_snapshot_on_disk_e2e.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from clone.server.delta import DeltaStream
from clone.server.diskgate import DiskGate, committed_through
from clone.server.journal import Journal
from clone.wire.codec import encode_kthxbai, new_uuid


class _Disk:
    """A server's sequences and its commits, moved by the test."""

    def __init__(self, store: int, committed: int) -> None:
        self.store = store
        self.committed = committed
        self.waiting: list[Callable[[], None]] = []  # when_published callbacks
        self.woken: list[Any] = []
        self.served: set[Any] = set()
        self.counters: dict[str, int] = {}
        self.gate = DiskGate(
            committed=lambda: self.committed,
            store_sequence=lambda: self.store,
            when_published=self.waiting.append,
            wake=self.woken.append,
            alive=lambda stream: stream in self.served,
            counters=self.counters,
        )

    def land(self) -> None:
        """Everything applied so far is committed: what waited for it runs."""
        self.committed = self.store
        waiting, self.waiting[:] = list(self.waiting), []
        for callback in waiting:
            callback()


def _kthxbai(sequence: int) -> list[bytes]:
    return [b"id", *encode_kthxbai(sequence)]


def _update(key: str, sequence: int) -> list[bytes]:
    """An update's five KVPUB frames."""
    return [key.encode(), sequence.to_bytes(8, "big"), new_uuid(), b"", b"v"]


def _entry(key: bytes, sequence: int) -> list[bytes]:
    return [b"id", key, sequence.to_bytes(8, "big"), b"", b"", b"v"]


def test_a_snapshots_entries_go_its_kthxbai_waits_for_what_it_showed_to_be_committed() -> None:
    disk = _Disk(store=188, committed=187)  # 188 applied, its commit in flight
    stream = object()
    disk.served.add(stream)
    assert not disk.gate.holds(stream, _entry(b"/chaos/counter/0", 188))
    assert disk.gate.holds(stream, _kthxbai(185))
    assert disk.counters["snapshot_ends_held"] == 1 and len(disk.gate) == 1
    assert disk.gate.holds(stream, _kthxbai(185))  # asked again before the commit: still held
    assert len(disk.waiting) == 1, "one wake-up per hold, not one per question"
    assert disk.woken == []
    disk.land()
    assert disk.woken == [stream]
    assert not disk.gate.holds(stream, _kthxbai(185))
    assert len(disk.gate) == 0 and disk.counters["snapshot_ends_held"] == 1


def test_a_held_end_waits_for_its_own_target_not_for_what_came_after() -> None:
    # Under a steady write load there is always a newer update in flight: the
    # end waits for what the store held when it was due, not for the store.
    disk = _Disk(store=10, committed=8)
    stream = object()
    disk.served.add(stream)
    assert disk.gate.holds(stream, _kthxbai(9))
    disk.store = 10
    disk.land()  # 10 committed
    disk.store, disk.committed = 14, 10  # 11-14 applied meanwhile, not committed
    assert not disk.gate.holds(stream, _kthxbai(9))


def test_nothing_uncommitted_nothing_held() -> None:
    disk = _Disk(store=50, committed=50)
    stream = object()
    assert not disk.gate.holds(stream, _kthxbai(50))
    assert disk.waiting == [] and "snapshot_ends_held" not in disk.counters


def test_a_catch_up_waits_from_its_first_message_until_its_sequence_is_committed() -> None:
    updates = [_update(f"/k/{n}", n) for n in (6, 7, 8)]
    delta = DeltaStream(b"id", updates, 5, 8)
    disk = _Disk(store=8, committed=6)
    disk.served.add(delta)
    first = delta.peek()
    assert first is not None
    assert disk.gate.holds(delta, first)
    disk.land()
    assert disk.woken == [delta]
    assert not disk.gate.holds(delta, first)


def test_a_stream_aborted_while_held_is_forgotten_when_the_commit_lands() -> None:
    disk = _Disk(store=3, committed=2)
    stream = object()
    disk.served.add(stream)
    assert disk.gate.holds(stream, _kthxbai(3))
    disk.served.discard(stream)
    disk.land()
    assert disk.woken == [] and len(disk.gate) == 0


def test_the_committed_sequence_stops_below_the_commit_in_flight_and_the_gathered_group() -> None:
    journal = Journal()
    store = SimpleNamespace(sequence=12)
    core: Any = SimpleNamespace(journal=journal, store=store)
    in_flight: Any = SimpleNamespace(in_flight=True, announced_sequence=lambda: 9)
    idle: Any = SimpleNamespace(in_flight=False, announced_sequence=lambda: 12)
    assert committed_through(in_flight, core) == 9
    assert committed_through(idle, core) == 12
    journal.update(_update("/a", 11))
    journal.update(_update("/b", 12))
    assert journal.first_sequence() == 11
    assert committed_through(idle, core) == 10
    journal.take()
    assert journal.first_sequence() is None
    assert committed_through(idle, core) == 12
