"""After a failover a BulkWriter sends the writes the old server confirmed to
the new one again, with their uuids, reporting nothing twice: two fake CHP
servers on real sockets (tests/support/fake_server.py), no processes."""

from __future__ import annotations

import time

from clone.client.writeonly import BulkWriter
from clone.wire.calls import OP_SET, Call, Reply
from tests.support.fake_server import FakeServer
from tests.support.waiting import eventually


def _answer_sets(server: FakeServer) -> None:
    """The server answers every set call ok, with the next sequence."""
    sequences = iter(range(1, 1_000_000))

    def answer(call: Call) -> Reply | None:
        return Reply(call.uuid, "ok", next(sequences)) if call.op == OP_SET else None

    server.on_call = answer


def test_the_writes_the_old_server_confirmed_go_to_the_new_one_again() -> None:
    with FakeServer() as old, FakeServer() as new:
        _answer_sets(old)
        _answer_sets(new)
        new.silent = True  # the passive: no HUGZ, no answers
        writer = BulkWriter([old.endpoint, new.endpoint], server_timeout=0.5,
                            dead_after=60.0, batch_rows=0)  # fmt: skip
        try:
            writer.wait_synced(30)
            uuids = [writer.submit(f"/r/{i:02d}", b"v") for i in range(10)]
            settled: dict[bytes, int | BaseException] = {}
            deadline = time.monotonic() + 60
            while len(settled) < 10 and time.monotonic() < deadline:
                settled.update(writer.poll(0.2))
            assert sorted(settled) == sorted(uuids)
            assert all(isinstance(seq, int) for seq in settled.values())
            # The old active dies; the new one takes over.
            old.silent = True
            new.silent = False

            def reconfirmed() -> bool:
                settled.update(writer.poll(0.1))  # nothing more may be reported
                return writer.reconfirmed == (10, 0)

            eventually(reconfirmed, 60, "the confirmed writes sent to the new server")
            assert len(settled) == 10 and writer.outstanding == 0
        finally:
            writer.close()
        # The same uuids, each once: the new server deduplicates what it holds.
        assert sorted(c.uuid for c in new.calls) == sorted(uuids)
        assert [c.key for c in new.calls] == [f"/r/{i:02d}" for i in range(10)]


def test_the_reconfirmed_writes_go_before_the_ones_still_in_flight() -> None:
    """A write in flight when the old server died was written after the ones
    it had confirmed: the new server gets them in that order, so a key
    rewritten since is not taken back by its older value."""
    with FakeServer() as old, FakeServer() as new:
        _answer_sets(old)
        _answer_sets(new)
        new.silent = True
        writer = BulkWriter([old.endpoint, new.endpoint], server_timeout=0.5,
                            dead_after=60.0, batch_rows=0)  # fmt: skip
        try:
            writer.wait_synced(30)
            uuids = [writer.submit(f"/r/{i:02d}", b"old") for i in range(5)]
            settled: dict[bytes, int | BaseException] = {}
            deadline = time.monotonic() + 60
            while len(settled) < 5 and time.monotonic() < deadline:
                settled.update(writer.poll(0.2))
            assert sorted(settled) == sorted(uuids)
            old.silent = True  # it dies with the rewrite of /r/04 in flight
            new.silent = False
            late = writer.submit("/r/04", b"new")

            def done() -> bool:
                settled.update(writer.poll(0.1))
                return late in settled and writer.reconfirmed == (5, 0)

            eventually(done, 60, "the failover's writes answered")
        finally:
            writer.close()
        sent = [(c.key, c.body) for c in new.calls]
        assert sent.index(("/r/04", b"new")) > sent.index(("/r/04", b"old")), sent
        assert [k for k, v in sent if v == b"old"] == [f"/r/{i:02d}" for i in range(5)]
