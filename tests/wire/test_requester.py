"""X-CHP-Requester: a client's id on its snapshot requests (clone.wire.requester)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from clone.errors import ProtocolError
from clone.wire.protocol import REQUESTER_ID_CHARS, REQUESTER_PROPERTY
from clone.wire.requester import new_requester_id, parse_requester, requester_metadata

A = "0123456789abcdef"


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
