"""The byte budget of split-brain conflicts (``--max-conflict-bytes``).

Pure: a :class:`ConflictBook` with explicit records and budgets; the sizes are
worked out by hand from :func:`record_bytes` (128 bytes of overhead plus the
record's byte strings).
"""

from __future__ import annotations

from dataclasses import astuple
from pathlib import Path

import pytest

from clone.server.conflicts import RECORD_OVERHEAD, ConflictBook, ConflictRecord, record_bytes
from clone.storage import Storage


def _rec(n: int, *, body: bytes = b"0123456789") -> ConflictRecord:
    """A conflict of key ``/k<n>`` (3 bytes for n < 10): reason 12 bytes, two
    16-byte uuids, the loser's body as given, the winner's 5 bytes."""
    return ConflictRecord(
        id=0,
        key=f"/k{n}".encode(),
        reason="winner-wrote",
        loser_uuid=bytes([n]) * 16,
        loser_props=b"",
        loser_body=body,
        loser_at=100.0 + n,
        loser_term=3,
        winner_seq=10 + n,
        winner_uuid=b"w" * 16,
        winner_props=b"",
        winner_body=b"later",
        winner_at=200.0 + n,
        recorded=300.0 + n,
    )


#: 128 + key 3 + reason 12 + uuids 32 + loser body 10 + winner body 5.
SIZE = 190


def test_a_record_counts_its_bytes_and_the_overhead() -> None:
    assert RECORD_OVERHEAD == 128
    assert record_bytes(_rec(1)) == SIZE
    assert record_bytes(_rec(1, body=b"x" * 1000)) == SIZE - 10 + 1000
    # A record without a winner's side (the key was deleted there) counts none.
    bare = ConflictRecord(0, b"/k", "gone", b"u" * 16, b"", b"", 0.0, 1, 0, None, None, None,
                          None, 0.0)
    assert record_bytes(bare) == 128 + 2 + 4 + 16


def test_within_the_budget_nothing_is_dropped() -> None:
    book = ConflictBook(max_bytes=3 * SIZE)
    for n in (1, 2, 3):
        book.record(_rec(n))
    assert (len(book), book.nbytes, book.dropped, book.trimmed) == (3, 3 * SIZE, 0, 0)
    assert [r.id for r in book.take_dirty()] == [1, 2, 3]
    assert book.take_dropped() == []


def test_over_the_budget_the_oldest_unresolved_is_dropped_and_counted() -> None:
    book = ConflictBook(max_bytes=3 * SIZE)
    for n in (1, 2, 3):
        book.record(_rec(n))
    book.take_dirty()
    book.record(_rec(4))
    assert [r.id for r in book.records()] == [2, 3, 4]
    assert (book.nbytes, book.dropped, book.trimmed, book.unresolved) == (3 * SIZE, 1, 0, 3)
    assert book.of_uuid(bytes([1]) * 16) is None and book.get(1) is None
    assert book.of_uuid(bytes([4]) * 16) == book.get(4)
    # The data directory is told to delete it, and to write the new one.
    assert book.take_dropped() == [1]
    assert [r.id for r in book.take_dirty()] == [4]
    assert book.total == 4  # recorded since start, dropped or not


def test_resolved_records_go_before_unresolved_ones_oldest_first() -> None:
    book = ConflictBook(max_bytes=3 * SIZE)
    for n in (1, 2, 3):
        book.record(_rec(n))
    book.resolve(3, "applied")
    book.resolve(2, "discarded")
    book.record(_rec(4))
    # Resolved 3 then 2, but 2 is the older record: it goes first.
    assert [r.id for r in book.records()] == [1, 3, 4]
    assert (book.dropped, book.trimmed, book.unresolved) == (0, 1, 2)
    book.record(_rec(5))
    assert [r.id for r in book.records()] == [1, 4, 5]
    assert (book.dropped, book.trimmed, book.unresolved) == (0, 2, 3)
    book.record(_rec(6))
    assert [r.id for r in book.records()] == [4, 5, 6]
    assert (book.dropped, book.trimmed, book.unresolved) == (1, 2, 3)
    assert book.take_dropped() == [1, 2, 3]


def test_a_record_dropped_before_it_was_written_is_not_written() -> None:
    book = ConflictBook(max_bytes=2 * SIZE)
    for n in (1, 2, 3):
        book.record(_rec(n))
    assert [r.id for r in book.take_dirty()] == [2, 3]
    # Deleting id 1 is harmless though it was never written.
    assert book.take_dropped() == [1]


def test_a_record_bigger_than_the_budget_alone_is_dropped_at_once() -> None:
    book = ConflictBook(max_bytes=SIZE)
    book.record(_rec(1))
    kept = book.record(_rec(2, body=b"x" * 1000))
    assert kept.id == 2 and book.get(2) is None
    assert [r.id for r in book.records()] == [] and book.nbytes == 0
    assert book.dropped == 2


def test_no_bound_with_zero() -> None:
    book = ConflictBook(max_bytes=0)
    for n in range(1, 10):
        book.record(_rec(n, body=b"x" * 10_000))
    assert len(book) == 9 and book.dropped == 0
    with pytest.raises(ValueError, match="max_bytes"):
        ConflictBook(max_bytes=-1)


def test_loading_more_than_a_smaller_budget_trims_it() -> None:
    first = ConflictBook(max_bytes=0)
    for n in (1, 2, 3, 4):
        first.record(_rec(n))
    first.resolve(3, "discarded")
    second = ConflictBook(max_bytes=2 * SIZE)
    second.load(first.records())
    # Resolved 3 goes first, then the oldest unresolved, 1.
    assert [r.id for r in second.records()] == [2, 4]
    assert (second.dropped, second.trimmed, second.unresolved, second.nbytes) == (1, 1, 2, 2 * SIZE)
    assert second.take_dropped() == [1, 3]
    assert second.take_dirty() == []
    # New ids continue after the highest loaded, dropped or not.
    assert second.record(_rec(5)).id == 5


def test_put_back_keeps_what_a_busy_write_did_not_take() -> None:
    book = ConflictBook(max_bytes=2 * SIZE)
    for n in (1, 2, 3):
        book.record(_rec(n))
    dirty, dropped = book.take_dirty(), book.take_dropped()
    book.resolve(3, "applied")  # changed while the write waited: the newer one is kept
    book.put_back(dirty, dropped)
    again = {r.id: r.resolution for r in book.take_dirty()}
    assert again == {2: None, 3: "applied"}
    assert book.take_dropped() == [1]


def test_a_restart_keeps_the_bound(tmp_path: Path) -> None:
    """Through a real data directory: what was dropped is deleted from the
    table, so a reopened server loads what the budget holds, and no more."""
    def write(storage: Storage, book: ConflictBook) -> None:
        storage.write_conflicts([astuple(r) for r in book.take_dirty()], book.take_dropped())

    data = tmp_path / "data"
    book = ConflictBook(max_bytes=3 * SIZE)
    with Storage.open(data, checkpoint_interval=3600.0) as storage:
        for n in (1, 2, 3):
            book.record(_rec(n))
        write(storage, book)
        book.resolve(1, "applied")
        book.record(_rec(4))  # 1 (resolved) goes
        book.record(_rec(5))  # then 2 (unresolved)
        write(storage, book)
        assert [row[0] for row in storage.read_conflicts()] == [3, 4, 5]
    with Storage.open(data, checkpoint_interval=3600.0) as storage:
        rows = storage.read_conflicts()
    reloaded = ConflictBook(max_bytes=3 * SIZE)
    reloaded.load(ConflictRecord(*row) for row in rows)
    assert reloaded.records() == book.records()
    assert (reloaded.nbytes, reloaded.dropped, reloaded.take_dropped()) == (3 * SIZE, 0, [])
