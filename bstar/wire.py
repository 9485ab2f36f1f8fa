"""Wire format of the Binary Star state messages.

A state message is one frame of ASCII text: the sender's state number, then a
colon and its election epoch in decimal, e.g. ``b"3:17"``. The state numbers are
the ZeroMQ Guide's: ``1`` PRIMARY, ``2`` BACKUP, ``3`` ACTIVE, ``4`` PASSIVE.

Why one frame and this shape: the Guide's bstar peers send the bare state number
(``b"3"``) and read ours with ``atoi``, which stops at the colon. So a Guide peer
still understands us, and we understand it: a message without an epoch decodes
with epoch 0, which no server of ours announces once it has been active.

:func:`decode_state` returns a :class:`PeerReport` or raises
:class:`~bstar.errors.PeerStateError`, for any input whatsoever.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bstar.errors import PeerStateError
from bstar.fsm import State

__all__ = ["MAX_EPOCH", "MAX_STATE_FRAME", "PeerReport", "decode_state", "encode_state"]

#: Most digits an epoch may have: enough for any 64-bit counter.
_EPOCH_DIGITS = 20
#: Largest epoch that fits the wire format.
MAX_EPOCH = 10**_EPOCH_DIGITS - 1
#: Longest frame worth parsing: a state digit, a colon and a 20-digit epoch, plus
#: a little padding such as a C string's trailing NUL.
MAX_STATE_FRAME = 1 + 1 + _EPOCH_DIGITS + 8


@dataclass(frozen=True, slots=True)
class PeerReport:
    """One decoded state message: the peer's state and epoch (0 if it sent none)."""

    state: State
    epoch: int = 0


def encode_state(state: State, epoch: int = 0) -> list[bytes]:
    """The frames announcing ``state`` at ``epoch`` to the peer, always as ``S:E``."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be between 0 and {MAX_EPOCH}, got {epoch}")
    return [b"%d:%d" % (state.value, epoch)]


def decode_state(frames: Sequence[bytes], source: str = "peer") -> PeerReport:
    """Parse one state message received from ``source``: ``S`` or ``S:E``."""
    if len(frames) != 1:
        raise PeerStateError(f"expected 1 frame, got {len(frames)}", source)
    frame = bytes(frames[0])
    if len(frame) > MAX_STATE_FRAME:
        raise PeerStateError(f"frame too long ({len(frame)} bytes)", source)
    # Some C peers send the string with its terminating NUL; accept that.
    text = frame.rstrip(b"\0")
    state_text, colon, epoch_text = text.partition(b":")
    # bytes.isdigit() is ASCII only, so no sign, space or non-ASCII digit gets in.
    if not state_text.isdigit():
        raise PeerStateError(f"not a decimal state number: {frame!r}", source)
    try:
        state = State(int(state_text))
    except ValueError:
        raise PeerStateError(f"unknown state number {int(state_text)}", source) from None
    if not colon:
        return PeerReport(state)  # a Guide peer: no epoch
    if not epoch_text.isdigit():
        raise PeerStateError(f"epoch is not a non-negative decimal number: {frame!r}", source)
    if len(epoch_text) > _EPOCH_DIGITS:
        raise PeerStateError(f"epoch has more than {_EPOCH_DIGITS} digits", source)
    return PeerReport(state, int(epoch_text))
