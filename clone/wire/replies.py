"""REPLY, the answer to a CALL? (:mod:`clone.wire.calls`): its frames, its
encoder and its total decoder.

How this works: an active server answers each call with exactly one REPLY,
``[b"REPLY", uuid, sequence, properties]`` (docs/protocol.md, "CALL?"), and
a fifth frame for the two batched calls: a ``set-many``'s sequences and the
entries not applied, a ``lease-keepalives``'s leases not kept.  The decoder
is total, as in :mod:`clone.wire.codec`: a REPLY or a ProtocolError saying
what was wrong.  :mod:`clone.wire.calls` re-exports all of it.  Pure.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from clone.errors import ProtocolError
from clone.wire.callnames import (
    LEASE_PROPERTY,
    MAX_SET_MANY_ENTRIES,
    REPLY,
    SECRET_PROPERTY,
    SEQ_MAX,
    UINT_RE,
    parse_lease_ttl,
    valid_lease_id,
    valid_secret,
)
from clone.wire.codec import decode_properties, encode_properties
from clone.wire.protocol import TTL_PROPERTY

__all__ = ["Reply", "decode_reply", "encode_reply"]

_AHEAD_PROPERTY = "ahead"
_KEPT_PROPERTY = "kept"
_ENTRIES_PROPERTY = "entries"
#: A set-many reply's line per entry not applied: index, reason, detail.
_FAILURE_RE = re.compile(rb"(?:[0-9]{1,5} [a-z-]{1,40} [^\n]{0,800}\n)*")
_STATUSES = frozenset({"ok", "conflict", "refused"})
#: A batched keepalive's reply body: a line ``<id> <reason>`` per lease not kept.
_GONE_RE = re.compile(rb"(?:[0-9a-f]{32} [a-z-]{1,40}\n)*")
_DETAIL_MAX = 200


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
        if UINT_RE.fullmatch(text) is None or int(text) > SEQ_MAX:
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
        if UINT_RE.fullmatch(text) is None:
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
    if UINT_RE.fullmatch(count_text) is None or int(count_text) > MAX_SET_MANY_ENTRIES:
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
    if UINT_RE.fullmatch(kept_text) is None:
        raise ProtocolError(f"REPLY kept {kept_text[:40]!r} is not a count")
    raw = bytes(body)
    if _GONE_RE.fullmatch(raw) is None:
        raise ProtocolError("a REPLY's leases not kept are not '<id> <reason>' lines")
    gone = tuple(
        (lease_id, why)
        for lease_id, _, why in (line.partition(" ") for line in raw.decode().split("\n")[:-1])
    )
    return int(kept_text), gone

