"""Which snapshot requests a new one replaces (clone.server.requesters), as a table."""

from __future__ import annotations

import pytest

from clone.server.requesters import (
    Requester,
    from_options,
    replaced,
    replaced_waiting,
    stale,
    stale_waiting,
)

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


def test_a_client_with_several_subtrees_asks_for_each_at_once() -> None:
    """One socket, one request per subtree at the same time: the second is
    not a re-ask of the first (a clean-clone run's ['/b/', '/c/'] client lost
    its '/b/' stream to its '/c/' request and never synced)."""
    b = Requester(b"\x00s1", "c1", None, "/b/")
    c = Requester(b"\x00s1", "c1", None, "/c/")
    assert not c.replaces(b) and not b.replaces(c)
    assert Requester(b"\x00s2", "c1", None, "/b/").replaces(b)  # '/b/' asked again
    assert Requester(b"\x00s1").replaces(b)  # the subtree not known: the socket decides
    assert replaced({1: b, 2: c}, Requester(b"\x00s3", "c1", None, "/c/")) == [2]
    assert from_options(b"\x00s1", {"requester": "c1"}, "/b/") == b
    assert from_options(b"\x00s1", {"requester": "c1", "subtree": "/c/"}, "/b/") == c


def test_waiting_requests_replaced_by_name_or_by_socket_alone() -> None:
    """The same answers as :func:`replaced` over the waiting requests' kept
    options; a request that names no requester looks up its own socket's."""
    waiting = {
        b"s1": (1.0, {"requester": A, "subtree": ""}),
        b"s2": (2.0, {"subtree": ""}),
        b"s3": (3.0, {"requester": A, "subtree": ""}),
        b"s4": (4.0, {"subtree": "/b/"}),
    }
    assert replaced_waiting(waiting, Requester(b"s9", A, None, "")) == [b"s1", b"s3"]
    assert replaced_waiting(waiting, Requester(b"s2", None, None, "")) == [b"s2"]
    assert replaced_waiting(waiting, Requester(b"s1", None, None, "")) == [b"s1"]
    assert replaced_waiting(waiting, Requester(b"s4", None, None, "/c/")) == []  # another subtree
    assert replaced_waiting(waiting, Requester(b"s9", None, None, "")) == []
    assert replaced_waiting({}, Requester(b"s1", A)) == []
    for new in (Requester(b"s9", A, None, ""), Requester(b"s2"), Requester(b"s4", B, None, "/b/")):
        kept = [(i, from_options(i, how)) for i, (_, how) in waiting.items()]
        assert replaced_waiting(waiting, new) == replaced(kept, new)


def _generated(n: int) -> bytes:
    """A routing id as libzmq's ROUTER makes one up for its n-th connection."""
    return b"\x00" + n.to_bytes(4, "big")


def test_a_late_copy_of_an_earlier_reask_replaces_nothing_and_is_stale() -> None:
    """A loaded server read a client's ninth re-ask after its tenth: the ninth
    (its socket closed) replaced the tenth's stream, and the client waited
    for good.  The generated routing ids count connections in order."""
    ninth = Requester(_generated(0x6B8B4574), A, None, "")
    tenth = Requester(_generated(0x6B8B4575), A, None, "")
    assert tenth.replaces(ninth) and not ninth.replaces(tenth)
    assert stale([tenth], ninth) and not stale([ninth], tenth)
    assert not stale([ninth], ninth)  # its own socket asking again is no copy
    assert not stale([Requester(_generated(9), B, None, "")], Requester(_generated(1), A))
    other_subtree = Requester(_generated(9), A, None, "/b/")
    assert not stale([other_subtree], Requester(_generated(1), A, None, ""))
    under_curve = Requester(_generated(9), A, "alice", "")
    assert not stale([under_curve], Requester(_generated(1), A, "mallory", ""))
    assert stale([under_curve], Requester(_generated(1), A, "alice", ""))
    assert not stale([tenth], Requester(_generated(1)))  # a Guide client: by socket, as before
    # Ids a peer chose say no order: a fresh socket's request replaces, as before.
    assert Requester(b"s1", A).replaces(Requester(b"s2", A))
    assert not stale([Requester(b"s2", A)], Requester(b"s1", A))
    waiting = {_generated(5): (1.0, {"requester": A, "subtree": ""})}
    assert stale_waiting(waiting, Requester(_generated(4), A, None, ""))
    assert not stale_waiting(waiting, Requester(_generated(6), A, None, ""))
    assert not stale_waiting(waiting, Requester(_generated(4), None, None, ""))
