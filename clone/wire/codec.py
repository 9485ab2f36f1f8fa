"""The CHP wire format, and nothing else.

How this works: every CHP command except ICANHAZ? is five ZeroMQ frames,
``[key, sequence, uuid, properties, body]``.  KVSYNC, KVPUB and KVSET share that
shape and are told apart by the socket they arrive on; KTHXBAI and HUGZ are the
same shape with a reserved word in the key frame.  ICANHAZ? is two frames,
``[b"ICANHAZ?", subtree]``.

Decoding is strict and total: for any list of frames, a ``decode_*`` function
returns a message or raises :class:`~clone.errors.ProtocolError` whose text says
what was wrong.  Nothing else escapes, whatever arrives (hypothesis checks it).
Encoding trusts its input: messages are validated when they are built
(:meth:`KVMsg.build`, from a uuid the caller draws) or decoded, so the hot path
does not check twice.  Only :func:`new_uuid` reads the clock or draws randomness,
and only when called.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from clone.errors import LimitExceeded, ProtocolError
from clone.wire.protocol import (
    HEARTBEAT_PROPERTY,
    HUGZ,
    ICANHAZ,
    KTHXBAI,
    MAX_HEARTBEAT_MS,
    MAX_KEY_BYTES,
    MAX_PROPERTIES_BYTES,
    MAX_SUBTREE_BYTES,
    MAX_VALUE_BYTES,
    STALE_PROPERTY,
    VIEW_COUNT_PROPERTY,
    VIEW_ID_CHARS,
    VIEW_PROPERTY,
)
from clone.wire.uuids import Uuid7Source

__all__ = [
    "KVMsg",
    "SnapshotRequest",
    "SnapshotEnd",
    "Hugz",
    "Properties",
    "new_uuid",
    "encode_kv",
    "encode_icanhaz",
    "encode_kthxbai",
    "encode_hugz",
    "encode_properties",
    "decode_properties",
    "decode_icanhaz",
    "decode_kvset",
    "decode_update",
    "decode_snapshot_reply",
    "fast_kvsync_entry",
    "validate_key",
    "validate_subtree",
    "key_in_subtree",
    "RESERVED_KEYS",
]

Properties = tuple[tuple[str, str], ...]

RESERVED_KEYS = frozenset({KTHXBAI.decode(), HUGZ.decode()})
_SEQ_MAX = (1 << 64) - 1
_ZERO_SEQ = bytes(8)
_new_uuid = Uuid7Source()
_RESERVED_RAW = frozenset(k.encode() for k in RESERVED_KEYS)
# Keys beginning with NUL are control topics (clone.wire.control), never data.
_CONTROL_BYTE = b"\x00"
_HEX = frozenset("0123456789abcdef")
_KV_FRAMES = 5
_SEQ_BYTES = 8
_UUID_SIZES = (0, 16)
_SUBTREE_RE = re.compile(r"/(?:[^/]+/)+")


def new_uuid() -> bytes:
    """A fresh UUIDv7 as 16 bytes: unique, and sorted by creation time, whose
    time is the time it was made, however many are made a second
    (:mod:`clone.wire.uuids`).

    The one function here that reads the clock and draws randomness; the I/O
    layers call it and hand the result in (:meth:`KVMsg.build` never draws).
    """
    return _new_uuid()


@dataclass(frozen=True, slots=True)
class KVMsg:
    """One key-value message: a KVSYNC, KVPUB or KVSET.

    An empty ``body`` on KVSET/KVPUB means "delete this key".
    """

    key: str
    sequence: int = 0
    uuid: bytes = b""
    properties: Properties = ()
    body: bytes = b""

    @classmethod
    def build(
        cls,
        key: str,
        body: bytes = b"",
        *,
        uuid: bytes,
        sequence: int = 0,
        properties: Properties | dict[str, str] = (),
    ) -> KVMsg:
        """Validate application input and make a message (API misuse raises).

        The caller passes the ``uuid`` (:func:`new_uuid` for a fresh write, ``b""``
        for none): drawing one here would hide a clock and randomness in a
        module that is otherwise a pure function of its input.  Limits raise
        :class:`~clone.errors.LimitExceeded` so callers can tell "too big" from
        "wrong type".
        """
        if not isinstance(key, str):
            raise TypeError(f"key must be str, not {type(key).__name__}")
        if not isinstance(body, bytes | bytearray | memoryview):
            raise TypeError(f"value must be bytes, not {type(body).__name__}")
        validate_key(key.encode("utf-8"), reserved_ok=False)
        body = bytes(body)
        if len(body) > MAX_VALUE_BYTES:
            raise LimitExceeded(
                f"value of {len(body)} bytes for key {key!r} is over the "
                f"{MAX_VALUE_BYTES}-byte limit"
            )
        if not 0 <= sequence <= _SEQ_MAX:
            raise ValueError(f"sequence {sequence} does not fit in 64 unsigned bits")
        if len(uuid) not in (0, 16):
            raise ValueError(f"uuid must be 0 or 16 bytes, not {len(uuid)}")
        props = tuple(properties.items()) if isinstance(properties, dict) else tuple(properties)
        encoded = encode_properties(props)
        decode_properties(encoded)  # the same checks a receiver makes
        return cls(key, sequence, bytes(uuid), props, body)

    def prop(self, name: str, default: str | None = None) -> str | None:
        """The value of property ``name``, or ``default``."""
        for pname, value in self.properties:
            if pname == name:
                return value
        return default

    def with_props(self, **changes: str | None) -> Properties:
        """Properties with ``changes`` applied (None removes), order kept."""
        out = [(n, v) for n, v in self.properties if n not in changes]
        out.extend((n, v) for n, v in changes.items() if v is not None)
        return tuple(out)

    @property
    def is_delete(self) -> bool:
        return not self.body


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    """ICANHAZ?: a client asks for the state under ``subtree`` ('' = all)."""

    subtree: str = ""


@dataclass(frozen=True, slots=True)
class SnapshotEnd:
    """KTHXBAI: the snapshot is complete up to ``sequence``.

    ``properties`` are empty from the Guide's servers; ours give a restricted
    requester its ``view`` (id) and ``view_count`` (updates published in the
    view up to ``sequence``), checked when decoded: see :mod:`clone.wire.control`.
    """

    sequence: int
    subtree: str = ""
    properties: Properties = ()

    @property
    def view(self) -> str | None:
        """The requester's view id if it is restricted, else None."""
        return _prop(self.properties, VIEW_PROPERTY)

    @property
    def view_count(self) -> int | None:
        """Updates in the view up to ``sequence``, if the requester is restricted."""
        value = _prop(self.properties, VIEW_COUNT_PROPERTY)
        return None if value is None else int(value)


@dataclass(frozen=True, slots=True)
class Hugz:
    """HUGZ: the server is alive.  ``sequence`` is informational only.

    ``heartbeat`` is the interval the server promises, in seconds, when it says
    (our extension, the ``heartbeat`` property in milliseconds): a client then
    judges silence by the server's own rhythm instead of a guess.  None from a
    server that does not say, such as the Guide's.
    """

    sequence: int = 0
    heartbeat: float | None = None
    #: A relay that has lost the pair it relays says so (``stale=1``, our
    #: extension): its state may be behind the pair's.
    stale: bool = False


# --------------------------------------------------------------------------
# Encoding


def encode_properties(props: Properties) -> bytes:
    """``name=value\\n`` for each property, in order."""
    if not props:
        return b""
    return "".join(f"{n}={v}\n" for n, v in props).encode("utf-8")


def encode_kv(msg: KVMsg) -> list[bytes]:
    """The five frames of a KVSYNC, KVPUB or KVSET."""
    return [
        msg.key.encode("utf-8"),
        msg.sequence.to_bytes(8, "big"),
        msg.uuid,
        encode_properties(msg.properties),
        msg.body,
    ]


def encode_icanhaz(subtree: str = "") -> list[bytes]:
    """The two frames of a snapshot request."""
    raw = subtree.encode("utf-8")
    validate_subtree(raw)
    return [ICANHAZ, raw]


def encode_kthxbai(
    sequence: int, subtree: str = "", properties: Properties | dict[str, str] = ()
) -> list[bytes]:
    """The five frames that end a snapshot (``properties``: the view of a
    restricted requester; none, as in the spec, by default)."""
    props = tuple(properties.items()) if isinstance(properties, dict) else tuple(properties)
    return [
        KTHXBAI,
        sequence.to_bytes(8, "big"),
        b"",
        encode_properties(props),
        subtree.encode("utf-8"),
    ]


def encode_hugz(
    sequence: int = 0, heartbeat_ms: int | None = None, *, stale: bool = False
) -> list[bytes]:
    """The five frames of a heartbeat.  The spec shows sequence zero and no
    properties; ``heartbeat_ms`` adds our ``heartbeat`` property, ``stale`` a
    relay's ``stale=1``."""
    props = b""
    if heartbeat_ms is not None:
        if not 0 < heartbeat_ms <= MAX_HEARTBEAT_MS:
            raise ValueError(f"heartbeat of {heartbeat_ms} ms is outside 1..{MAX_HEARTBEAT_MS}")
        props = b"%s=%d\n" % (HEARTBEAT_PROPERTY.encode(), heartbeat_ms)
    if stale:
        props += b"%s=1\n" % STALE_PROPERTY.encode()
    return [HUGZ, sequence.to_bytes(8, "big") if sequence else _ZERO_SEQ, b"", props, b""]


# --------------------------------------------------------------------------
# Decoding


def validate_key(raw: bytes, *, reserved_ok: bool = True) -> str:
    """Decode and check a key frame; return the key as text."""
    if not raw:
        raise ProtocolError("empty key")
    if len(raw) > MAX_KEY_BYTES:
        raise LimitExceeded(f"key of {len(raw)} bytes is over the {MAX_KEY_BYTES}-byte limit")
    try:
        key = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtocolError(f"key is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not reserved_ok:
        if key in RESERVED_KEYS:
            raise ProtocolError(f"key {key!r} is reserved for protocol commands")
        if raw[:1] == _CONTROL_BYTE:
            raise ProtocolError(
                f"key {key[:40]!r}: keys beginning with NUL are reserved for control topics"
            )
    return key


def validate_subtree(raw: bytes) -> str:
    """A subtree is empty or ``/segment/.../``; return it as text."""
    if not raw:
        return ""
    if len(raw) > MAX_SUBTREE_BYTES:
        raise LimitExceeded(
            f"subtree of {len(raw)} bytes is over the {MAX_SUBTREE_BYTES}-byte limit"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("subtree is not UTF-8") from None
    if not _SUBTREE_RE.fullmatch(text):
        raise ProtocolError(
            f"subtree {text[:80]!r} is neither empty nor of the form '/segment/.../'"
        )
    return text


def key_in_subtree(key: str, subtree: str) -> bool:
    """Subtrees match by prefix, as ZeroMQ subscriptions do."""
    return key.startswith(subtree)


def decode_properties(raw: bytes) -> Properties:
    """Parse a properties frame: zero or more ``name=value\\n``."""
    if not raw:
        return ()
    if len(raw) > MAX_PROPERTIES_BYTES:
        raise LimitExceeded(
            f"properties of {len(raw)} bytes are over the {MAX_PROPERTIES_BYTES}-byte limit"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("properties are not UTF-8") from None
    if not text.endswith("\n"):
        raise ProtocolError("properties must end with a newline")
    props: list[tuple[str, str]] = []
    seen: set[str] = set()
    for line in text[:-1].split("\n"):
        name, eq, value = line.partition("=")
        if not eq:
            raise ProtocolError(f"property {line[:40]!r} has no '='")
        if not name:
            raise ProtocolError("property with an empty name")
        if "\r" in name or "\r" in value:
            raise ProtocolError(f"property {name[:40]!r} contains a carriage return")
        if name in seen:
            raise ProtocolError(f"property {name[:40]!r} appears twice")
        seen.add(name)
        props.append((name, value))
    return tuple(props)


def _prop(props: Properties, name: str) -> str | None:
    for pname, value in props:
        if pname == name:
            return value
    return None


def _check_kthxbai_properties(props: Properties) -> None:
    """A view and its count come together, well formed, so that the accessors
    of :class:`SnapshotEnd` never fail."""
    view = _prop(props, VIEW_PROPERTY)
    count = _prop(props, VIEW_COUNT_PROPERTY)
    if view is None and count is None:
        return
    if view is None or count is None:
        raise ProtocolError("KTHXBAI has one of view and view_count without the other")
    if len(view) != VIEW_ID_CHARS or not set(view) <= _HEX:
        raise ProtocolError(f"KTHXBAI view {view[:40]!r} is not {VIEW_ID_CHARS} lowercase hex")
    if not (count.isascii() and count.isdigit()) or int(count) > _SEQ_MAX:
        raise ProtocolError(f"KTHXBAI view_count {count[:20]!r} is not a whole number")


def _check_frames(frames: Sequence[bytes], count: int, what: str) -> None:
    if len(frames) != count:
        raise ProtocolError(f"{what} must have {count} frames, got {len(frames)}")


def _decode_sequence(raw: bytes) -> int:
    if len(raw) != 8:
        raise ProtocolError(f"sequence frame must be 8 bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def _decode_stale(props_raw: bytes) -> bool:
    """Whether a HUGZ says ``stale=1`` (a relay that lost its pair)."""
    if not props_raw or STALE_PROPERTY.encode() not in props_raw:
        return False
    return any(n == STALE_PROPERTY and v == "1" for n, v in decode_properties(props_raw))


def _decode_heartbeat(props_raw: bytes) -> float | None:
    """The ``heartbeat`` property of a HUGZ, in seconds; None if absent."""
    if not props_raw:
        return None
    for name, value in decode_properties(props_raw):
        if name == HEARTBEAT_PROPERTY:
            if not (value.isascii() and value.isdigit()) or not 0 < int(value) <= MAX_HEARTBEAT_MS:
                raise ProtocolError(
                    f"HUGZ heartbeat property {value[:20]!r} is not a whole number of "
                    f"milliseconds in 1..{MAX_HEARTBEAT_MS}"
                )
            return int(value) / 1000.0
    return None


def _decode_kv(frames: Sequence[bytes], what: str, *, reserved_ok: bool) -> KVMsg:
    _check_frames(frames, 5, what)
    key_raw, seq_raw, uuid, props_raw, body = frames
    key = validate_key(bytes(key_raw), reserved_ok=reserved_ok)
    sequence = _decode_sequence(seq_raw)
    if len(uuid) not in (0, 16):
        raise ProtocolError(f"uuid frame must be 0 or 16 bytes, got {len(uuid)}")
    if len(body) > MAX_VALUE_BYTES:
        raise LimitExceeded(
            f"value of {len(body)} bytes for key {key[:80]!r} is over the "
            f"{MAX_VALUE_BYTES}-byte limit"
        )
    props = decode_properties(bytes(props_raw)) if props_raw else ()
    return KVMsg(key, sequence, bytes(uuid), props, bytes(body))


def decode_icanhaz(frames: Sequence[bytes]) -> SnapshotRequest:
    """A snapshot request, without the ROUTER identity frame."""
    if not frames or frames[0] != ICANHAZ:
        head = bytes(frames[0][:16]) if frames else b""
        raise ProtocolError(f"expected ICANHAZ?, got command {head!r}")
    _check_frames(frames, 2, "ICANHAZ?")
    return SnapshotRequest(validate_subtree(bytes(frames[1])))


def decode_kvset(frames: Sequence[bytes]) -> KVMsg:
    """A client update arriving at the collector."""
    return _decode_kv(frames, "KVSET", reserved_ok=False)


def decode_update(frames: Sequence[bytes]) -> KVMsg | Hugz:
    """What a subscriber receives: a KVPUB or a HUGZ."""
    if frames and frames[0] == HUGZ:
        _check_frames(frames, 5, "HUGZ")
        props = bytes(frames[3])
        return Hugz(_decode_sequence(frames[1]), _decode_heartbeat(props), _decode_stale(props))
    return _decode_kv(frames, "KVPUB", reserved_ok=False)


def decode_snapshot_reply(frames: Sequence[bytes]) -> KVMsg | SnapshotEnd:
    """What a snapshot requester receives: a KVSYNC or the closing KTHXBAI."""
    if frames and frames[0] == KTHXBAI:
        _check_frames(frames, 5, "KTHXBAI")
        sequence = _decode_sequence(frames[1])
        subtree = validate_subtree(bytes(frames[4]))
        props = decode_properties(bytes(frames[3])) if frames[3] else ()
        _check_kthxbai_properties(props)
        return SnapshotEnd(sequence, subtree, props)
    return _decode_kv(frames, "KVSYNC", reserved_ok=False)


def fast_kvsync_entry(
    frames: Sequence[bytes],
) -> tuple[str, tuple[int, bytes, Properties, bytes]] | None:
    """A KVSYNC as ``(key, (sequence, uuid, properties, body))``, or None.

    The hot path of a sync from a server that sends KVSYNCs (the Guide's): no
    message object, no exception, checks ordered cheapest first.  It accepts
    exactly the KVSYNCs that :func:`decode_snapshot_reply` accepts, with the same
    values (a hypothesis test compares them).  None means "not a valid KVSYNC":
    a KTHXBAI, or something malformed; the caller then asks the codec, which
    says what it is, or why not.  ``frames`` are ``bytes``, not buffers.
    """
    if len(frames) != _KV_FRAMES:
        return None
    key_raw, seq_raw, uuid, props_raw, body = frames
    if (
        len(seq_raw) != _SEQ_BYTES
        or not 0 < len(key_raw) <= MAX_KEY_BYTES
        or len(uuid) not in _UUID_SIZES
        or len(body) > MAX_VALUE_BYTES
        or key_raw in _RESERVED_RAW
        or key_raw[:1] == _CONTROL_BYTE
    ):
        return None
    try:
        key = key_raw.decode("utf-8")
        props = decode_properties(props_raw) if props_raw else ()
    except (UnicodeDecodeError, ProtocolError):
        return None
    return key, (int.from_bytes(seq_raw, "big"), uuid, props, body)
