"""UUIDv7s made at a bulk load's rate keep the time they were made (a fake
clock and fake randomness), and a forked child never repeats its parent's."""

from __future__ import annotations

import itertools
import os
import uuid

import pytest

from clone.wire import codec
from clone.wire.split import uuid_time
from clone.wire.uuids import Uuid7Source

T0_MS = 1_795_000_000_000


class Clock:
    def __init__(self, ms: int = T0_MS) -> None:
        self.ns = ms * 1_000_000

    def __call__(self) -> int:
        return self.ns


def counting_random() -> tuple[list[int], object]:
    calls: list[int] = []
    stream = itertools.count()

    def random(n: int) -> bytes:
        calls.append(n)
        return bytes(next(stream) % 256 for _ in range(n))

    return calls, random


def test_layout_version_variant_and_time() -> None:
    clock = Clock()
    make = Uuid7Source(clock, os.urandom)
    raw = make()
    parsed = uuid.UUID(bytes=raw)
    assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
    assert uuid_time(raw) == T0_MS / 1000.0


def test_many_in_one_millisecond_stay_ordered_and_on_time() -> None:
    """10,000 ids in one millisecond of the clock: ordered, distinct, and
    at most two milliseconds ahead (uuid6 put the last one 10 s ahead)."""
    clock = Clock()
    make = Uuid7Source(clock, os.urandom)
    ids = [make() for _ in range(10_000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert uuid_time(ids[-1]) is not None
    assert uuid_time(ids[-1]) - T0_MS / 1000.0 <= 0.003  # type: ignore[operator]
    clock.ns += 5_000_000  # the clock moves on: its time again, not a borrowed one
    after = make()
    assert uuid_time(after) == (T0_MS + 5) / 1000.0 and after > ids[-1]


def test_the_counter_borrows_a_millisecond_only_when_full() -> None:
    clock = Clock()
    make = Uuid7Source(clock, lambda n: b"\xff" * n)  # the counter starts at 2047
    first = make()
    assert (int.from_bytes(first, "big") >> 64) & 0xFFF == 0x7FF
    for _ in range(0xFFF - 0x7FF):
        last = make()
    assert uuid_time(last) == T0_MS / 1000.0
    assert (int.from_bytes(last, "big") >> 64) & 0xFFF == 0xFFF
    borrowed = make()
    assert uuid_time(borrowed) == (T0_MS + 1) / 1000.0 and borrowed > last


def test_a_clock_stepping_back_does_not_reorder() -> None:
    clock = Clock()
    make = Uuid7Source(clock, os.urandom)
    first = make()
    clock.ns -= 2_000_000_000
    assert make() > first


def test_randomness_is_drawn_in_blocks_and_forgotten_on_fork() -> None:
    calls, random = counting_random()
    make = Uuid7Source(Clock(), random)  # type: ignore[arg-type]
    for _ in range(300):
        make()
    assert calls == [4096]  # 300 ids: one draw, not one syscall each
    make.forget()  # what a forked child does
    make()
    assert calls == [4096, 4096]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_its_own_ids() -> None:
    codec.new_uuid()  # the parent's pool is filled
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        try:
            os.write(write, b"".join(codec.new_uuid() for _ in range(8)))
        finally:
            os._exit(0)
    os.close(write)
    child = b""
    while chunk := os.read(read, 4096):
        child += chunk
    os.close(read)
    os.waitpid(pid, 0)
    mine = b"".join(codec.new_uuid() for _ in range(8))
    theirs = {child[i : i + 16] for i in range(0, len(child), 16)}
    assert len(theirs) == 8
    # Same randomness would give the same 62 random bits: none is shared.
    tails = {int.from_bytes(u[8:], "big") & 0x3FFF_FFFF_FFFF_FFFF for u in theirs}
    assert not tails & {int.from_bytes(mine[i + 8 : i + 16], "big") & 0x3FFF_FFFF_FFFF_FFFF
                        for i in range(0, 128, 16)}  # fmt: skip
