"""A real client, real sockets: a confirmed write later reported a split-brain
conflict raises the event the application watches.

The fake server (tests/support/fake_server.py) plays the island's active: it
confirms the client's writes, and then, as a stepped-down server does when the
winner keeps one of them as a conflict (clone.server.healing), publishes the
notice on the topic every client receives.
"""

from __future__ import annotations

import threading

import pytest

from clone import Clone, SplitConflict
from clone.server.healing import ANY_WRITER
from clone.wire.control import encode_refusal
from tests.support.fake_server import FakeServer
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow


def test_on_conflict_hears_of_a_confirmed_write_that_became_a_conflict() -> None:
    seen: list[SplitConflict] = []
    lock = threading.Lock()

    def note(conflict: SplitConflict) -> None:
        with lock:
            seen.append(conflict)

    with FakeServer() as srv, Clone([srv.endpoint], heartbeat=0.1) as client:
        client.on_conflict(note)
        client.wait_synced(10)
        client.set("/cfg/db/host", b"island", wait=True, timeout=10)
        client.set("/cfg/other", b"kept", wait=True, timeout=10)
        mine = srv.map["/cfg/db/host"].uuid
        # Another client's conflict first: not ours, nothing happens.
        srv.inject("pub", encode_refusal(ANY_WRITER, b"\x07" * 16, "conflict"))
        srv.inject("pub", encode_refusal(ANY_WRITER, mine, "conflict"))
        eventually(lambda: bool(seen), 10, "the on_conflict callback")
        with lock:
            (got,) = seen
        assert (got.key, got.uuid, got.reason) == ("/cfg/db/host", mine, "conflict")
        # The write stays as the servers hold it; the application decides.
        assert client.get("/cfg/db/host") == b"island"
