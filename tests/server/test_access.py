"""The ACL's decisions (clone.server.access), as plain functions: who may
write a key, and why a call is refused, from a name and the rights held."""

from __future__ import annotations

import pytest

from clone.security import NOTHING, PEER_USER, Rights
from clone.server.access import NOT_ADMITTED, call_refusal, may_write
from clone.wire.calls import OP_LEASE_KEEPALIVE, OP_SET, encode_call
from clone.wire.codec import new_uuid

_RIGHTS = {
    "worker": Rights(read=(b"",), write=(b"/jobs/",)),
    "reader": Rights(read=(b"",), write=()),
    "admin": Rights(read=(b"",), write=(b"",)),
}


def _rights_of(name: str | None) -> Rights:
    return _RIGHTS.get(name or "", NOTHING)


_EVERYONE = frozenset({*_RIGHTS, PEER_USER})


def _may(user: str | None, frames: list[bytes], admitted: frozenset[str] = _EVERYONE) -> bool:
    write_all = {n for n in admitted if n == PEER_USER or b"" in _rights_of(n).write}
    return may_write(user, frames, write_all=write_all, admitted=admitted, rights_of=_rights_of)


def _why(user: str | None, frames: list[bytes], admitted: frozenset[str] = _EVERYONE) -> str | None:
    write_all = {n for n in admitted if n == PEER_USER or b"" in _rights_of(n).write}
    return call_refusal(frames, user, write_all=write_all, admitted=admitted, rights_of=_rights_of)


def _kvset(key: bytes) -> list[bytes]:
    return [key, (0).to_bytes(8, "big"), new_uuid(), b"", b"v"]


@pytest.mark.parametrize(
    ("user", "key", "allowed"),
    [
        ("worker", b"/jobs/1", True),
        ("worker", b"/other", False),
        ("reader", b"/jobs/1", False),
        ("admin", b"/anything", True),
        (PEER_USER, b"/anything", True),
        (None, b"/jobs/1", False),  # no User-Id: not a known connection
        ("stranger", b"/jobs/1", False),
    ],
)
def test_may_write(user: str | None, key: bytes, allowed: bool) -> None:
    assert _may(user, _kvset(key)) is allowed


def test_a_removed_name_may_not_write_even_under_its_prefixes() -> None:
    assert _may("worker", _kvset(b"/jobs/1"), admitted=frozenset({PEER_USER})) is False


def test_an_empty_kvset_is_no_write() -> None:
    assert _may("worker", []) is False


def test_call_refusal_by_name() -> None:
    frames = encode_call(OP_SET, new_uuid(), "/jobs/a", (), b"v")
    assert _why(frames=frames, user=PEER_USER) is None
    assert _why(frames=frames, user="admin") is None
    assert _why(frames=frames, user="worker") is None
    assert _why(frames=frames, user=None) == NOT_ADMITTED
    assert _why(frames=frames, user="worker", admitted=frozenset({PEER_USER})) == NOT_ADMITTED


def test_call_refusal_by_key() -> None:
    outside = encode_call(OP_SET, new_uuid(), "/etc/a", (), b"v")
    why = _why("worker", outside)
    assert why is not None and "/etc/a" in why
    assert _why("reader", outside) is not None


def test_a_call_that_does_not_decode_is_refused_for_a_restricted_writer() -> None:
    """Fail closed: it may be an operation newer than the relay, whose keys
    the relay cannot judge and the pair would judge by the relay's rights."""
    why = _why("worker", [b"CALL?", b"short"])
    assert why is not None and "cannot read" in why
    unknown = encode_call(OP_SET, new_uuid(), "/jobs/a", (), b"v")
    unknown[1] = b"set-everything"  # an operation this relay does not know
    assert _why("worker", unknown) is not None
    # Full writers and the peer lose nothing by it: the active judges theirs.
    assert _why("admin", [b"CALL?", b"short"]) is None
    assert _why(PEER_USER, [b"CALL?", b"short"]) is None


def test_a_decoded_but_malformed_call_is_let_through_for_the_active_to_judge() -> None:
    frames = encode_call(OP_LEASE_KEEPALIVE, new_uuid(), "", (), b"")  # names no lease
    assert _why("worker", frames) is None
