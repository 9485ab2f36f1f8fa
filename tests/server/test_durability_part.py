"""The Durability part alone (clone.server.durability): a real data directory,
a core, and plain callbacks in place of the publisher, Binary Star and the
server's stop; no sockets and no server object."""

from __future__ import annotations

import itertools
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest

from clone.ratelimit import Throttle
from clone.server.config import ServerConfig
from clone.server.core import ServerCore
from clone.server.durability import Durability
from clone.server.shared import Shared

log = logging.getLogger(__name__)


_uuids = itertools.count(1)


def kvset(key: str, value: bytes) -> list[bytes]:
    """A client's KVSET, with a fresh uuid."""
    return [key.encode(), bytes(8), next(_uuids).to_bytes(16, "big"), b"", value]


class _Rig:
    """A durable standalone core and its Durability part; what the part's
    callbacks were given."""

    def __init__(
        self,
        data_dir: Path,
        *,
        ha_term: int | None = None,
        clock: Callable[[], float] = lambda: 0.0,
    ) -> None:
        self.config = ServerConfig(port=5556, data_dir=str(data_dir))
        self.core = ServerCore(self.config.core, standalone=True, durable=True)
        self.counters: dict[str, int] = {"storage_errors": 0}
        self.shared = Shared(Throttle(log, clock), clock, lambda: 1000.0, self.counters)
        self.published: list[list[bytes]] = []
        self.committed: list[list[list[bytes]]] = []
        self.stops = 0
        self.term = ha_term
        self.part = Durability(
            self.config,
            self.core,
            self.shared,
            publish=self.published.append,
            ha_term=lambda: self.term,
            committed=self.committed.append,
            stop=self._stop,
        )

    def _stop(self) -> None:
        self.stops += 1

    def write(self, key: str, value: bytes) -> None:
        self.core.on_kvset(kvset(key, value), 1000.0, 0.0)


def test_a_turn_is_committed_then_published_in_order(tmp_path: Path) -> None:
    rig = _Rig(tmp_path / "data")
    rig.part.open()
    try:
        rig.write("/a", b"1")
        rig.write("/b", b"2")
        rig.part.commit_and_publish()
        assert [f[0] for f in rig.published] == [b"/a", b"/b"]
        assert rig.committed == [rig.published]  # the views and the ring see the same
        assert rig.part.storage is not None and rig.part.storage.timing.commits == 1
        rig.part.commit_and_publish()  # nothing new: nothing written, nothing published
        assert len(rig.published) == 2
    finally:
        rig.part.close()
    again = _Rig(tmp_path / "data")
    again.part.open()
    try:
        assert again.core.store.sequence == 2
        assert again.part.rank() == (0, 2)
    finally:
        again.part.close()


def test_a_promotion_records_its_term_before_any_write(tmp_path: Path) -> None:
    rig = _Rig(tmp_path / "data", ha_term=3)
    rig.part.open()
    try:
        assert rig.part.data_term == 0
        rig.part.record_term()
        assert rig.part.data_term == 3 and rig.part.rank() == (3, 0)
    finally:
        rig.part.close()
    again = _Rig(tmp_path / "data")
    again.part.open()
    try:
        assert again.part.data_term == 3  # Binary Star announces it as our epoch
    finally:
        again.part.close()


def test_unpaired_writes_keep_the_stored_term(tmp_path: Path) -> None:
    rig = _Rig(tmp_path / "data")
    rig.part.open()
    try:
        rig.write("/a", b"1")
        rig.part.commit()
        rig.part.record_term()
        assert rig.part.data_term == 0
    finally:
        rig.part.close()


def test_a_failed_write_stops_the_server_and_confirms_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rig = _Rig(tmp_path / "data")
    rig.part.open()
    storage = rig.part.storage
    assert storage is not None

    def full(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(storage, "append", full)
    try:
        rig.write("/a", b"1")
        rig.part.commit_and_publish()
        assert rig.published == [] and rig.committed == []
        assert rig.stops == 1 and rig.counters["storage_errors"] == 1
        assert rig.part.error is not None
        rig.write("/b", b"2")
        rig.part.commit_and_publish()  # fail-stop: nothing more is published
        assert rig.published == [] and rig.stops == 1
    finally:
        rig.part.close()


def test_in_memory_publishes_without_writing(tmp_path: Path) -> None:
    config = ServerConfig(port=5556)
    core = ServerCore(config.core, standalone=True)
    published: list[list[bytes]] = []
    shared = Shared(Throttle(log, lambda: 0.0), lambda: 0.0, lambda: 0.0, {"storage_errors": 0})
    part = Durability(
        config,
        core,
        shared,
        publish=published.append,
        ha_term=lambda: None,
        committed=lambda updates: None,
        stop=lambda: None,
    )
    part.open()
    core.on_kvset(kvset("/a", b"1"), 0.0, 0.0)
    part.commit_and_publish()
    assert part.storage is None and [f[0] for f in published] == [b"/a"]
    part.close()
