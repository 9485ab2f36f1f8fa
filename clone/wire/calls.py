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

The names both sides share (operations, properties, reasons, limits, lease
ids) are in :mod:`clone.wire.callnames`, the REPLY's codec in
:mod:`clone.wire.replies`; this module re-exports both, so callers import
everything from here.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from clone.errors import LimitExceeded, ProtocolError
from clone.wire.callnames import (
    CALL,
    CALLER_PROPERTY,
    CONFLICT_OPS,
    CONFLICT_PROPERTY,
    IF_SEQUENCE_PROPERTY,
    LEASE_PREFIX,
    LEASE_PROPERTY,
    MAX_KEEPALIVES_PER_CALL,
    MAX_SET_MANY_BYTES,
    MAX_SET_MANY_ENTRIES,
    OP_AHEAD,
    OP_CONFLICT_APPLY,
    OP_CONFLICT_DISCARD,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_KEEPALIVES,
    OP_LEASE_REVOKE,
    OP_SET,
    OP_SET_MANY,
    OPS,
    REASONS,
    REPLY,
    SECRET_PROPERTY,
    SEQ_MAX,
    UINT_RE,
    lease_id_of,
    lease_key,
    parse_lease_ttl,
    valid_lease_id,
    valid_principal,
    valid_secret,
)
from clone.wire.callnames import MIN_LEASE_TTL as MIN_LEASE_TTL
from clone.wire.codec import (
    KVMsg,
    Properties,
    decode_properties,
    encode_properties,
    validate_key,
)
from clone.wire.protocol import MAX_VALUE_BYTES, TTL_PROPERTY
from clone.wire.replies import Reply, decode_reply, encode_reply

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

_NOT_STORED = frozenset({IF_SEQUENCE_PROPERTY, SECRET_PROPERTY, CALLER_PROPERTY})
#: A ``lease-keepalives`` body, checked in one C-level match: a line per lease.
_KEEPALIVES_RE = re.compile(rb"(?:[0-9a-f]{32}(?: [0-9a-f]{32})?\n)+")


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
        if text is not None and (UINT_RE.fullmatch(text) is None or int(text) > SEQ_MAX):
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
        if text is None or UINT_RE.fullmatch(text) is None:
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
