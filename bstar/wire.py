"""Wire format of the Binary Star state messages.

A state message is one frame holding the sender's state as an ASCII decimal
integer, exactly as the ZeroMQ Guide's bstar peers send it: ``b"1"`` PRIMARY,
``b"2"`` BACKUP, ``b"3"`` ACTIVE, ``b"4"`` PASSIVE. Keeping the Guide's numbering
lets one of our servers pair with a Guide implementation.

:func:`decode_state` returns a :class:`~bstar.fsm.State` or raises
:class:`~bstar.errors.PeerStateError`, for any input whatsoever.
"""

from __future__ import annotations

from collections.abc import Sequence

from bstar.errors import PeerStateError
from bstar.fsm import State

__all__ = ["MAX_STATE_FRAME", "decode_state", "encode_state"]

#: Longest frame worth parsing; a valid one is a single digit, but we tolerate a
#: little padding such as a C string's trailing NUL.
MAX_STATE_FRAME = 8


def encode_state(state: State) -> list[bytes]:
    """The frames announcing ``state`` to the peer."""
    return [b"%d" % state.value]


def decode_state(frames: Sequence[bytes], source: str = "peer") -> State:
    """Parse one state message received from ``source``."""
    if len(frames) != 1:
        raise PeerStateError(f"expected 1 frame, got {len(frames)}", source)
    frame = bytes(frames[0])
    if len(frame) > MAX_STATE_FRAME:
        raise PeerStateError(f"frame too long ({len(frame)} bytes)", source)
    # Some C peers send the string with its terminating NUL; accept that.
    text = frame.rstrip(b"\0")
    if not text.isdigit():
        raise PeerStateError(f"not a decimal state number: {frame!r}", source)
    try:
        return State(int(text))
    except ValueError:
        raise PeerStateError(f"unknown state number {int(text)}", source) from None
