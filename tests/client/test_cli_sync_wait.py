"""``clone``'s sync wait: --timeout bounds the wait for an answer, not a snapshot
that is arriving (a million keys on a busy machine)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from clone.client import cli
from clone.client.results import Status
from clone.errors import NotSynced


class FakeClient:
    def __init__(self, synced_after: float, state: str, retries: list[int]) -> None:
        self.synced_at = time.monotonic() + synced_after
        self.state = state
        self.retries = retries  # one per status() call, the last repeated

    def wait_synced(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if time.monotonic() >= self.synced_at:
                return
            time.sleep(0.01)
        raise NotSynced("not yet")

    def status(self) -> Status:
        n = self.retries.pop(0) if len(self.retries) > 1 else self.retries[0]
        return Status(self.state, "tcp://h:1", 0, 0, 0, servers=("tcp://h:1",),
                      counters={"retries": n, "failovers": 0})  # fmt: skip


def test_a_snapshot_still_arriving_is_waited_for_past_the_timeout() -> None:
    client: Any = FakeClient(synced_after=0.6, state="syncing", retries=[0])
    cli._wait_synced(client, 0.2)  # returns once synced, at ~0.6 s


@pytest.mark.parametrize(
    ("state", "retries"),
    [("syncing", list(range(1000))), ("initial", [0])],
    ids=["asking again: no data", "not syncing"],
)
def test_no_answer_still_fails_at_the_timeout(state: str, retries: list[int]) -> None:
    client: Any = FakeClient(synced_after=60, state=state, retries=retries)
    started = time.monotonic()
    with pytest.raises(NotSynced, match=r"within 0\.3 s: tried tcp://h:1"):
        cli._wait_synced(client, 0.3)
    assert time.monotonic() - started < 5
