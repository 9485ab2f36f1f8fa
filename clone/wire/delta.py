"""KVDELTA, our extension of CHP: catch-up from a sequence instead of a snapshot.

How this works: a passive server that restarts with its state on disk (issue
13) already holds every update up to some sequence.  A full snapshot would
resend all of it; it needs only what it missed.  So it says, as ZMTP metadata
on its sync DEALER, the sequence of the last update it holds and a digest of
that update::

    X-CHP-Since: <sequence>,<digest as 16 hex characters>

The active server keeps a bounded history of its most recent updates
(:class:`clone.server.history.History`).  It answers with a delta only when
both hold:

* its history *covers* ``sequence``: every update after it, up to the newest,
  is still held (``history.covers(sequence)``); and
* the digest of its own update at ``sequence`` (``history.entry(sequence)``)
  equals the requester's.  The digest tells apart two different updates at
  the same sequence -- written by two actives in a split brain, or by an
  active whose history the requester never saw -- so a match means the
  requester's last update is ours, and its state is a prefix of ours.

``sequence == 0`` (an empty server) never gets a delta.  Otherwise the
answer is a normal full snapshot.  A delta reply is::

    [b"KVDELTA", from_sequence, properties]
    KVSYNC ... (each update after from_sequence, in order, deletes included
                as an empty body)
    KTHXBAI (sequence, subtree "")

``from_sequence`` is 8 bytes big-endian, as in KTHXBAI; ``properties`` is the
codec's ``name=value\\n`` encoding, empty for now (unknown properties are
ignored, for later versions).  A KVSYNC of a delta is the 5 frames of the
KVPUB that carried the update, sequence included.  A requester recognises a
full snapshot by the absence of KVDELTA before the first entry (or before
KTHXBAI), and must then replace its state rather than apply to it.  If it
also asked for KVAPPLIED (``X-CHP-Applied``), the KVAPPLIED messages come
first, then KVDELTA.

Guide peers never set the metadata and so never see KVDELTA.

**History request** (a client's ``changes(since=N)``, :mod:`clone.client.history`):
the same metadata *without* a digest, ``X-CHP-Since: <sequence>``, means "I hold
no state; send me every update after ``sequence``".  No digest is compared and
``sequence`` 0 is allowed (when the history still starts at 0).  The reply is
the KVDELTA stream above when the history covers ``sequence`` -- filtered by
the request's subtree and a restricted requester's read prefixes, so it may
skip sequences -- and otherwise a KVDELTA whose properties say
``compacted=<oldest sequence still held>``, followed directly by KTHXBAI: the
history no longer reaches back to ``sequence``.  A history request never gets
a full snapshot.

Like :mod:`clone.wire.codec`, the decoders are total: they return a value or
raise :class:`~clone.errors.ProtocolError`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from clone.errors import ProtocolError
from clone.wire.codec import decode_properties, encode_properties
from clone.wire.protocol import KVDELTA, SINCE_DIGEST_BYTES, SINCE_PROPERTY, SINCE_TERM_PROPERTY

__all__ = [
    "COMPACTED_PROPERTY",
    "DELTA_FRAMES",
    "DeltaHead",
    "SinceRequest",
    "decode_kvdelta",
    "decode_kvdelta_head",
    "encode_kvdelta",
    "is_kvdelta",
    "parse_since",
    "parse_since_term",
    "since_metadata",
    "since_term_metadata",
    "update_digest",
]

#: Frames in a KVDELTA as its receiver sees it (no ROUTER identity).
DELTA_FRAMES = 3
#: Frames of one update (a KVPUB or KVSYNC): key, sequence, uuid, properties, body.
_UPDATE_FRAMES = 5
_MAX_SEQUENCE = 2**64 - 1
# Decimal digits of 2**64-1: a longer number is refused before int() parses it.
_MAX_SEQUENCE_DIGITS = len(str(_MAX_SEQUENCE))
_HEX = frozenset("0123456789abcdefABCDEF")
#: The KVDELTA property of a history reply that cannot be given: the oldest
#: sequence the server's history still holds.
COMPACTED_PROPERTY = "compacted"


@dataclass(frozen=True, slots=True)
class SinceRequest:
    """A requester's ``X-CHP-Since``: the sequence and digest of its last update.

    ``digest`` None is a history request: a client that holds no state and
    wants every update after ``sequence``.  ``term``: the term that update
    was written under, when a pair server says it (``X-CHP-Since-Term``);
    None for a relay, a client or an older server.
    """

    sequence: int
    digest: bytes | None = None
    term: int | None = None

    @property
    def history(self) -> bool:
        """Whether this is a history request (no digest), not a peer's catch-up."""
        return self.digest is None


@dataclass(frozen=True, slots=True)
class DeltaHead:
    """A decoded KVDELTA: the updates that follow come after ``from_sequence``.

    ``compacted`` is set on the reply to a history request that the server's
    history no longer reaches: the oldest sequence it still holds.  No update
    follows then, only KTHXBAI.
    """

    from_sequence: int
    compacted: int | None = None


def _check_sequence(sequence: int) -> None:
    if not 0 <= sequence <= _MAX_SEQUENCE:
        raise ValueError(f"sequence {sequence} is outside 0..2**64-1")


def since_metadata(sequence: int, digest: bytes | None = None) -> bytes:
    """The ``ZMQ_METADATA`` option value that asks for a delta after ``sequence``.

    Without ``digest``: a history request (every update after ``sequence``).
    """
    _check_sequence(sequence)
    if digest is None:
        return f"{SINCE_PROPERTY}:{sequence}".encode()
    if len(digest) != SINCE_DIGEST_BYTES:
        raise ValueError(f"digest of {len(digest)} bytes, expected {SINCE_DIGEST_BYTES}")
    return f"{SINCE_PROPERTY}:{sequence},{digest.hex()}".encode()


def since_term_metadata(term: int) -> bytes:
    """The ``ZMQ_METADATA`` option value that names the term of the last
    update of a catch-up request (set beside :func:`since_metadata`'s)."""
    _check_sequence(term)
    return f"{SINCE_TERM_PROPERTY}:{term}".encode()


def _decimal(text: str, what: str) -> int:
    """One decimal number in 0..2**64-1, or ProtocolError naming ``what``."""
    # isascii() first: str.isdigit() accepts digits of other scripts.
    if not (text.isascii() and text.isdigit()) or len(text) > _MAX_SEQUENCE_DIGITS:
        raise ProtocolError(f"{what} {text[:30]!r} is not a decimal number")
    number = int(text)
    if number > _MAX_SEQUENCE:
        raise ProtocolError(f"{what} {number} is over 2**64-1")
    return number


def parse_since_term(value: str) -> int:
    """Parse an ``X-CHP-Since-Term`` value (one decimal in 0..2**64-1);
    ProtocolError if malformed."""
    return _decimal(value, SINCE_TERM_PROPERTY)


def parse_since(value: str) -> SinceRequest:
    """Parse an ``X-CHP-Since`` metadata value; ProtocolError if malformed.

    Strict, because a misread sequence would silently skip updates: one
    decimal sequence in 0..2**64-1, then either nothing (a history request)
    or one comma and exactly 16 hex digits.
    """
    parts = value.split(",")
    if len(parts) > 2:
        raise ProtocolError(f"{SINCE_PROPERTY} {value[:60]!r} is not '<sequence>[,<digest>]'")
    sequence = _decimal(parts[0], f"{SINCE_PROPERTY} sequence")
    if len(parts) == 1:
        return SinceRequest(sequence)
    hex_text = parts[1]
    # Checked by hand: bytes.fromhex() would skip whitespace.
    if len(hex_text) != 2 * SINCE_DIGEST_BYTES or not _HEX.issuperset(hex_text):
        raise ProtocolError(
            f"{SINCE_PROPERTY} digest {hex_text[:40]!r} is not {2 * SINCE_DIGEST_BYTES} hex digits"
        )
    return SinceRequest(sequence, bytes.fromhex(hex_text))


def update_digest(frames: Sequence[bytes]) -> bytes:
    """An 8-byte digest of one update's 5 frames (KVPUB or KVSYNC).

    Each frame is preceded by its length, so that moving bytes between
    frames changes the digest.  Not a security measure: it guards against
    two servers' histories that diverged at the same sequence.
    """
    if len(frames) != _UPDATE_FRAMES:
        raise ValueError(f"an update has {_UPDATE_FRAMES} frames, not {len(frames)}")
    h = hashlib.blake2b(digest_size=SINCE_DIGEST_BYTES)
    for frame in frames:
        h.update(len(frame).to_bytes(4, "big"))
        h.update(frame)
    return h.digest()


def encode_kvdelta(from_sequence: int, compacted: int | None = None) -> list[bytes]:
    """The KVDELTA that announces the updates after ``from_sequence``.

    ``compacted``: the history request cannot be answered; this is the oldest
    sequence the history still holds.
    """
    _check_sequence(from_sequence)
    if compacted is None:
        return [KVDELTA, from_sequence.to_bytes(8, "big"), b""]
    _check_sequence(compacted)
    props = encode_properties(((COMPACTED_PROPERTY, str(compacted)),))
    return [KVDELTA, from_sequence.to_bytes(8, "big"), props]


def is_kvdelta(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` claim to be a KVDELTA (decode to know if it is one).

    Any message headed KVDELTA that is not five frames long: a KVSYNC for the
    key ``KVDELTA`` has five, and a malformed KVDELTA must still be taken for
    one (and refused), never for a snapshot entry.
    """
    return frames[0] == KVDELTA and len(frames) != 5


def decode_kvdelta(frames: Sequence[bytes]) -> int:
    """The ``from_sequence`` of a KVDELTA; ProtocolError on anything else."""
    return decode_kvdelta_head(frames).from_sequence


def decode_kvdelta_head(frames: Sequence[bytes]) -> DeltaHead:
    """A KVDELTA with its properties; ProtocolError on anything else.

    Unknown properties are ignored; ``compacted`` must be a decimal sequence.
    """
    if len(frames) != DELTA_FRAMES or frames[0] != KVDELTA:
        raise ProtocolError(f"not a KVDELTA: {len(frames)} frames")
    _, seq, props = frames
    if len(seq) != 8:
        raise ProtocolError(f"KVDELTA sequence frame of {len(seq)} bytes, expected 8")
    compacted: int | None = None
    for name, value in decode_properties(bytes(props)):
        if name != COMPACTED_PROPERTY:
            continue
        if (
            not (value.isascii() and value.isdigit())
            or len(value) > _MAX_SEQUENCE_DIGITS
            or int(value) > _MAX_SEQUENCE
        ):
            raise ProtocolError(f"KVDELTA {COMPACTED_PROPERTY}={value[:30]!r} is not a sequence")
        compacted = int(value)
    return DeltaHead(int.from_bytes(seq, "big"), compacted)
