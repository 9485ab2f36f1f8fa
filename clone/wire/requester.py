"""``X-CHP-Requester``: a client names itself on each snapshot request (pure).

Why: our clients ask for a snapshot again on a fresh DEALER when one is slow
to start, so the server's ROUTER sees a new routing id each time and cannot
tell a second request of one client from a request of another.  On a server
just promoted under load every re-ask took another slot (64 full of streams
whose requesters had moved on, 10 snapshots served of 703 asked).  With this
ZMTP metadata on its DEALER -- the same random id on every socket of one
client agent -- a new request replaces that client's own older one
(docs/protocol.md, *Requester*).  Guide clients do not send it and are
served as before, one routing id at a time.
"""

from __future__ import annotations

import os

from clone.errors import ProtocolError
from clone.wire.protocol import REQUESTER_ID_CHARS, REQUESTER_PROPERTY

__all__ = ["new_requester_id", "parse_requester", "requester_metadata"]

_HEX = frozenset("0123456789abcdef")


def new_requester_id() -> str:
    """A fresh random requester id (one per client agent)."""
    return os.urandom(REQUESTER_ID_CHARS // 2).hex()


def requester_metadata(requester: str) -> bytes:
    """The ZMTP metadata property for a DEALER's ``setsockopt(zmq.METADATA, ...)``."""
    parse_requester(requester)
    return f"{REQUESTER_PROPERTY}:{requester}".encode()


def parse_requester(value: str) -> str:
    """A requester id from its metadata value; ProtocolError unless exactly
    :data:`REQUESTER_ID_CHARS` lowercase hex characters."""
    if len(value) != REQUESTER_ID_CHARS or not set(value) <= _HEX:
        raise ProtocolError(
            f"{REQUESTER_PROPERTY} {value[:40]!r} is not "
            f"{REQUESTER_ID_CHARS} lowercase hex characters"
        )
    return value
