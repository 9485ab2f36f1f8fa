"""A full resync: staged in chunks, swapped in one commit, or aborted."""

from __future__ import annotations

from pathlib import Path

import pytest

from clone.storage import Entry
from tests.storage.conftest import OpenStorage, upd


def entry(seq: int, body: bytes) -> Entry:
    return (seq.to_bytes(8, "big"), b"u" * 16, b"", body)


def test_replace_swaps_state_and_clears_log(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"old", 1), upd(b"gone", 2)], term=1, at=0.0)
    storage.begin_replace()
    storage.stage([(b"n%d" % i, entry(i, b"new")) for i in range(50)])
    storage.stage(iter([(b"n50", entry(90, b"last"))]))
    assert set(storage.load().entries) == {b"old", b"gone"}  # nothing visible until finish
    storage.finish_replace(sequence=90, term=4)
    storage.append([upd(b"after", 91)], term=4, at=1.0)
    storage.close()

    loaded = open_storage(data_dir).load()
    assert len(loaded.entries) == 52
    assert loaded.entries[b"n50"] == entry(90, b"last")
    assert b"old" not in loaded.entries
    assert (loaded.sequence, loaded.term) == (91, 4)
    assert [f[0] for f, _, _ in loaded.history] == [b"after"]


def test_abort_keeps_the_state(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"old", 1)], term=1, at=0.0)
    storage.begin_replace()
    storage.stage([(b"new", entry(5, b"x"))])
    storage.abort_replace()
    storage.abort_replace()  # harmless when there is nothing staged
    with pytest.raises(ValueError, match="begin_replace"):
        storage.finish_replace(5, 1)
    loaded = storage.load()
    assert set(loaded.entries) == {b"old"}
    assert (loaded.sequence, len(loaded.history)) == (1, 1)


def test_begin_again_discards_earlier_chunks(data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.begin_replace()
    storage.stage([(b"first", entry(1, b"x"))])
    storage.begin_replace()
    storage.stage([(b"second", entry(2, b"y"))])
    storage.finish_replace(2, 1)
    assert set(storage.load().entries) == {b"second"}


def test_staging_left_by_a_crash_is_dropped_on_open(
        data_dir: Path, open_storage: OpenStorage) -> None:
    storage = open_storage(data_dir)
    storage.append([upd(b"old", 1)], term=1, at=0.0)
    storage.begin_replace()
    storage.stage([(b"half", entry(9, b"x"))])
    storage.close()
    storage = open_storage(data_dir)
    with pytest.raises(ValueError, match="begin_replace"):
        storage.finish_replace(9, 1)
    assert set(storage.load().entries) == {b"old"}
