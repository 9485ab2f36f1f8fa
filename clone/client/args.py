"""The frontend's argument checks, and how it builds an application's write.

Pure functions: a bad key, value, ttl or sequence is the caller's mistake and
raises ``ValueError``/``TypeError`` here, before anything reaches the agent;
a JSON value that is not JSON raises :class:`~clone.errors.NotJSON`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from clone.client.leases import Lease
from clone.errors import LimitExceeded, NotJSON, ProtocolError
from clone.wire.calls import LEASE_PROPERTY, MIN_LEASE_TTL, SECRET_PROPERTY
from clone.wire.codec import KVMsg, Properties, new_uuid, validate_subtree
from clone.wire.protocol import MAX_TTL_SECONDS

__all__ = [
    "as_bytes",
    "build",
    "check_if_sequence",
    "format_lease_ttl",
    "format_ttl",
    "from_json",
    "history_subtree",
    "lease_props",
    "normalize_subtrees",
    "to_json",
]

SEQ_LIMIT = 2**64


def to_json(value: Any) -> bytes:
    """``value`` as a compact UTF-8 JSON document; NotJSON if it is not one."""
    try:
        return json.dumps(
            value, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        ).encode()
    except (TypeError, ValueError) as exc:
        raise NotJSON(f"value is not JSON-serialisable: {exc}") from None


def from_json(key: str, body: bytes) -> Any:
    """The JSON document ``key`` holds; NotJSON if it holds something else."""
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError) as exc:
        raise NotJSON(f"the value of {key!r} is not a JSON document: {exc}") from None


def as_bytes(value: bytes | bytearray | memoryview | str) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"value must be bytes or str, not {type(value).__name__}")


def format_ttl(ttl: float) -> str | None:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if ttl == 0:
        return None
    if not 0.001 <= ttl <= MAX_TTL_SECONDS:
        raise ValueError(f"ttl must be 0 (no expiry) or 0.001 .. {MAX_TTL_SECONDS:g} s")
    return f"{ttl:.3f}".rstrip("0").rstrip(".")


def build(key: str, body: bytes, props: dict[str, str]) -> KVMsg:
    """Validate an application write; a bad key is misuse (ValueError), not wire trouble."""
    try:
        return KVMsg.build(key, body, uuid=new_uuid(), properties=props)
    except LimitExceeded:
        raise
    except ProtocolError as exc:
        raise ValueError(str(exc)) from None


def format_lease_ttl(ttl: float) -> str:
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise TypeError(f"ttl must be a number of seconds, not {type(ttl).__name__}")
    if not MIN_LEASE_TTL <= ttl <= MAX_TTL_SECONDS:  # also false for nan
        raise ValueError(
            f"a lease's ttl must be {MIN_LEASE_TTL:g} .. {MAX_TTL_SECONDS:g} s, not {ttl!r}"
        )
    return repr(float(ttl))


def lease_props(lease: Lease) -> Properties:
    """A keepalive's or revoke's properties: the lease and its secret, if any."""
    if lease._secret:
        return ((LEASE_PROPERTY, lease.id), (SECRET_PROPERTY, lease._secret))
    return ((LEASE_PROPERTY, lease.id),)


def check_if_sequence(if_sequence: int | None) -> int | None:
    if if_sequence is None:
        return None
    if isinstance(if_sequence, bool) or not isinstance(if_sequence, int):
        raise TypeError(
            f"if_sequence must be an int sequence (0: only if absent), "
            f"not {type(if_sequence).__name__}"
        )
    if not 0 <= if_sequence < SEQ_LIMIT:
        raise ValueError(
            f"if_sequence must be a sequence in 0..2**64-1 (0: only if absent), not {if_sequence}"
        )
    return if_sequence


def history_subtree(prefix: str, subtrees: Sequence[str]) -> str:
    """The subtree to ask the server's history for: ``prefix`` when it is one
    (the delta then holds only its keys), else our only subtree, else all."""
    try:
        validate_subtree(prefix.encode("utf-8"))
    except ProtocolError:
        return subtrees[0] if len(subtrees) == 1 else ""
    return prefix


def normalize_subtrees(subtrees: str | Iterable[str] | None) -> tuple[str, ...]:
    """Validated, sorted subtrees with none inside another.

    A key must belong to exactly one subtree, so that it has one snapshot sequence
    to compare updates with; ``/a/`` already covers ``/a/b/``, and ``''`` covers
    everything.
    """
    if subtrees is None:
        return ("",)
    items = [subtrees] if isinstance(subtrees, str) else list(subtrees)
    if not items:
        return ("",)
    for item in items:
        if not isinstance(item, str):
            raise TypeError(f"subtree must be str, not {type(item).__name__}")
        validate_subtree(item.encode("utf-8"))
    kept: list[str] = []
    for item in sorted(set(items), key=len):
        if not any(item.startswith(k) for k in kept):
            kept.append(item)
    return tuple(sorted(kept))
