"""CONFLICTS? and CONFLICTS, our extension of CHP: a server's split-brain conflicts.

How this works: like STATUS? (:mod:`clone.wire.status`), any admitted peer may
send ``[b"CONFLICTS?", which]`` to the snapshot port (ROUTER, P), ``which``
being ``b"unresolved"`` or ``b"all"``; the server answers at once, whatever
its role, with::

    [b"CONFLICTS", json]

``json`` is one JSON object, UTF-8, at most :data:`MAX_CONFLICTS_BYTES`:
``{"conflicts": [...], "total": n, "unresolved": n, "truncated": bool}``, each
conflict as :meth:`clone.server.conflicts.ConflictRecord.as_json` makes it,
its values cut to :data:`VALUE_CHARS` characters (``truncated`` says when the
list itself was cut: the oldest are listed first).  Resolving one is a call
(:mod:`clone.wire.calls`, ``conflict-apply`` and ``conflict-discard``), so
that the ACL judges it by the conflict's key.

Total decoders, as everywhere in :mod:`clone.wire`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from clone.errors import ProtocolError

__all__ = [
    "CONFLICTS_REPLY",
    "CONFLICTS_REQUEST",
    "MAX_CONFLICTS_BYTES",
    "VALUE_CHARS",
    "decode_conflicts",
    "decode_conflicts_request",
    "encode_conflicts",
    "encode_conflicts_request",
    "is_conflicts_request",
]

CONFLICTS_REQUEST: Final = b"CONFLICTS?"
CONFLICTS_REPLY: Final = b"CONFLICTS"
#: The largest listing: a client's receive cap, and where the server stops adding.
MAX_CONFLICTS_BYTES: Final = 1024 * 1024
#: How much of each value a listing shows (characters).
VALUE_CHARS: Final = 1000
_WHICH = (b"unresolved", b"all")


def encode_conflicts_request(*, everything: bool = False) -> list[bytes]:
    return [CONFLICTS_REQUEST, b"all" if everything else b"unresolved"]


def is_conflicts_request(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` (without the ROUTER identity) are meant as CONFLICTS?."""
    return len(frames) > 0 and frames[0] == CONFLICTS_REQUEST


def decode_conflicts_request(frames: Sequence[bytes]) -> bool:
    """Whether the request asks for every conflict (else the unresolved ones)."""
    if len(frames) != 2 or frames[0] != CONFLICTS_REQUEST or frames[1] not in _WHICH:
        raise ProtocolError("CONFLICTS? is [CONFLICTS?, unresolved|all]")
    return frames[1] == b"all"


def encode_conflicts(
    records: Sequence[Mapping[str, Any]], *, total: int, unresolved: int
) -> list[bytes]:
    """A CONFLICTS reply of as many of ``records`` (JSON objects, oldest first)
    as fit, their values cut to :data:`VALUE_CHARS`."""
    items: list[bytes] = []
    size = 200
    truncated = False
    for rec in records:
        item = json.dumps(_cut(rec), separators=(",", ":"), sort_keys=True).encode()
        if size + len(item) + 1 > MAX_CONFLICTS_BYTES:
            truncated = True
            break
        items.append(item)
        size += len(item) + 1
    head = json.dumps({"total": total, "unresolved": unresolved, "truncated": truncated})
    body = head[:-1].encode() + b',"conflicts":[' + b",".join(items) + b"]}"
    return [CONFLICTS_REPLY, body]


def _cut(rec: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(rec)
    for side in ("loser", "winner"):
        part = dict(out.get(side) or {})
        value = part.get("value")
        if isinstance(value, str) and len(value) > VALUE_CHARS:
            part["value"] = value[:VALUE_CHARS]
            part["value_cut"] = True
        out[side] = part
    return out


def decode_conflicts(frames: Sequence[bytes]) -> dict[str, Any]:
    """The listing of a CONFLICTS reply, or ProtocolError saying what was wrong."""
    if len(frames) != 2:
        raise ProtocolError(f"CONFLICTS has {len(frames)} frames, expected 2")
    if frames[0] != CONFLICTS_REPLY:
        raise ProtocolError(f"expected CONFLICTS, got {bytes(frames[0][:16])!r}")
    body = frames[1]
    if len(body) > MAX_CONFLICTS_BYTES:
        raise ProtocolError(f"CONFLICTS body of {len(body)} bytes exceeds {MAX_CONFLICTS_BYTES}")
    try:
        value = json.loads(bytes(body).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"CONFLICTS body is not UTF-8 JSON: {exc}") from None
    if not isinstance(value, dict) or not isinstance(value.get("conflicts"), list):
        raise ProtocolError("CONFLICTS body is not an object with a conflicts list")
    if not all(isinstance(c, dict) for c in value["conflicts"]):
        raise ProtocolError("CONFLICTS lists something that is not an object")
    return value
