"""Which snapshot requests a new one replaces (clone.server.requesters), as a table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.server.requesters import Requester, from_options, replaced
from clone.wire.protocol import REQUESTER_ID_CHARS, REQUESTER_PROPERTY
from clone.wire.requester import new_requester_id, parse_requester, requester_metadata

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


def test_requester_ids_round_trip_and_bad_ones_are_refused() -> None:
    rid = new_requester_id()
    assert len(rid) == REQUESTER_ID_CHARS and parse_requester(rid) == rid
    assert rid != new_requester_id()
    assert requester_metadata(rid) == f"{REQUESTER_PROPERTY}:{rid}".encode()
    for bad in ("", "0123", A.upper(), A + "0", "0123456789abcdeg", " " * 16):
        with pytest.raises(ProtocolError):
            parse_requester(bad)


@given(st.text(max_size=40))
def test_parse_requester_is_total(value: str) -> None:
    try:
        assert parse_requester(value) == value
    except ProtocolError:
        pass
