"""STATUS? and STATUS, our extension of CHP: a server's status on request.

How this works: any peer may send a one-frame ``[b"STATUS?"]`` to the snapshot
port (ROUTER, P); the server answers at once, active or passive, with::

    [b"STATUS", json]

``json`` is one JSON object, UTF-8, at most ``MAX_STATUS_BYTES``; its fields
are listed in :mod:`clone.server.status` (docs/protocol.md, "STATUS?").  It is
not a snapshot request and never a Binary Star vote.  A server may drop a
request (rate limit, or the requester went away); the requester then times out.

Like :mod:`clone.wire.codec`, the decoders are total: they return a value or
raise :class:`~clone.errors.ProtocolError`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from clone.errors import ProtocolError
from clone.wire.protocol import MAX_STATUS_BYTES, STATUS_REPLY, STATUS_REQUEST

__all__ = [
    "decode_status",
    "encode_status",
    "encode_status_request",
    "is_status_request",
]


def encode_status_request() -> list[bytes]:
    """The request's frames (a DEALER sends them; the ROUTER adds the identity)."""
    return [STATUS_REQUEST]


def is_status_request(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` (without the ROUTER identity) are a STATUS? request."""
    return len(frames) == 1 and frames[0] == STATUS_REQUEST


def encode_status(status: Mapping[str, Any]) -> list[bytes]:
    """A STATUS reply.  Raises ValueError if ``status`` does not fit or is not JSON."""
    body = json.dumps(status, separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    if len(body) > MAX_STATUS_BYTES:
        raise ValueError(f"status of {len(body)} bytes exceeds {MAX_STATUS_BYTES}")
    return [STATUS_REPLY, body]


def decode_status(frames: Sequence[bytes]) -> dict[str, Any]:
    """The status object of a STATUS reply, or ProtocolError saying what was wrong."""
    if len(frames) != 2:
        raise ProtocolError(f"STATUS has {len(frames)} frames, expected 2")
    if frames[0] != STATUS_REPLY:
        raise ProtocolError(f"expected STATUS, got {bytes(frames[0][:16])!r}")
    body = frames[1]
    if len(body) > MAX_STATUS_BYTES:
        raise ProtocolError(f"STATUS body of {len(body)} bytes exceeds {MAX_STATUS_BYTES}")
    try:
        value = json.loads(bytes(body).decode("utf-8"), parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(f"STATUS body is not UTF-8 JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"STATUS body is a JSON {type(value).__name__}, not an object")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
