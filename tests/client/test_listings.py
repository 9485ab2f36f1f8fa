"""Listings read page by page (``Clone.iter_entries``, ``clone dump``): the
agent's bounded table of open listings (pure), then a real client against the
in-process fake server: the same rows as ``entries()``, one moment for every
page, an early stop dropping the listing, a dropped listing refused."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from clone import Clone
from clone.client.listings import MAX_LISTINGS, ListingGone, Listings
from clone.errors import CloneError
from tests.support.fake_server import FakeServer
from tests.support.waiting import eventually

HB = 0.1


def test_pages_come_in_order_and_a_listing_read_to_its_end_is_dropped() -> None:
    listings = Listings()
    listing = listings.open(list(range(7)))
    assert [listings.page(listing, 3), listings.page(listing, 3)] == [
        ([0, 1, 2], True),
        ([3, 4, 5], True),
    ]
    assert listings.page(listing, 3) == ([6], False)
    assert len(listings) == 0
    with pytest.raises(ListingGone, match="read to its end, closed, or dropped"):
        listings.page(listing, 3)


@pytest.mark.parametrize(
    ("rows", "limit", "pages"),
    [
        ([], 5, [([], False)]),
        ([1, 2], 2, [([1, 2], False)]),
        ([1, 2, 3], 1, [([1], True), ([2], True), ([3], False)]),
    ],
    ids=["empty", "exactly-one-page", "one-row-pages"],
)
def test_page_edges(rows: list[int], limit: int, pages: list[tuple[list[int], bool]]) -> None:
    listings = Listings()
    listing = listings.open(rows)
    assert [listings.page(listing, limit) for _ in pages] == pages
    assert len(listings) == 0


def test_opening_one_too_many_drops_the_oldest_and_counts_it() -> None:
    listings = Listings()
    first = listings.open([1, 2])
    later = [listings.open([i, i]) for i in range(MAX_LISTINGS)]
    assert len(listings) == MAX_LISTINGS and listings.dropped == 1
    with pytest.raises(ListingGone, match=f"more than {MAX_LISTINGS} listings"):
        listings.page(first, 1)
    assert listings.page(later[0], 1) == ([0], True)


def test_close_drops_a_listing_and_ignores_an_unknown_one() -> None:
    listings = Listings()
    listing = listings.open([1, 2, 3])
    listings.close(listing)
    listings.close(listing)
    listings.close(12345)
    assert len(listings) == 0


def test_a_page_holds_at_least_one_row() -> None:
    listings = Listings()
    listing = listings.open([1])
    with pytest.raises(ValueError, match="at least one row"):
        listings.page(listing, 0)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HB) as srv:
        yield srv


@pytest.fixture
def client(server: FakeServer) -> Iterator[Clone]:
    for i in range(25):
        server.publish(f"/k/{i:02d}", b"v%d" % i)
    server.publish("/other", b"o")
    with Clone([server.endpoint], heartbeat=HB) as c:
        c.wait_synced(10)
        yield c


def test_iter_entries_gives_what_entries_gives_page_by_page(client: Clone) -> None:
    assert list(client.iter_entries(page=7)) == client.entries()
    assert list(client.iter_entries("/k/", page=1)) == client.entries("/k/")
    assert list(client.iter_entries("/none/")) == []


def test_every_page_comes_from_the_moment_the_listing_was_taken(
    server: FakeServer, client: Clone
) -> None:
    before = client.entries("/k/")
    listing = client.iter_entries("/k/", page=5)
    first = next(listing)  # the listing is taken here
    server.publish("/k/20", b"changed")
    server.publish("/k/99", b"added")
    eventually(lambda: client.get("/k/99") == b"added", what="the updates applied")
    assert [first, *listing] == before
    after = client.entries("/k/")
    assert after[20].value == b"changed" and after[-1].key == "/k/99"


def test_a_listing_dropped_for_newer_ones_is_refused_not_restarted(client: Clone) -> None:
    oldest = client.iter_entries(page=1)
    assert next(oldest).key == "/k/00"
    newer = [client.iter_entries(page=1) for _ in range(MAX_LISTINGS)]
    assert [next(n).key for n in newer] == ["/k/00"] * MAX_LISTINGS
    with pytest.raises(CloneError, match="is not open"):
        next(oldest)
    assert [e.key for e in newer[0]][:2] == ["/k/01", "/k/02"]


def test_a_reader_that_stops_early_gives_its_listing_back(client: Clone) -> None:
    """Closed early, each listing is dropped at once: five in a row never push
    out the sixth's predecessors."""
    kept = client.iter_entries(page=2)
    assert next(kept).key == "/k/00"
    for _ in range(MAX_LISTINGS + 1):
        early = client.iter_entries(page=2)
        assert next(early).key == "/k/00"
        early.close()
    assert [e.key for e in kept][-1] == "/other"


def test_a_bad_page_size_is_refused_before_anything_is_asked(client: Clone) -> None:
    with pytest.raises(ValueError, match="page must be 1 to 1000000"):
        client.iter_entries(page=0)
    with pytest.raises(TypeError, match="prefix must be str"):
        client.iter_entries(b"/k/")  # type: ignore[arg-type]
