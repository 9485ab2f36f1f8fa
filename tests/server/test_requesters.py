"""Which snapshot requests a new one replaces (clone.server.requesters), as a table."""

from __future__ import annotations

import pytest

from clone.server.requesters import Requester, from_options, replaced

A, B = "0123456789abcdef", "fedcba9876543210"


@pytest.mark.parametrize(
    ("new", "older", "moot"),
    [
        (Requester(b"s1"), Requester(b"s1"), True),  # the same socket asked again
        (Requester(b"s2"), Requester(b"s1"), False),  # two sockets, no names: two clients
        (Requester(b"s2", A), Requester(b"s1", A), True),  # one client, a fresh socket
        (Requester(b"s2", A), Requester(b"s1", B), False),  # two clients
        (Requester(b"s2", A), Requester(b"s1"), False),  # a Guide client's request stays
        (Requester(b"s2"), Requester(b"s1", A), False),
        (Requester(b"s2", A, "alice"), Requester(b"s1", A, "alice"), True),
        # Under CURVE a name is another user's only by accident or on purpose:
        # it cancels nothing of theirs.
        (Requester(b"s2", A, "mallory"), Requester(b"s1", A, "alice"), False),
        (Requester(b"s2", A, None), Requester(b"s1", A, "alice"), False),
    ],
)
def test_a_request_replaces_its_requesters_older_ones(
    new: Requester, older: Requester, moot: bool
) -> None:
    assert new.replaces(older) is moot


def test_replaced_keeps_order_and_reads_kept_options() -> None:
    held = [
        (b"s1", from_options(b"s1", {"requester": A, "batch": True})),
        (b"s2", from_options(b"s2", {"requester": B})),
        (b"s3", from_options(b"s3", {"requester": A, "user": None})),
    ]
    assert replaced(held, Requester(b"s4", A)) == [b"s1", b"s3"]
    assert replaced(dict(held), Requester(b"s2")) == [b"s2"]
    assert replaced({}, Requester(b"s1", A)) == []
