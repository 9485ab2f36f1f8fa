"""The executor-side writer with a fake client: confirmation, retries, bounds."""

from __future__ import annotations

import itertools

import pytest

from clone.errors import ConfirmTimeout, NotSynced
from clone.pipeline.writer import WriterConfig, write_partition

CONFIG = WriterConfig(servers=("tcp://127.0.0.1:1",), max_in_flight=4, confirm_timeout=0.01)


class FakeClient:
    """A bulk writer that answers each write after ``delay`` polls (in the
    order sent); times out the first ``timeouts[key]`` tries of a key."""

    def __init__(self, *, delay: int = 1, timeouts: dict[str, int] | None = None,
                 synced: bool = True) -> None:  # fmt: skip
        self.delay = delay
        self.timeouts = dict(timeouts or {})
        self.synced = synced
        self.stored: dict[str, tuple[bytes, float]] = {}
        self.max_in_flight = 0
        self.closed = False
        self.polls = 0
        self._sent: dict[bytes, tuple[int, str, bytes, float]] = {}
        self._uuids = itertools.count(1)

    @property
    def outstanding(self) -> int:
        return len(self._sent)

    def wait_synced(self, timeout: float = 10.0) -> None:
        if not self.synced:
            raise NotSynced("no server answered")

    def submit(self, key: str, value: bytes | str, ttl: float = 0) -> bytes:
        uuid = next(self._uuids).to_bytes(16, "big")
        body = bytes(value) if isinstance(value, bytes) else value.encode()
        self._sent[uuid] = (self.polls + self.delay, key, body, ttl)
        self.max_in_flight = max(self.max_in_flight, len(self._sent))
        return uuid

    def poll(self, timeout: float) -> list[tuple[bytes, int | BaseException]]:
        self.polls += 1
        settled: list[tuple[bytes, int | BaseException]] = []
        for uuid, (due, key, body, ttl) in list(self._sent.items()):
            if due > self.polls:
                continue
            del self._sent[uuid]
            if self.timeouts.get(key, 0) > 0:
                self.timeouts[key] -= 1
                settled.append((uuid, ConfirmTimeout(f"write to {key!r} not confirmed")))
            else:
                self.stored[key] = (body, ttl)
                settled.append((uuid, len(self.stored)))
        return settled

    def close(self) -> None:
        self.closed = True


def _rows(n: int) -> list[tuple[str, bytes, float]]:
    return [(f"/k{i}", f"v{i}".encode(), float(i % 3)) for i in range(n)]


def test_every_row_confirmed_within_the_in_flight_bound() -> None:
    client = FakeClient(delay=2)
    result = write_partition(_rows(200), CONFIG, 3, client_factory=lambda _c: client)
    assert (result.partition, result.rows, result.written, result.failed) == (3, 200, 200, 0)
    assert client.stored == {k: (v, t) for k, v, t in _rows(200)}
    assert client.max_in_flight == CONFIG.max_in_flight  # the window is kept full
    assert client.polls < 200  # answers are taken in batches, not one poll per row
    assert client.closed


def test_timeouts_are_retried_then_counted() -> None:
    client = FakeClient(timeouts={"/k1": 1, "/k2": 5})
    result = write_partition(_rows(5), CONFIG, client_factory=lambda _c: client)
    assert (result.written, result.failed, result.retries) == (4, 1, 3)
    assert "/k1" in client.stored and "/k2" not in client.stored
    assert result.error is not None and "/k2" in result.error


def test_stops_taking_rows_after_too_many_failures() -> None:
    config = WriterConfig(servers=CONFIG.servers, max_in_flight=1, attempts=1, max_failures=3)
    client = FakeClient(timeouts={f"/k{i}": 1 for i in range(1000)})
    result = write_partition(_rows(1000), config, client_factory=lambda _c: client)
    assert (result.rows, result.written, result.failed) == (1000, 0, 1000)
    assert result.retries == 0


@pytest.mark.parametrize("where", ["connect", "sync"])
def test_unreachable_servers_fail_every_row(where: str) -> None:
    def factory(_config: WriterConfig) -> FakeClient:
        if where == "connect":
            raise OSError("connection refused")
        return FakeClient(synced=False)

    result = write_partition(_rows(7), CONFIG, client_factory=factory)
    assert (result.rows, result.written, result.failed) == (7, 0, 7)
    assert result.error is not None


def test_confirmed_through_stops_at_the_first_row_not_confirmed() -> None:
    config = WriterConfig(servers=CONFIG.servers, max_in_flight=4, attempts=1)
    client = FakeClient(timeouts={"/k3": 1})
    result = write_partition(_rows(6), config, client_factory=lambda _c: client)
    assert (result.written, result.failed) == (5, 1)
    assert result.confirmed_through == "/k2"  # /k4 and /k5 were confirmed, /k3 not


def test_resume_skips_the_rows_confirmed_before() -> None:
    rows = sorted(_rows(6))
    config = WriterConfig(servers=CONFIG.servers, resume=((7, "/k2"),))
    client = FakeClient()
    result = write_partition(rows, config, 7, client_factory=lambda _c: client)
    assert (result.rows, result.skipped, result.written) == (6, 3, 3)
    assert sorted(client.stored) == ["/k3", "/k4", "/k5"]
    assert result.confirmed_through == "/k5"
    other = write_partition(rows, config, 1, client_factory=lambda _c: FakeClient())
    assert (other.skipped, other.written) == (0, 6)  # another partition's mark
