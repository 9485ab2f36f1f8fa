"""The one way the server sends: a send, then a look at what it may have hidden.

Why this module exists: the server's sockets are read by ZMQStreams, which
wake on the edge of the socket's file descriptor.  A send made outside the
stream's own callback (a timer, another socket's callback, a loop callback)
can consume that edge; the stream then never wakes for a message that came
in meanwhile, and one unread message stops libzmq signalling the ones after
it (seen: requests waiting 10 s, until something else stirred the socket).
The remedy is to look at the socket's backlog after sending.  It was added
by hand, after a bug each time, in five places; here it is done once:

- :func:`send` sends one message and then calls ``backlog``;
- :class:`Burst` sends many and calls ``backlog`` once, at its end, if it
  tried to send at all (even a send that found the pipe full or the peer
  unroutable may have consumed the edge);
- :func:`send_via_stream` sends through a ZMQStream, which looks at the
  socket's events itself.

``backlog`` is required, by keyword: a caller whose socket has nothing to
read (a PUB), or who sends from inside that socket's own stream callback
(the stream looks again when the callback returns), passes ``None`` and the
call site says which.  ``tests/server/test_sending.py`` fails if a raw send
appears anywhere else in ``clone/server``.

EAGAIN (the peer's pipe is full, with ``NOBLOCK``) and EHOSTUNREACH (a
ROUTER's peer is gone) are outcomes, not errors: :class:`Sent` says which.
Any other ZMQError is raised.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, MutableSequence, Sequence
from types import TracebackType
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from clone.wire.frames import NOBLOCK, send_frames, send_tracked

__all__ = ["Backlog", "Burst", "Sent", "send", "send_via_stream"]

Backlog = Callable[[], None] | None
"""Looks at a socket's backlog after a send; ``None``: nothing to look at."""


class Sent(enum.Enum):
    """What became of a send."""

    OK = "ok"
    FULL = "full"  # EAGAIN: the peer's pipe is full (NOBLOCK only)
    GONE = "gone"  # EHOSTUNREACH: a ROUTER's peer is not routable


def _send(
    sock: zmq.Socket[Any],
    frames: Sequence[bytes],
    flags: int,
    trackers: MutableSequence[zmq.MessageTracker] | None,
) -> Sent:
    try:
        if trackers is None:
            send_frames(sock, frames, flags)
        else:
            trackers.append(send_tracked(sock, frames, flags))
    except zmq.Again:
        return Sent.FULL
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return Sent.GONE
        raise
    return Sent.OK


def send(
    sock: zmq.Socket[Any],
    frames: Sequence[bytes],
    *,
    backlog: Backlog,
    flags: int = NOBLOCK,
) -> Sent:
    """Send one message on ``sock``, then call ``backlog`` (whatever the
    outcome: a failed send may have consumed the edge too)."""
    try:
        return _send(sock, frames, flags, None)
    finally:
        if backlog is not None:
            backlog()


class Burst:
    """Many sends on one socket, one look at its backlog at the end.

    Use as a context manager; the look happens on leaving it, only if a send
    was tried (a turn that sent nothing consumed no edge), and also when the
    block leaves by an exception.
    """

    def __init__(self, backlog: Backlog) -> None:
        self._backlog = backlog
        self.tried = False

    def send(
        self,
        sock: zmq.Socket[Any],
        frames: Sequence[bytes],
        *,
        flags: int = NOBLOCK,
        trackers: MutableSequence[zmq.MessageTracker] | None = None,
    ) -> Sent:
        """Send one message; with ``trackers``, the last frame is sent
        without a copy and its tracker appended there."""
        self.tried = True
        return _send(sock, frames, flags, trackers)

    def __enter__(self) -> Burst:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.tried and self._backlog is not None:
            self.tried = False
            self._backlog()


def send_via_stream(stream: ZMQStream, frames: Sequence[bytes]) -> None:
    """Send through the stream: it queues the message and looks at the
    socket's events after the send, so nothing incoming is hidden.  Not
    free (seen: 256 of them took 0.3 s on a starved machine)."""
    stream.send_multipart(list(frames))
