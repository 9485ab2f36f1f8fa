"""CALL? and REPLY, our extension of CHP: writes and lease operations with an answer.

How this works: CHP's writes are fire-and-forget (a KVSET to the collector), so
a server cannot tell a writer "no".  Compare-and-set and leases need that, so a
client may instead send a *call* on a DEALER to the snapshot port (ROUTER, P)
and get exactly one *reply* from an active server (docs/protocol.md, "CALL?")::

    CALL?   [b"CALL?", op, uuid, key, properties, body]        6 frames
    REPLY   [b"REPLY", uuid, sequence, properties]             4 frames

* ``op``: ``set`` (a write; an empty body deletes), ``set-many`` (many
  ``set``s in one call, each with its own uuid: :func:`encode_set_many`),
  ``lease-grant``,
  ``lease-keepalive``, ``lease-revoke``, or an operator's ``conflict-apply``
  and ``conflict-discard`` (``conflict=<id>``, the conflict's key in ``key``:
  docs/protocol.md, "CONFLICTS?").
* ``uuid``: 16 bytes, the caller's id for the call (a UUIDv7).  The server
  deduplicates ``set`` and ``lease-grant`` by it, as it deduplicates KVSETs, so a
  call retried after a failover is never applied twice; the reply to a retry
  says what the first one did.
* ``key``/``body``: a ``set``'s key and value.  A ``lease-grant`` may name
  the key its lease is for (no body): under an ACL the grant is then refused
  (``acl``) unless the caller may write that key, so that a lock outside the
  caller's prefixes changes nothing.  Empty for the other lease operations.
* ``properties`` of a ``set``: ``ttl`` (as on KVSET), ``lease=<id>`` (bind the
  key to a lease) and ``if_sequence=<n>`` (apply only if the key's sequence is
  ``n``; 0: only if the key is absent).  Of ``lease-grant``: ``ttl=<seconds>``.
  Of ``lease-keepalive`` and ``lease-revoke``: ``lease=<id>``.
* Lease ownership (docs/protocol.md, "Lease ownership"): a ``lease-grant``
  may carry ``secret=<32 hex>`` (the caller's proof of ownership without
  CURVE; the server picks one when it is absent) and its reply carries
  ``secret=`` back; ``lease-keepalive``, ``lease-revoke`` and a ``set`` with
  ``lease=`` carry the same ``secret=``.
* ``ahead`` (a lock's contender that may not read its lock's prefix): ``key``
  is the contender's own key; the reply is ``ok`` with ``ahead=<n>``, the
  number of lease-bound keys under the key's parent (up to its last ``/``)
  with a lower sequence, and the key's sequence, or ``conflict`` with
  ``current=0`` if the key is gone.  It needs write access to the key.  A relay trusted by the pair
  (``--trusted-relay``) adds ``caller=<principal>``: who asked it.
* The reply's ``sequence``: what the server assigned (a ``set``; a grant's or a
  revoke's own update), else 0.  Its properties: ``status=ok|conflict|refused``;
  ``current=<n>`` with a conflict (the key's sequence now, 0 if absent);
  ``reason=<word>`` and ``detail=<text>`` with a refusal (:data:`REASONS`);
  ``lease=<id>`` and ``ttl=<seconds>`` answering a lease operation.

The decoders are total, as in :mod:`clone.wire.codec`.  :func:`decode_call`
checks the call's *shape*; what a well-shaped call asks for (an ``if_sequence``
that is not a number, a lease id of the wrong form, a ttl out of range) is
judged by :func:`check_call`, so that the server can answer it with a specific
reason instead of dropping it.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from clone.errors import LimitExceeded, ProtocolError
from clone.wire.codec import (
    KVMsg,
    Properties,
    decode_properties,
    encode_properties,
    validate_key,
)
from clone.wire.protocol import MAX_TTL_SECONDS, MAX_VALUE_BYTES, TTL_PROPERTY

__all__ = [
    "CALL",
    "REPLY",
    "OPS",
    "OP_SET",
    "OP_SET_MANY",
    "MAX_SET_MANY_BYTES",
    "MAX_SET_MANY_ENTRIES",
    "SET_MANY_ENTRY_OVERHEAD",
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
    "REASONS",
    "Call",
    "Reply",
    "acl_key",
    "acl_refusal",
    "check_call",
    "call_uuid",
    "decode_call",
    "decode_reply",
    "decode_set_many",
    "encode_set_many",
    "encode_call",
    "encode_keepalives",
    "encode_reply",
    "is_call",
    "lease_id_of",
    "parse_keepalives",
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

_AHEAD_PROPERTY = "ahead"
_KEPT_PROPERTY = "kept"
_ENTRIES_PROPERTY = "entries"
#: A set-many reply's line per entry not applied: index, reason, detail.
_FAILURE_RE = re.compile(rb"(?:[0-9]{1,5} [a-z-]{1,40} [^\n]{0,800}\n)*")
_NOT_STORED = frozenset({IF_SEQUENCE_PROPERTY, SECRET_PROPERTY, CALLER_PROPERTY})
_STATUSES = frozenset({"ok", "conflict", "refused"})
_LEASE_ID_RE = re.compile(r"[0-9a-f]{32}")
_SECRET_RE = re.compile(r"[0-9a-f]{32}")
#: A principal: ``name:<certificate name>`` or ``addr:<peer address>``.
_PRINCIPAL_RE = re.compile(r"(name|addr):[^\n=]{1,200}")
_UINT_RE = re.compile(r"[0-9]{1,20}")
#: A ``lease-keepalives`` body, checked in one C-level match: a line per lease.
_KEEPALIVES_RE = re.compile(rb"(?:[0-9a-f]{32}(?: [0-9a-f]{32})?\n)+")
#: A batched keepalive's reply body: a line ``<id> <reason>`` per lease not kept.
_GONE_RE = re.compile(rb"(?:[0-9a-f]{32} [a-z-]{1,40}\n)*")
_SEQ_MAX = 2**64 - 1
#: A lease lives at least this long: a keepalive every third of it must be
#: possible over a real network, and a shorter one is a unit mistake (ms for s).
MIN_LEASE_TTL: Final = 0.3
_DETAIL_MAX = 200


@dataclass(frozen=True, slots=True)
class Call:
    """One CALL? as decoded (its shape checked; see :func:`check_call`)."""

    op: str
    uuid: bytes
    key: str = ""
    properties: Properties = ()
    body: bytes = b""
    #: A ``set-many``'s entries, each a ``set`` Call (decoded from the body).
    entries: tuple[Call, ...] = ()

    def prop(self, name: str) -> str | None:
        for pname, value in self.properties:
            if pname == name:
                return value
        return None

    @property
    def lease(self) -> str | None:
        return self.prop(LEASE_PROPERTY)

    @property
    def secret(self) -> str | None:
        return self.prop(SECRET_PROPERTY)

    @property
    def caller(self) -> str | None:
        return self.prop(CALLER_PROPERTY)

    @property
    def if_sequence(self) -> int | None:
        """The condition of a ``set`` (call :func:`check_call` first), or None."""
        text = self.prop(IF_SEQUENCE_PROPERTY)
        return None if text is None else int(text)

    def stored_properties(self) -> Properties:
        """What a ``set`` stores: its properties without the condition, the
        lease's secret and a relay's caller (never stored, never shown)."""
        return tuple((n, v) for n, v in self.properties if n not in _NOT_STORED)

    def as_kvmsg(self) -> KVMsg:
        """A ``set`` as the KVSET it stands for (uuid, stored properties, body)."""
        return KVMsg(self.key, 0, self.uuid, self.stored_properties(), self.body)


@dataclass(frozen=True, slots=True)
class Reply:
    """One REPLY."""

    uuid: bytes
    status: str
    sequence: int = 0
    reason: str = ""
    detail: str = ""
    current: int | None = None
    lease: str = ""
    ttl: float | None = None
    #: A lease grant's secret (docs/protocol.md, "Lease ownership"), or "".
    secret: str = ""
    #: An ``ahead`` call's answer, else None.
    ahead: int | None = None
    #: A ``lease-keepalives`` reply: how many leases were kept (else None)...
    kept: int | None = None
    #: ... and the (id, reason) of each lease that was not.
    gone: tuple[tuple[str, str], ...] = ()
    #: A ``set-many`` reply: each entry's sequence, in order (0: not applied)...
    sequences: tuple[int, ...] | None = None
    #: ... and (index, reason, detail) of each entry not applied: a refusal's
    #: reason, or ``conflict`` with the key's sequence now as the detail.
    failures: tuple[tuple[int, str, str], ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == "ok"


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


def encode_keepalives(leases: Sequence[tuple[str, str]]) -> bytes:
    """The body of a ``lease-keepalives`` call: (id, secret or "") per lease."""
    return b"".join(
        f"{lease_id} {secret}\n".encode() if secret else f"{lease_id}\n".encode()
        for lease_id, secret in leases
    )


def parse_keepalives(body: bytes) -> list[tuple[str, str | None]]:
    """(id, secret or None) per line of a checked ``lease-keepalives`` body."""
    out: list[tuple[str, str | None]] = []
    for line in body.decode("ascii").split("\n")[:-1]:
        lease_id, _, secret = line.partition(" ")
        out.append((lease_id, secret or None))
    return out


#: A ``set-many`` entry's header after its uuid: key, properties and value
#: lengths (big-endian 16, 16 and 32 bits).
_ENTRY_HEAD = struct.Struct(">HHI")
#: The bytes an entry takes besides its key, properties and value.
SET_MANY_ENTRY_OVERHEAD: Final = 16 + _ENTRY_HEAD.size


def encode_set_many(entries: Sequence[tuple[bytes, bytes, bytes, bytes]]) -> bytes:
    """The body of a ``set-many`` call: (uuid, key, properties, value) per
    entry, each as a ``set`` call's frames 2 to 5 (properties encoded).

    ValueError when it would not be accepted as a whole: no entries, more than
    :data:`MAX_SET_MANY_ENTRIES`, over :data:`MAX_SET_MANY_BYTES`, a uuid that
    is not 16 bytes.  Each entry's content is the server's to judge.
    """
    if not entries:
        raise ValueError("a set-many call needs at least one entry")
    if len(entries) > MAX_SET_MANY_ENTRIES:
        raise ValueError(f"{len(entries)} entries are over the {MAX_SET_MANY_ENTRIES} a"
                         " set-many may carry")
    pack = _ENTRY_HEAD.pack
    parts: list[bytes] = []
    for uuid, key, props, value in entries:
        if len(uuid) != 16:
            raise ValueError(f"a set's uuid is 16 bytes, not {len(uuid)}")
        if len(key) > 0xFFFF or len(props) > 0xFFFF:
            raise ValueError("a set-many entry's key or properties are over 64 KiB")
        parts += (uuid, pack(len(key), len(props), len(value)), key, props, value)
    body = b"".join(parts)
    if len(body) > MAX_SET_MANY_BYTES:
        raise ValueError(f"a set-many body of {len(body)} bytes is over the"
                         f" {MAX_SET_MANY_BYTES}-byte limit")
    return body


def decode_set_many(body: bytes) -> tuple[Call, ...]:
    """A ``set-many`` body's entries as ``set`` Calls, each checked as a
    ``set`` call's frames are by :func:`decode_call` (uuid, key syntax, value
    size, properties), or ProtocolError (LimitExceeded for a size) naming the
    entry: a batch that does not decode is refused whole, nothing applied.

    An entry may not carry ``caller=`` (a relay names the caller of the whole
    call, on the call).
    """
    if not body:
        raise ProtocolError("CALL? set-many takes a body of one entry or more")
    if len(body) > MAX_SET_MANY_BYTES:
        raise LimitExceeded(f"a set-many body of {len(body)} bytes is over the"
                            f" {MAX_SET_MANY_BYTES}-byte limit")
    unpack = _ENTRY_HEAD.unpack_from
    head = _ENTRY_HEAD.size
    end = len(body)
    entries: list[Call] = []
    at = 0
    while at < end:
        index = len(entries)
        if index >= MAX_SET_MANY_ENTRIES:
            raise LimitExceeded(f"a set-many carries over {MAX_SET_MANY_ENTRIES} entries")
        if end - at < SET_MANY_ENTRY_OVERHEAD:
            raise ProtocolError(f"set-many entry {index} is cut short (header)")
        uuid = body[at : at + 16]
        klen, plen, vlen = unpack(body, at + 16)
        at += 16 + head
        if end - at < klen + plen + vlen:
            raise ProtocolError(f"set-many entry {index} is cut short (its lengths say"
                                f" {klen + plen + vlen} bytes, {end - at} are left)")
        try:
            key = validate_key(body[at : at + klen], reserved_ok=False)
            at += klen
            props = decode_properties(body[at : at + plen]) if plen else ()
            at += plen
        except ProtocolError as exc:
            raise type(exc)(f"set-many entry {index}: {exc}") from None
        if any(name == CALLER_PROPERTY for name, _ in props):
            raise ProtocolError(f"set-many entry {index}: caller= belongs on the call")
        entries.append(Call(OP_SET, uuid, key, props, body[at : at + vlen]))
        at += vlen
    return tuple(entries)


def encode_call(
    op: str, uuid: bytes, key: str = "", properties: Properties = (), body: bytes = b""
) -> list[bytes]:
    """A CALL?'s frames (a DEALER sends them; the ROUTER adds the identity)."""
    if op not in OPS:
        raise ValueError(f"unknown call {op!r}")
    if len(uuid) != 16:
        raise ValueError(f"a call's uuid is 16 bytes, not {len(uuid)}")
    return [CALL, op.encode(), uuid, key.encode("utf-8"), encode_properties(properties), body]


def is_call(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` (without the ROUTER identity) are meant as a CALL?."""
    return len(frames) > 0 and frames[0] == CALL


def call_uuid(frames: Sequence[bytes]) -> bytes | None:
    """The uuid of a call that may not decode, to answer it "malformed"."""
    if len(frames) >= 3 and len(frames[2]) == 16:
        return bytes(frames[2])
    return None


def decode_call(frames: Sequence[bytes]) -> Call:
    """The shape of a CALL?: frame count, op, uuid, key, properties, body sizes."""
    if len(frames) != 6:
        raise ProtocolError(f"CALL? has {len(frames)} frames, expected 6")
    if frames[0] != CALL:
        raise ProtocolError(f"expected CALL?, got {bytes(frames[0][:16])!r}")
    try:
        op = bytes(frames[1]).decode("ascii")
    except UnicodeDecodeError:
        raise ProtocolError("CALL? operation is not ASCII") from None
    if op not in OPS:
        raise ProtocolError(f"unknown CALL? operation {op[:40]!r}")
    uuid = bytes(frames[2])
    if len(uuid) != 16:
        raise ProtocolError(f"CALL? uuid is {len(uuid)} bytes, expected 16")
    props = decode_properties(bytes(frames[4]))
    body = bytes(frames[5])
    if op == OP_SET:
        key = validate_key(bytes(frames[3]), reserved_ok=False)
        if len(body) > MAX_VALUE_BYTES:
            raise LimitExceeded(
                f"value of {len(body)} bytes for key {key[:80]!r} is over the "
                f"{MAX_VALUE_BYTES}-byte limit"
            )
    elif op == OP_SET_MANY:
        if frames[3]:
            raise ProtocolError(f"CALL? {op} takes no key (each entry has its own)")
        return Call(op, uuid, "", props, body, decode_set_many(body))
    elif op in CONFLICT_OPS:
        if body:
            raise ProtocolError(f"CALL? {op} takes no body")
        key = validate_key(bytes(frames[3]), reserved_ok=False)
    elif op == OP_LEASE_GRANT:
        if body:
            raise ProtocolError(f"CALL? {op} takes no body")
        key = validate_key(bytes(frames[3]), reserved_ok=False) if frames[3] else ""
    elif op == OP_LEASE_KEEPALIVES:
        if frames[3] or not body:
            raise ProtocolError(f"CALL? {op} takes no key and a body")
        if len(body) > MAX_VALUE_BYTES:
            raise LimitExceeded(f"a {op} body of {len(body)} bytes is over the"
                                f" {MAX_VALUE_BYTES}-byte limit")
        key = ""
    elif op == OP_AHEAD:
        if body or not frames[3]:
            raise ProtocolError(f"CALL? {op} takes a key and no body")
        key = validate_key(bytes(frames[3]), reserved_ok=False)
    else:
        if frames[3] or body:
            raise ProtocolError(f"CALL? {op} takes no key and no body")
        key = ""
    return Call(op, uuid, key, props, body)


def acl_key(call: Call) -> str | None:
    """The key whose write access a call needs under an ACL, or None when it
    needs only the right to write somewhere (a lease without a named key, a
    keepalive, a revoke).

    A ``lease-grant`` may name the key its lease is for (a lock's contender
    key): judging the grant by it refuses a lock outside the caller's write
    prefixes before the server writes anything, not after a lease was made.
    """
    if (
        call.op in (OP_SET, OP_AHEAD)
        or call.op in CONFLICT_OPS
        or (call.op == OP_LEASE_GRANT and call.key)
    ):
        return call.key
    return None


def acl_refusal(
    call: Call, can_write: Callable[[bytes], bool], writes_somewhere: bool
) -> str | None:
    """Why an ACL refuses ``call``, as a detail for its ``acl`` reply, or None.

    The one rule for every server that judges a call under an ACL: the
    active server before it decides anything, and a relay before it forwards
    (the pair then judges the relay's own rights).  Kept here, pure, so that
    the two cannot drift apart.  A call with an :func:`acl_key` needs
    ``can_write`` of that key; one without needs only ``writes_somewhere``
    (the caller's write list is not empty): a lease is worth nothing to a
    client that can write no key to bind to it.
    """
    if call.op == OP_SET_MANY:
        # Key by key: one entry the caller may not write refuses the batch.
        for index, entry in enumerate(call.entries):
            if not can_write(entry.key.encode("utf-8")):
                return f"the ACL does not let you write {entry.key!r} (set-many entry {index})"
        return None
    key = acl_key(call)
    if key is not None:
        if can_write(key.encode("utf-8")):
            return None
        what = {OP_SET: "write", OP_AHEAD: "queue at", OP_LEASE_GRANT: "take a lease for"}.get(
            call.op, "resolve a conflict on"
        )
        return f"the ACL does not let you {what} {key!r}"
    if writes_somewhere:
        return None
    return "the ACL lets this client write nothing"


def check_call(call: Call) -> tuple[str, str] | None:
    """What is wrong with what a well-shaped call asks for, as (reason, detail)."""
    secret = call.secret
    if secret is not None and not valid_secret(secret):
        return ("bad-secret", "a lease secret is 32 lowercase hex digits")
    caller = call.caller
    if caller is not None and not valid_principal(caller):
        return ("malformed", f"caller {caller[:40]!r} is not name:<name> or addr:<address>")
    if call.op == OP_SET:
        text = call.prop(IF_SEQUENCE_PROPERTY)
        if text is not None and (_UINT_RE.fullmatch(text) is None or int(text) > _SEQ_MAX):
            return (
                "bad-if-sequence",
                f"if_sequence {text[:40]!r} is not a whole number from 0 to 2^64-1",
            )
        lease = call.lease
        if lease is not None and not valid_lease_id(lease):
            return ("bad-lease", f"lease id {lease[:40]!r} is not 32 lowercase hex digits")
        if call.key.startswith(LEASE_PREFIX):
            return ("reserved", f"keys under {LEASE_PREFIX} are the server's leases")
        return None
    if call.op == OP_AHEAD:
        return None
    if call.op == OP_SET_MANY:
        # The call's own properties: only a relay's caller= (checked above).
        # Each entry is judged as its own set when it is run.
        for name, _ in call.properties:
            if name != CALLER_PROPERTY:
                return ("malformed", f"a set-many call takes no {name[:40]!r} property: each"
                        " entry carries its own")
        return None
    if call.op == OP_LEASE_KEEPALIVES:
        if _KEEPALIVES_RE.fullmatch(call.body) is None:
            return ("bad-lease", "a lease-keepalives body is a line '<32 hex id>[ <32 hex"
                    " secret>]' per lease")
        if call.body.count(b"\n") > MAX_KEEPALIVES_PER_CALL:
            return ("size", f"over {MAX_KEEPALIVES_PER_CALL} leases in one lease-keepalives")
        return None
    if call.op in CONFLICT_OPS:
        text = call.prop(CONFLICT_PROPERTY)
        if text is None or _UINT_RE.fullmatch(text) is None:
            return ("malformed", f"conflict id {str(text)[:40]!r} is not a whole number")
        return None
    if call.op == OP_LEASE_GRANT:
        try:
            parse_lease_ttl(call.prop(TTL_PROPERTY))
        except ValueError as exc:
            return ("bad-ttl", str(exc))
        if call.key.startswith(LEASE_PREFIX):
            return ("reserved", f"keys under {LEASE_PREFIX} are the server's leases")
        return None
    lease = call.lease
    if lease is None or not valid_lease_id(lease):
        return ("bad-lease", f"lease id {str(lease)[:40]!r} is not 32 lowercase hex digits")
    return None


def _detail(text: str) -> str:
    return " ".join(text.split())[:_DETAIL_MAX]


def encode_reply(reply: Reply) -> list[bytes]:
    """A REPLY's frames (the ROUTER sends them after the requester's identity)."""
    if reply.status not in _STATUSES:
        raise ValueError(f"unknown reply status {reply.status!r}")
    props: list[tuple[str, str]] = [("status", reply.status)]
    if reply.reason:
        props.append(("reason", reply.reason))
    if reply.detail:
        props.append(("detail", _detail(reply.detail)))
    if reply.current is not None:
        props.append(("current", str(reply.current)))
    if reply.lease:
        props.append((LEASE_PROPERTY, reply.lease))
    if reply.ttl is not None:
        props.append((TTL_PROPERTY, repr(float(reply.ttl))))
    if reply.secret:
        props.append((SECRET_PROPERTY, reply.secret))
    if reply.ahead is not None:
        props.append((_AHEAD_PROPERTY, str(reply.ahead)))
    frames = [REPLY, reply.uuid, reply.sequence.to_bytes(8, "big")]
    if reply.sequences is not None:
        # A set-many's reply: each entry's sequence (8 bytes, 0: not applied),
        # then a line "<index> <reason> <detail>" per entry not applied, in a
        # fifth frame (only a caller of set-many ever gets one).
        props.append((_ENTRIES_PROPERTY, str(len(reply.sequences))))
        seqs = struct.pack(f">{len(reply.sequences)}Q", *reply.sequences)
        lines = "".join(f"{index} {why} {_detail(detail)}\n"
                        for index, why, detail in reply.failures).encode()
        return [*frames, encode_properties(tuple(props)), seqs + lines]
    if reply.kept is None:
        return [*frames, encode_properties(tuple(props))]
    # A batched keepalive's reply: the leases not kept, one line each, in a
    # fifth frame (only a caller of lease-keepalives ever gets one).
    props.append((_KEPT_PROPERTY, str(reply.kept)))
    gone = "".join(f"{lease_id} {why}\n" for lease_id, why in reply.gone).encode()
    return [*frames, encode_properties(tuple(props)), gone]


def decode_reply(frames: Sequence[bytes]) -> Reply:
    """A REPLY, or ProtocolError saying what was wrong."""
    if len(frames) not in (4, 5):
        raise ProtocolError(f"REPLY has {len(frames)} frames, expected 4 (or 5)")
    if frames[0] != REPLY:
        raise ProtocolError(f"expected REPLY, got {bytes(frames[0][:16])!r}")
    uuid = bytes(frames[1])
    if len(uuid) != 16:
        raise ProtocolError(f"REPLY uuid is {len(uuid)} bytes, expected 16")
    if len(frames[2]) != 8:
        raise ProtocolError(f"REPLY sequence is {len(frames[2])} bytes, expected 8")
    sequence = int.from_bytes(frames[2], "big")
    props = dict(decode_properties(bytes(frames[3])))
    status = props.get("status", "")
    if status not in _STATUSES:
        raise ProtocolError(f"REPLY status {status[:40]!r} is not ok, conflict or refused")
    current: int | None = None
    if "current" in props:
        text = props["current"]
        if _UINT_RE.fullmatch(text) is None or int(text) > _SEQ_MAX:
            raise ProtocolError(f"REPLY current {text[:40]!r} is not a sequence")
        current = int(text)
    if status == "conflict" and current is None:
        raise ProtocolError("a conflict REPLY without current=")
    reason = props.get("reason", "")
    if status == "refused" and not reason:
        raise ProtocolError("a refused REPLY without reason=")
    lease = props.get(LEASE_PROPERTY, "")
    if lease and not valid_lease_id(lease):
        raise ProtocolError(f"REPLY lease {lease[:40]!r} is not a lease id")
    secret = props.get(SECRET_PROPERTY, "")
    if secret and not valid_secret(secret):
        raise ProtocolError("REPLY secret is not 32 hex digits")
    ahead: int | None = None
    if _AHEAD_PROPERTY in props:
        text = props[_AHEAD_PROPERTY]
        if _UINT_RE.fullmatch(text) is None:
            raise ProtocolError(f"REPLY ahead {text[:40]!r} is not a count")
        ahead = int(text)
    ttl: float | None = None
    if TTL_PROPERTY in props:
        try:
            ttl = parse_lease_ttl(props[TTL_PROPERTY])
        except ValueError as exc:
            raise ProtocolError(f"REPLY {exc}") from None
    fifth = frames[4] if len(frames) == 5 else None
    sequences: tuple[int, ...] | None = None
    failures: tuple[tuple[int, str, str], ...] = ()
    if _ENTRIES_PROPERTY in props:
        if fifth is None or _KEPT_PROPERTY in props:
            raise ProtocolError("a REPLY with entries= has a fifth frame, and no kept=")
        sequences, failures = _set_many_answer(props[_ENTRIES_PROPERTY], bytes(fifth))
        fifth = None
    kept, gone = _batch_answer(props.get(_KEPT_PROPERTY), fifth)
    return Reply(
        uuid,
        status,
        sequence,
        reason=reason,
        detail=props.get("detail", ""),
        current=current,
        lease=lease,
        ttl=ttl,
        secret=secret,
        ahead=ahead,
        kept=kept,
        gone=gone,
        sequences=sequences,
        failures=failures,
    )


def _set_many_answer(
    count_text: str, raw: bytes
) -> tuple[tuple[int, ...], tuple[tuple[int, str, str], ...]]:
    """A set-many reply's ``entries=`` and fifth frame: the sequences, then
    the lines of the entries not applied."""
    if _UINT_RE.fullmatch(count_text) is None or int(count_text) > MAX_SET_MANY_ENTRIES:
        raise ProtocolError(f"REPLY entries {count_text[:40]!r} is not a set-many's count")
    count = int(count_text)
    if len(raw) < 8 * count:
        raise ProtocolError(f"a set-many REPLY has {len(raw)} bytes for {count} sequences")
    sequences = struct.unpack_from(f">{count}Q", raw)
    rest = raw[8 * count :]
    if _FAILURE_RE.fullmatch(rest) is None:
        raise ProtocolError("a set-many REPLY's failures are not '<index> <reason> <detail>'"
                            " lines")
    failures: list[tuple[int, str, str]] = []
    for line in rest.decode("utf-8", "replace").split("\n")[:-1]:
        index, why, detail = line.split(" ", 2)
        if int(index) >= count:
            raise ProtocolError(f"a set-many REPLY names entry {index} of {count}")
        failures.append((int(index), why, detail))
    return sequences, tuple(failures)


def _batch_answer(
    kept_text: str | None, body: bytes | None
) -> tuple[int | None, tuple[tuple[str, str], ...]]:
    """A batched keepalive reply's ``kept=`` and fifth frame (both or neither)."""
    if kept_text is None and body is None:
        return None, ()
    if kept_text is None or body is None:
        raise ProtocolError("a REPLY with kept= has a fifth frame, and only it")
    if _UINT_RE.fullmatch(kept_text) is None:
        raise ProtocolError(f"REPLY kept {kept_text[:40]!r} is not a count")
    raw = bytes(body)
    if _GONE_RE.fullmatch(raw) is None:
        raise ProtocolError("a REPLY's leases not kept are not '<id> <reason>' lines")
    gone = tuple(
        (lease_id, why)
        for lease_id, _, why in (line.partition(" ") for line in raw.decode().split("\n")[:-1])
    )
    return int(kept_text), gone
