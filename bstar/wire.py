"""Wire format of the Binary Star state messages.

A state message is one frame of ASCII text: the sender's state number, then a
colon and its election epoch in decimal, e.g. ``b"3:17"``. A server that keeps
its data on disk appends its data rank, term and sequence, e.g. ``b"1:5:5:120"``
(``S:E:T:N``); an in-memory server sends no rank. The state numbers are the
ZeroMQ Guide's: ``1`` PRIMARY, ``2`` BACKUP, ``3`` ACTIVE, ``4`` PASSIVE.

Why one frame and this shape: the Guide's bstar peers send the bare state number
(``b"3"``) and read ours with ``atoi``, which stops at the first colon. So a
Guide peer still understands us, and we understand it: a message without an
epoch decodes with epoch 0, which no server of ours announces once it has been
active, and a message without a rank decodes with rank ``(0, 0)``, "no data or
unknown", which is what an in-memory server has to offer.

:func:`decode_state` accepts ``S``, ``S:E`` and ``S:E:T:N`` and returns a
:class:`PeerReport`, or raises :class:`~bstar.errors.PeerStateError`, for any
input whatsoever.  An epoch, term or sequence above :data:`MAX_EPOCH` (2**62)
raises :class:`~bstar.errors.PeerNumberOutOfRange` (a ``PeerStateError``): a
peer claiming one is refused, never obeyed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bstar.errors import PeerNumberOutOfRange, PeerStateError
from bstar.fsm import MAX_EPOCH, NO_RANK, Rank, State, check_rank

__all__ = [
    "MAX_EPOCH",
    "MAX_RANK_PART",
    "MAX_STATE_FRAME",
    "PeerReport",
    "check_wire_rank",
    "decode_state",
    "encode_state",
]

#: Most digits an epoch, a term or a sequence may have: enough for any 64-bit counter.
_NUMBER_DIGITS = 20
#: Largest term or sequence of a rank we send or accept (an epoch's bound,
#: :data:`bstar.fsm.MAX_EPOCH`, 2**62; the wire itself could carry 20 digits).
MAX_RANK_PART = MAX_EPOCH
#: Longest frame worth parsing: a state digit and three colons, each followed by
#: a 20-digit number, plus a little padding such as a C string's trailing NUL.
MAX_STATE_FRAME = 1 + 3 * (1 + _NUMBER_DIGITS) + 8


@dataclass(frozen=True, slots=True)
class PeerReport:
    """One decoded state message: the peer's state, epoch and data rank
    (0 and ``(0, 0)`` if it sent none)."""

    state: State
    epoch: int = 0
    rank: Rank = NO_RANK


def check_wire_rank(rank: object) -> Rank:
    """Return ``rank`` if it can be sent, else raise ``TypeError``/``ValueError``."""
    checked = check_rank(rank)
    if max(checked) > MAX_RANK_PART:
        raise ValueError(f"rank parts must be at most {MAX_RANK_PART}, got {checked!r}")
    return checked


def encode_state(state: State, epoch: int = 0, rank: Rank | None = None) -> list[bytes]:
    """The frames announcing ``state`` at ``epoch`` to the peer: ``S:E``, or
    ``S:E:T:N`` with a ``rank`` (term, sequence)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be between 0 and {MAX_EPOCH}, got {epoch}")
    if rank is None:
        return [b"%d:%d" % (state.value, epoch)]
    term, sequence = check_wire_rank(rank)
    return [b"%d:%d:%d:%d" % (state.value, epoch, term, sequence)]


def _number(text: bytes, what: str, frame: bytes, source: str) -> int:
    # bytes.isdigit() is ASCII only, so no sign, space or non-ASCII digit gets in.
    if not text.isdigit():
        raise PeerStateError(f"{what} is not a non-negative decimal number: {frame!r}", source)
    if len(text) > _NUMBER_DIGITS:
        raise PeerNumberOutOfRange(f"{what} has more than {_NUMBER_DIGITS} digits", source)
    number = int(text)
    if number > MAX_EPOCH:
        # Obeyed, it would make our next epoch too large to announce or store.
        raise PeerNumberOutOfRange(f"{what} {number} is above the maximum {MAX_EPOCH}", source)
    return number


def decode_state(frames: Sequence[bytes], source: str = "peer") -> PeerReport:
    """Parse one state message received from ``source``: ``S``, ``S:E`` or ``S:E:T:N``."""
    if len(frames) != 1:
        raise PeerStateError(f"expected 1 frame, got {len(frames)}", source)
    frame = bytes(frames[0])
    if len(frame) > MAX_STATE_FRAME:
        raise PeerStateError(f"frame too long ({len(frame)} bytes)", source)
    # Some C peers send the string with its terminating NUL; accept that.
    fields = frame.rstrip(b"\0").split(b":")
    state_text = fields[0]
    if not state_text.isdigit():
        raise PeerStateError(f"not a decimal state number: {frame!r}", source)
    try:
        state = State(int(state_text))
    except ValueError:
        raise PeerStateError(f"unknown state number {int(state_text)}", source) from None
    if len(fields) == 1:
        return PeerReport(state)  # a Guide peer: no epoch
    if len(fields) not in (2, 4):
        raise PeerStateError(
            f"expected S, S:E or S:E:T:N, got {len(fields)} fields: {frame!r}", source
        )
    epoch = _number(fields[1], "epoch", frame, source)
    if len(fields) == 2:
        return PeerReport(state, epoch)  # an in-memory server: no rank
    term = _number(fields[2], "rank term", frame, source)
    sequence = _number(fields[3], "rank sequence", frame, source)
    return PeerReport(state, epoch, (term, sequence))
