"""KVAPPLIED, our extension of CHP: which updates a snapshot already holds.

How this works: a passive server parks the client updates it receives until the
active server republishes them.  After a restart it syncs a snapshot, and a
snapshot holds only the *last* update of each key: an update that the active
applied and then superseded before the snapshot leaves no trace in it, so the
passive cannot tell it from one the active never received.  Applying such an
update at a promotion would put an old value back (docs/failover.md, "Pending
updates").  So a passive that asks for it (ZMTP metadata ``X-CHP-Applied:1`` on
its sync DEALER) gets, ahead of the snapshot's entries, the ids of the updates
the active applied up to the snapshot's sequence, as far back as its
deduplication window reaches::

    [b"KVAPPLIED", sequence, properties, ids]

``sequence`` is the snapshot's (8 bytes, big-endian, as in KTHXBAI); ``ids`` is
16-byte uuids joined, oldest first, at most ``MAX_APPLIED_IDS`` per message (a
window of 65,536 ids is sixteen messages).  ``properties`` says how far back the
list reaches: ``span_ms=N``, every update the sender applied in the last N
milliseconds of its clock is listed, or ``span_ms=all``, every update it ever
applied is (its window never overflowed).  Only a duration crosses the wire, so
the two servers' clocks need not agree.  An active server adds ``fork=N``: the
sequence it had applied when it became active.  A requester that was active
at the same time (a split brain) and now steps down forwards the writes it
confirmed after N, which the sender cannot hold (docs/failover.md, "Writes of
a split brain").
Update ids that are not uuids (a Guide-style KVSET without one) are not listed.

Like :mod:`clone.wire.codec`, the decoder is total: it returns a message or raises
:class:`~clone.errors.ProtocolError`.  Guide peers never see KVAPPLIED: it is
sent only to requesters that set the metadata, and only our servers do.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from clone.errors import ProtocolError
from clone.wire.codec import decode_properties
from clone.wire.protocol import KVAPPLIED, MAX_APPLIED_IDS

__all__ = [
    "APPLIED_FRAMES",
    "UUID_BYTES",
    "AppliedIds",
    "decode_kvapplied",
    "encode_kvapplied",
    "is_kvapplied",
    "uuid_ids",
]

#: Frames in a KVAPPLIED as its receiver sees it (no ROUTER identity).
APPLIED_FRAMES = 4
UUID_BYTES = 16
_SPAN = "span_ms"
_FORK = "fork"


@dataclass(frozen=True, slots=True)
class AppliedIds:
    """One KVAPPLIED message: ids applied up to ``sequence``, reaching back
    ``span`` seconds before it was sent (``math.inf``: all of them)."""

    sequence: int
    span: float
    ids: tuple[bytes, ...]
    #: The sequence the sender had applied when it became active, if it said.
    fork: int | None = None


def encode_kvapplied(
    sequence: int, ids: Sequence[bytes], span: float, fork: int | None = None
) -> list[list[bytes]]:
    """The KVAPPLIED messages for ``ids`` (uuids only, oldest first).

    Always at least one message, so the receiver learns the span even of an
    empty list.  ``fork``: the sequence the sender became active at, if active.
    """
    if span < 0:
        raise ValueError(f"span must not be negative, not {span}")
    if fork is not None and fork < 0:
        raise ValueError(f"fork must not be negative, not {fork}")
    seq = sequence.to_bytes(8, "big")
    reach = b"all" if math.isinf(span) else b"%d" % round(span * 1000)
    props = b"%s=%s\n" % (_SPAN.encode(), reach)
    if fork is not None:
        props += b"%s=%d\n" % (_FORK.encode(), fork)
    out = []
    for start in range(0, max(len(ids), 1), MAX_APPLIED_IDS):
        out.append([KVAPPLIED, seq, props, b"".join(ids[start : start + MAX_APPLIED_IDS])])
    return out


def uuid_ids(ids: Iterable[object]) -> list[bytes]:
    """The ids that are 16-byte uuids, in order (others cannot be listed)."""
    return [i for i in ids if type(i) is bytes and len(i) == UUID_BYTES]


def is_kvapplied(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` claim to be a KVAPPLIED (decode to know if it is one)."""
    return len(frames) == APPLIED_FRAMES and frames[0] == KVAPPLIED


def decode_kvapplied(frames: Sequence[bytes]) -> AppliedIds:
    """Parse and check a KVAPPLIED; raises ProtocolError on anything else."""
    if len(frames) != APPLIED_FRAMES or frames[0] != KVAPPLIED:
        raise ProtocolError(f"not a KVAPPLIED: {len(frames)} frames")
    _, seq, props, raw = frames
    if len(seq) != 8:
        raise ProtocolError(f"KVAPPLIED sequence frame of {len(seq)} bytes, expected 8")
    properties = decode_properties(props)
    spans = [v for n, v in properties if n == _SPAN]
    if len(spans) != 1 or not (spans[0].isdigit() or spans[0] == "all") or len(spans[0]) > 15:
        raise ProtocolError(
            f"KVAPPLIED needs one {_SPAN} property (milliseconds or 'all'), got {props[:80]!r}"
        )
    span = math.inf if spans[0] == "all" else int(spans[0]) / 1000.0
    if len(raw) % UUID_BYTES:
        raise ProtocolError(f"KVAPPLIED ids frame of {len(raw)} bytes is not a multiple of 16")
    count = len(raw) // UUID_BYTES
    if count > MAX_APPLIED_IDS:
        raise ProtocolError(f"KVAPPLIED with {count} ids, over the limit of {MAX_APPLIED_IDS}")
    ids = tuple(raw[i : i + UUID_BYTES] for i in range(0, len(raw), UUID_BYTES))
    forks = [v for n, v in properties if n == _FORK]
    if len(forks) > 1 or (forks and not (forks[0].isdigit() and len(forks[0]) <= 20)):
        raise ProtocolError(f"KVAPPLIED {_FORK} must be one sequence, got {props[:80]!r}")
    fork = int(forks[0]) if forks else None
    return AppliedIds(int.from_bytes(seq, "big"), span, ids, fork)
