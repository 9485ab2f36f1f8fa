"""The names CALL? and REPLY share: the frames' tags, the operations, the
properties, the reasons for a refusal, the limits, and what a lease id, a
secret, a principal and a lease's ttl look like.

Split out of :mod:`clone.wire.calls` (the calls) so that
:mod:`clone.wire.replies` (the replies) can use them too; both re-export
what they need, and :mod:`clone.wire.calls` re-exports all of it, so code
keeps importing from there.  Pure.
"""

from __future__ import annotations

import re
from typing import Final

from clone.wire.protocol import MAX_TTL_SECONDS, MAX_VALUE_BYTES

__all__ = [
    "CALL",
    "REPLY",
    "OPS",
    "OP_SET",
    "OP_SET_MANY",
    "MAX_SET_MANY_BYTES",
    "MAX_SET_MANY_ENTRIES",
    "OP_LEASE_GRANT",
    "OP_LEASE_KEEPALIVE",
    "OP_LEASE_KEEPALIVES",
    "MAX_KEEPALIVES_PER_CALL",
    "OP_LEASE_REVOKE",
    "OP_AHEAD",
    "OP_CONFLICT_APPLY",
    "OP_CONFLICT_DISCARD",
    "CONFLICT_OPS",
    "CONFLICT_PROPERTY",
    "LEASE_PROPERTY",
    "IF_SEQUENCE_PROPERTY",
    "LEASE_PREFIX",
    "SECRET_PROPERTY",
    "CALLER_PROPERTY",
    "MIN_LEASE_TTL",
    "REASONS",
    "lease_id_of",
    "lease_key",
    "parse_lease_ttl",
    "valid_lease_id",
    "valid_principal",
    "valid_secret",
]

CALL: Final = b"CALL?"
REPLY: Final = b"REPLY"

OP_SET: Final = "set"
#: Our extension of the calls: many ``set``s in one call and one
#: reply, for a bulk load whose rows each cost a call's receive and reply
#: (docs/protocol.md, "Batched sets").  Each entry carries its own uuid and is
#: judged and applied as its own ``set`` would be.
OP_SET_MANY: Final = "set-many"
#: The most bytes a ``set-many`` body may hold: the value limit, so that a
#: batch fits every frame cap a ``set`` fits (the server's MAXMSGSIZE).
MAX_SET_MANY_BYTES: Final = MAX_VALUE_BYTES
#: The most entries one ``set-many`` may carry: a batch is applied within one
#: loop turn, and 1,024 sets are a few tens of milliseconds of it.
MAX_SET_MANY_ENTRIES: Final = 1024
OP_LEASE_GRANT: Final = "lease-grant"
OP_LEASE_KEEPALIVE: Final = "lease-keepalive"
OP_LEASE_REVOKE: Final = "lease-revoke"
#: Our extension of the lease calls (10,000 leases at fleet scale): many leases kept alive by one
#: call, its body a line ``<id>[ <secret>]`` per lease; its reply lists the
#: leases not kept in a fifth frame (docs/protocol.md, "Batched keepalives").
OP_LEASE_KEEPALIVES: Final = "lease-keepalives"
#: The most leases one ``lease-keepalives`` call may name (about 650 KB of body).
MAX_KEEPALIVES_PER_CALL: Final = 10_000
#: How many lease-bound keys under a key's parent have a lower sequence: what
#: a lock contender that may write but not read its lock's prefix asks.
OP_AHEAD: Final = "ahead"
#: An operator's word on a split-brain conflict (clone.server.conflicts).
OP_CONFLICT_APPLY: Final = "conflict-apply"
OP_CONFLICT_DISCARD: Final = "conflict-discard"
CONFLICT_OPS: Final = frozenset({OP_CONFLICT_APPLY, OP_CONFLICT_DISCARD})
OPS: Final = frozenset(
    {OP_SET, OP_SET_MANY, OP_LEASE_GRANT, OP_LEASE_KEEPALIVE, OP_LEASE_KEEPALIVES,
     OP_LEASE_REVOKE, OP_AHEAD, *CONFLICT_OPS}
)
#: A conflict call's property: the conflict's id.
CONFLICT_PROPERTY: Final = "conflict"

#: A key's property naming the lease it is bound to (kept on the stored entry,
#: so every reader sees it), and a call's property naming a lease.
LEASE_PROPERTY: Final = "lease"
#: A ``set`` call's condition; never stored.
IF_SEQUENCE_PROPERTY: Final = "if_sequence"
#: A lease's proof of ownership without CURVE (never stored in clear: the
#: lease key holds its SHA-256), sent with every call on the lease.
SECRET_PROPERTY: Final = "secret"
#: Who asked a relay for a call, as the relay asserts it to the pair: only a
#: relay whose certificate the pair trusts (``--trusted-relay``) may send it.
CALLER_PROPERTY: Final = "caller"
#: Where a server keeps its leases: one key per lease, ``<prefix><id>``, whose
#: value says its ttl.  Replicated, durable and snapshotted like any key;
#: clients may read it but never write under it.
LEASE_PREFIX: Final = "/_clone/lease/"

#: Why a server refuses a call (``reason=``).
REASONS: Final = frozenset(
    {
        "not-active",  # a passive, starting or relay-without-upstream server
        "acl",  # the caller may not write that key (CURVE + ACL)
        "full",  # --max-keys / --max-bytes
        "size",  # a key, value or properties over a limit
        "malformed",  # the call does not decode
        "bad-if-sequence",  # if_sequence is not a whole number >= 0
        "bad-lease",  # a lease id that is not 32 hex digits
        "bad-ttl",  # a lease ttl that is not a number in range
        "unknown-lease",  # no such lease (never granted, expired or revoked)
        "reserved",  # a key under LEASE_PREFIX
        "busy",  # the server has too many leases (--max-leases)
        "not-owner",  # the lease is another client's (or predates ownership)
        "lease-quota",  # this client holds --max-leases-per-client leases
        "bad-secret",  # a secret that is not 32 hex digits
        "unknown-conflict",  # no such unresolved conflict for that key
    }
)

_LEASE_ID_RE = re.compile(r"[0-9a-f]{32}")
_SECRET_RE = re.compile(r"[0-9a-f]{32}")
#: A principal: ``name:<certificate name>`` or ``addr:<peer address>``.
_PRINCIPAL_RE = re.compile(r"(name|addr):[^\n=]{1,200}")
#: A sequence or a count on the wire, and the largest sequence.
UINT_RE: Final = re.compile(r"[0-9]{1,20}")
SEQ_MAX: Final = 2**64 - 1
#: A lease lives at least this long: a keepalive every third of it must be
#: possible over a real network, and a shorter one is a unit mistake (ms for s).
MIN_LEASE_TTL: Final = 0.3


def lease_key(lease_id: str) -> str:
    """The key that holds lease ``lease_id`` on the servers."""
    return LEASE_PREFIX + lease_id


def lease_id_of(uuid: bytes) -> str:
    """The id of the lease a ``lease-grant`` call with ``uuid`` creates."""
    return uuid.hex()


def valid_lease_id(text: str) -> bool:
    return _LEASE_ID_RE.fullmatch(text) is not None


def valid_secret(text: str) -> bool:
    return _SECRET_RE.fullmatch(text) is not None


def valid_principal(text: str) -> bool:
    """A relay's ``caller=``: ``name:<certificate name>`` or ``addr:<address>``."""
    return _PRINCIPAL_RE.fullmatch(text) is not None


def parse_lease_ttl(text: str | None) -> float:
    """A lease's ttl in seconds; ValueError saying why not."""
    if text is None:
        raise ValueError("a lease needs ttl=<seconds>")
    try:
        ttl = float(text)
    except ValueError:
        raise ValueError(f"lease ttl {text[:40]!r} is not a number") from None
    if not MIN_LEASE_TTL <= ttl <= MAX_TTL_SECONDS:  # also false for nan
        raise ValueError(
            f"lease ttl {text[:40]!r} is out of range ({MIN_LEASE_TTL:g} to {MAX_TTL_SECONDS:g} s)"
        )
    return ttl
