"""Listings read page by page: the agent's side of ``Clone.iter_entries`` (pure).

``Clone.entries()`` asks the agent for every row in one reply: at 10M keys the
sorted rows, their marshal dump, the frontend's unpacked copy and its
``Entry`` list cost about 12 GB on top of the replica, and ``clone dump`` was
killed for memory on a 23 GB machine running a pair.  A listing opened here
holds only the sorted list of references to the replica's rows (the rows are
immutable tuples that an update replaces, never changes in place), so every
page comes from the same moment: a consistent listing, as ``entries()``
gives, for about 60 bytes a key.  The frontend asks for one page at a time and
writes it out before asking for the next.

Open listings are bounded: at most :data:`MAX_LISTINGS` per client.  Opening
one more drops the oldest; its next page is refused with a message that says
so, never silently restarted.  A listing read to its end is dropped at once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

__all__ = ["MAX_LISTINGS", "ListingGone", "Listings"]

#: Listings one client holds open at once (each holds a list of references to
#: every row it lists): a frontend that opens them and walks away costs at most
#: this many lists.
MAX_LISTINGS = 4


class ListingGone(ValueError):
    """The listing asked for is not open: read to its end, closed, or dropped
    for a newer one (the agent answers ERROR with this text)."""


class Listings:
    """The open listings of one agent, by id, oldest first."""

    def __init__(self, limit: int = MAX_LISTINGS) -> None:
        if limit < 1:
            raise ValueError("at least one listing must be allowed")
        self._limit = limit
        self._open: OrderedDict[int, tuple[list[Any], int]] = OrderedDict()
        self._next_id = 1
        #: Listings dropped for newer ones before their end.
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._open)

    def open(self, rows: list[Any]) -> int:
        """Hold ``rows`` (already sorted) as a new listing; its id."""
        while len(self._open) >= self._limit:
            self._open.popitem(last=False)
            self.dropped += 1
        listing = self._next_id
        self._next_id += 1
        self._open[listing] = (rows, 0)
        return listing

    def page(self, listing: int, limit: int) -> tuple[list[Any], bool]:
        """The next ``limit`` rows of ``listing`` and whether more follow; a
        listing read to its end is dropped."""
        if limit < 1:
            raise ValueError(f"a page holds at least one row, not {limit}")
        held = self._open.get(listing)
        if held is None:
            raise ListingGone(
                f"listing {listing} is not open: read to its end, closed, or dropped "
                f"because more than {self._limit} listings were opened meanwhile"
            )
        rows, at = held
        page = rows[at : at + limit]
        at += len(page)
        if at >= len(rows):
            del self._open[listing]
            return page, False
        self._open[listing] = (rows, at)
        return page, True

    def close(self, listing: int) -> None:
        """Drop ``listing`` (a reader that stopped early); unknown ids are ignored."""
        self._open.pop(listing, None)
