"""Control messages on the update stream: view heartbeats and refusal notices.

How this works: a key may not begin with a NUL byte, so topics that do are free
for the server's notices to one client (docs/protocol.md, "Security: CURVE,
ACLs and filtered streams").  Both kinds have the five-frame shape of a KVPUB,
so a Guide client that somehow received one would take it for the delete of a
key it does not hold:

* a *view heartbeat* ``[b"\\x00V<id>\\x00", sequence, b"",
  b"heartbeat=<ms>\\nview_count=<n>\\n", b""]`` is the heartbeat of a restricted
  client's filtered stream: the server's sequence, and how many updates it has
  published under the view's prefixes up to it.  A restricted client cannot
  use the "+1" rule (its stream has holes by design), so it compares that count
  with its own instead;
* a *refusal notice* ``[b"\\x00R<name>\\x00", 0, uuid, b"reason=<r>\\n", b""]``
  tells one client that its write with ``uuid`` was not applied, and why.

Both ends compute a view's id with :func:`view_id`, from its read prefixes.
Decoding is total, as in :mod:`clone.wire.codec`: a message or
:class:`~clone.errors.ProtocolError`.  Pure: no zmq, no clock.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from clone.errors import ProtocolError
from clone.wire.codec import decode_properties, encode_properties
from clone.wire.protocol import (
    CONTROL_PREFIX,
    HEARTBEAT_PROPERTY,
    MAX_HEARTBEAT_MS,
    MAX_KEY_BYTES,
    REASON_PROPERTY,
    REFUSAL_REASONS,
    REFUSAL_TAG,
    STALE_PROPERTY,
    VIEW_COUNT_PROPERTY,
    VIEW_ID_CHARS,
    VIEW_TAG,
)

__all__ = [
    "VIEW_TAG",
    "REFUSAL_TAG",
    "ViewHeartbeat",
    "Refusal",
    "view_id",
    "view_topic",
    "refusal_topic",
    "encode_view_heartbeat",
    "encode_refusal",
    "is_control",
    "decode_control",
]

_HEX = frozenset("0123456789abcdef")
_SEQ_MAX = (1 << 64) - 1
_ZERO_SEQ = bytes(8)


@dataclass(frozen=True, slots=True)
class ViewHeartbeat:
    """The heartbeat of view ``view``: ``count`` updates published in it up to
    the server's ``sequence``.  ``heartbeat`` is the server's interval in
    seconds (None if it did not say), as in a HUGZ."""

    view: str
    sequence: int
    heartbeat: float | None
    count: int
    #: A relay that lost the pair says so here too (``stale=1``), as in its HUGZ.
    stale: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """The write ``uuid`` of client ``name`` was not applied, for ``reason``
    (``acl``, ``full``, ``size``, from a relay ``stale`` or ``overloaded``; a
    newer server may give others)."""

    name: str
    uuid: bytes
    reason: str


def view_id(prefixes: Sequence[bytes]) -> str:
    """The id of the view made of these read prefixes: 12 hex characters of the
    SHA-256 of the sorted, de-duplicated prefixes joined by newlines.  Order and
    repetition do not matter, so server and client agree on it."""
    for prefix in prefixes:
        if not isinstance(prefix, bytes):
            raise TypeError(f"prefixes must be bytes, not {type(prefix).__name__}")
    joined = b"\n".join(sorted(set(prefixes)))
    return hashlib.sha256(joined).hexdigest()[:VIEW_ID_CHARS]


def _check_view_id(view: str) -> None:
    if len(view) != VIEW_ID_CHARS or not set(view) <= _HEX:
        raise ValueError(f"view id {view[:40]!r} is not {VIEW_ID_CHARS} lowercase hex characters")


def view_topic(view: str) -> bytes:
    """``b"\\x00V" + id + b"\\x00"``: the topic of a view's heartbeats."""
    _check_view_id(view)
    return VIEW_TAG + view.encode("ascii") + b"\x00"


def refusal_topic(name: str) -> bytes:
    """``b"\\x00R" + name + b"\\x00"``: the topic of one client's refusal notices."""
    if not name or "\x00" in name:
        raise ValueError(f"client name {name!r} must be non-empty and hold no NUL")
    topic = REFUSAL_TAG + name.encode("utf-8") + b"\x00"
    if len(topic) > MAX_KEY_BYTES:
        raise ValueError(f"client name of {len(name)} characters is too long for a topic")
    return topic


def encode_view_heartbeat(
    view: str, sequence: int, heartbeat_ms: int | None, count: int, *, stale: bool = False
) -> list[bytes]:
    """The five frames of a view heartbeat (``stale``: a relay's ``stale=1``)."""
    if not 0 <= sequence <= _SEQ_MAX:
        raise ValueError(f"sequence {sequence} does not fit in 64 unsigned bits")
    if count < 0:
        raise ValueError(f"view count must be >= 0, not {count}")
    props: list[tuple[str, str]] = []
    if heartbeat_ms is not None:
        if not 0 < heartbeat_ms <= MAX_HEARTBEAT_MS:
            raise ValueError(f"heartbeat of {heartbeat_ms} ms is outside 1..{MAX_HEARTBEAT_MS}")
        props.append((HEARTBEAT_PROPERTY, str(heartbeat_ms)))
    props.append((VIEW_COUNT_PROPERTY, str(count)))
    if stale:
        props.append((STALE_PROPERTY, "1"))
    return [
        view_topic(view),
        sequence.to_bytes(8, "big"),
        b"",
        encode_properties(tuple(props)),
        b"",
    ]


def encode_refusal(name: str, uuid: bytes, reason: str) -> list[bytes]:
    """The five frames of a refusal notice for client ``name``'s write ``uuid``."""
    if reason not in REFUSAL_REASONS:
        raise ValueError(f"refusal reason {reason!r} is not one of {sorted(REFUSAL_REASONS)}")
    if len(uuid) not in (0, 16):
        raise ValueError(f"uuid must be 0 or 16 bytes, not {len(uuid)}")
    props = encode_properties(((REASON_PROPERTY, reason),))
    return [refusal_topic(name), _ZERO_SEQ, bytes(uuid), props, b""]


def is_control(frames: Sequence[bytes]) -> bool:
    """Whether these frames are a control message (frame 0 starts with NUL):
    cheap, for the subscriber's loop to tell them from KVPUBs and HUGZ."""
    return bool(frames) and frames[0][:1] == CONTROL_PREFIX


def _topic_body(topic: bytes, tag: bytes, what: str) -> bytes:
    if len(topic) < len(tag) + 2 or not topic.endswith(b"\x00"):
        raise ProtocolError(f"{what} topic must be {tag!r}<name>\\x00")
    body = topic[len(tag) : -1]
    if b"\x00" in body:
        raise ProtocolError(f"{what} topic holds a NUL inside its name")
    return body


def _whole_number(value: str, what: str) -> int:
    if not (value.isascii() and value.isdigit()) or len(value) > 20:
        raise ProtocolError(f"{what} {value[:20]!r} is not a whole number")
    number = int(value)
    if number > _SEQ_MAX:
        raise ProtocolError(f"{what} {value[:20]!r} does not fit in 64 bits")
    return number


def _decode_view(frames: Sequence[bytes]) -> ViewHeartbeat:
    topic, seq_raw, uuid, props_raw, body = (bytes(f) for f in frames)
    try:
        view = _topic_body(topic, VIEW_TAG, "view heartbeat").decode("ascii")
        _check_view_id(view)
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(
            f"view heartbeat topic {topic[:40]!r} does not hold a {VIEW_ID_CHARS}-hex view id"
        ) from None
    if len(seq_raw) != 8:
        raise ProtocolError(f"view heartbeat sequence frame must be 8 bytes, got {len(seq_raw)}")
    if uuid or body:
        raise ProtocolError("view heartbeat must have empty uuid and body frames")
    props = dict(decode_properties(props_raw))
    heartbeat: float | None = None
    if HEARTBEAT_PROPERTY in props:
        ms = _whole_number(props[HEARTBEAT_PROPERTY], "view heartbeat interval")
        if not 0 < ms <= MAX_HEARTBEAT_MS:
            raise ProtocolError(
                f"view heartbeat interval of {ms} ms is outside 1..{MAX_HEARTBEAT_MS}"
            )
        heartbeat = ms / 1000.0
    if VIEW_COUNT_PROPERTY not in props:
        raise ProtocolError("view heartbeat without a view_count property")
    count = _whole_number(props[VIEW_COUNT_PROPERTY], "view_count")
    stale = props.get(STALE_PROPERTY) == "1"
    return ViewHeartbeat(view, int.from_bytes(seq_raw, "big"), heartbeat, count, stale)


def _decode_refusal(frames: Sequence[bytes]) -> Refusal:
    topic, seq_raw, uuid, props_raw, body = (bytes(f) for f in frames)
    try:
        name = _topic_body(topic, REFUSAL_TAG, "refusal notice").decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("refusal notice topic: the client name is not UTF-8") from None
    if len(seq_raw) != 8:
        raise ProtocolError(f"refusal notice sequence frame must be 8 bytes, got {len(seq_raw)}")
    if len(uuid) not in (0, 16):
        raise ProtocolError(f"refusal notice uuid frame must be 0 or 16 bytes, got {len(uuid)}")
    if body:
        raise ProtocolError("refusal notice must have an empty body frame")
    reason = dict(decode_properties(props_raw)).get(REASON_PROPERTY)
    if not reason:
        raise ProtocolError("refusal notice without a reason property")
    return Refusal(name, uuid, reason)


def decode_control(frames: Sequence[bytes]) -> ViewHeartbeat | Refusal:
    """A view heartbeat or a refusal notice; ProtocolError for anything else."""
    if len(frames) != 5:
        raise ProtocolError(f"control message must have 5 frames, got {len(frames)}")
    head = bytes(frames[0][:2])
    if head == VIEW_TAG:
        return _decode_view(frames)
    if head == REFUSAL_TAG:
        return _decode_refusal(frames)
    raise ProtocolError(f"unknown control topic {bytes(frames[0][:16])!r}")
