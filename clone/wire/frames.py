"""Sending and receiving CHP messages on pyzmq's fast paths, with the caps.

How this works: the hot paths (a server's collector and publisher, a snapshot
stream, a client's subscription, the benchmark's sinks) call libzmq through
pyzmq's backend methods with plain int flags.  The sugar layer's enum
arithmetic and per-frame checks cost about three times more than the send
itself (measured: 8.8 us vs 2.9 us per 5-frame send).  A message is received
as zero-copy frames only to read ``Frame.more``: asking RCVMORE with
``Socket.get`` builds a ``SocketOption`` enum per call in pyzmq 27 (9.0 us vs
5.0 us per 5-frame message).

The caps keep a broken or hostile peer from making us allocate without limit:
:func:`cap_message_size` sets ``MAXMSGSIZE`` (libzmq drops a peer that sends a
larger frame before anything is allocated), and :func:`recv_frames` keeps at
most :data:`MAX_FRAMES` frames of a message (the rest is consumed and dropped;
the codec then rejects the message).  No other module needs these tricks.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

from clone.wire.protocol import MAX_BATCH_BYTES, MAX_VALUE_BYTES

__all__ = [
    "RESEND_MS",
    "Offers",
    "offer_frames",
    "MAX_FRAME_BYTES",
    "MAX_FRAMES",
    "MAX_SYNC_FRAME_BYTES",
    "NOBLOCK",
    "POLLIN",
    "cap_message_size",
    "recv_frames",
    "recv_frames_and_first",
    "recv_monitor_event",
    "recv_zero_copy",
    "send_frames",
    "send_tracked",
    "shared_frame",
]

#: The largest frame any CHP message but a KVBATCH may carry, with slack: a
#: value plus room for the other frames.  The codec still checks exact limits.
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 64 * 1024
#: The same for a socket that receives KVBATCHes (a snapshot DEALER).
MAX_SYNC_FRAME_BYTES = MAX_BATCH_BYTES + 64 * 1024
#: No CHP message has more than ten frames (a KVBATCH; a KVSYNC is five, six
#: with a ROUTER identity); a longer one is kept this short.
MAX_FRAMES = 12

NOBLOCK = int(zmq.NOBLOCK)
POLLIN = int(zmq.POLLIN)
_SNDMORE = int(zmq.SNDMORE)
_raw_send = _BackendSocket.send
_raw_recv = _BackendSocket.recv


def cap_message_size(sock: zmq.Socket[Any], limit: int = MAX_FRAME_BYTES) -> None:
    """Make libzmq drop a peer that sends a frame over ``limit`` bytes."""
    sock.setsockopt(zmq.MAXMSGSIZE, limit)


def send_frames(sock: zmq.Socket[Any], frames: Sequence[bytes], flags: int = 0) -> None:
    """send_multipart without the sugar.  With :data:`NOBLOCK`, EAGAIN and
    EHOSTUNREACH can only come from the first frame: a multipart message is
    atomic once its first part is queued."""
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        _raw_send(sock, frame, more)
    _raw_send(sock, frames[-1], flags)


#: How often a request no connection has taken yet is offered again (ms).
RESEND_MS = 50


def offer_frames(sock: zmq.Socket[Any], frames: Sequence[bytes]) -> bool:
    """Queue ``frames`` without blocking; whether a connection took them.

    A client's DEALER normally queues a request until its connection is
    made, but after a handshake the server refused (CURVE keys it does not
    know, or none) libzmq may hold no connection at all to queue it on, and
    a send raises ``Again``: the caller offers the request again while it
    waits, and calls the server unreachable if none ever took it."""
    try:
        send_frames(sock, frames, NOBLOCK)
    except zmq.Again:
        return False
    return True


class Offers:
    """One request to several DEALERs, offered again to those that have not
    taken it (:func:`offer_frames`) at every poll of the caller's wait loop.

    The CLI's one-shot askers (``clone status``, ``clone conflicts``, the
    diagnosis behind "not synced") share this: each sends the same request
    to every server and waits for the replies; a server whose refused
    handshake left no connection is offered it again every
    :data:`RESEND_MS` and, if none ever took it, is in :attr:`unsent` at the
    end (reported unreachable, with why)."""

    __slots__ = ("request", "unsent")

    def __init__(self, request: Sequence[bytes]) -> None:
        self.request = request
        #: Sockets no connection has taken the request on yet.
        self.unsent: set[zmq.Socket[Any]] = set()

    def offer(self, sock: zmq.Socket[Any]) -> None:
        """The first offer (right after ``connect``): kept for later if not taken."""
        if not offer_frames(sock, self.request):
            self.unsent.add(sock)

    def poll_ms(self, left: float) -> int:
        """Offer again where not taken yet; how long the caller's poll may
        wait of the ``left`` seconds (at most :data:`RESEND_MS` while any
        request is still unsent, so that it is offered again soon)."""
        request = self.request
        self.unsent = {sock for sock in self.unsent if not offer_frames(sock, request)}
        wait_ms = max(1, round(left * 1000))
        return min(wait_ms, RESEND_MS) if self.unsent else wait_ms


def shared_frame(data: bytes) -> bytes | zmq.Frame:
    """``data`` to be sent many times (a snapshot encoded once for many
    requesters): from :data:`zmq.COPY_THRESHOLD` (64 KiB) on, a Frame, which
    every send passes to libzmq by reference (``zmq_msg_copy``), no copy;
    :func:`send_tracked` makes its tracked last frame a view of it."""
    return zmq.Frame(data, copy=False) if len(data) >= zmq.COPY_THRESHOLD else data


def send_tracked(sock: zmq.Socket[Any], frames: Sequence[bytes], flags: int) -> zmq.MessageTracker:
    """:func:`send_frames`, the last frame without a copy and tracked: the
    tracker is done once libzmq has written the whole message out (or dropped
    it with its connection)."""
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        _raw_send(sock, frame, more)
    # A Frame of our own: given bytes under zmq.COPY_THRESHOLD (64 KiB), pyzmq
    # copies them and returns a tracker that is already done, so a 60 KiB
    # KVSYNC looked written the moment it was queued.
    last = zmq.Frame(frames[-1], track=True, copy=False)
    _raw_send(sock, last, flags, copy=False, track=True)
    tracker: zmq.MessageTracker | None = last.tracker
    assert tracker is not None
    return tracker


def recv_frames_and_first(
    sock: zmq.Socket[Any], flags: int = NOBLOCK
) -> tuple[zmq.Frame, list[bytes]]:
    """As :func:`recv_frames`, and the first frame itself, whose connection
    metadata (a CURVE client's ``User-Id``) only a frame can tell."""
    first = frame = _raw_recv(sock, flags, False)
    parts: list[bytes] = [frame.bytes]
    while frame.more:
        frame = _raw_recv(sock, flags, False)
        if len(parts) < MAX_FRAMES:
            parts.append(frame.bytes)
    return first, parts


def recv_zero_copy(sock: zmq.Socket[Any], flags: int = NOBLOCK) -> list[zmq.Frame]:
    """``recv_multipart(flags, copy=False)`` without its ``RCVMORE`` option
    read per frame (each an enum conversion in pyzmq): the frame says whether
    more follow.  Every frame is kept, as recv_multipart keeps them."""
    frame = _raw_recv(sock, flags, False)
    parts = [frame]
    while frame.more:
        frame = _raw_recv(sock, flags, False)
        parts.append(frame)
    return parts


def recv_frames(sock: zmq.Socket[Any], flags: int = NOBLOCK) -> list[bytes]:
    """One whole message, at most :data:`MAX_FRAMES` frames of it kept.

    Non-blocking by default (raises ``zmq.Again`` when there is none).
    """
    frame = _raw_recv(sock, flags, False)
    parts: list[bytes] = [frame.bytes]
    while frame.more:
        frame = _raw_recv(sock, flags, False)
        if len(parts) < MAX_FRAMES:
            parts.append(frame.bytes)
    return parts


#: A socket monitor event's first frame (zmq_socket_monitor(3)): a 16-bit event
#: and a 32-bit value, native order, no padding.
_MONITOR_HEAD = struct.Struct("=hi")


def recv_monitor_event(monitor: zmq.Socket[Any], flags: int = NOBLOCK) -> dict[str, Any]:
    """One event from a socket monitor, as pyzmq's ``recv_monitor_message``
    gives it (``event``, ``value``, ``endpoint``), read here because
    ``zmq.utils.monitor`` imports ``zmq.asyncio`` and with it asyncio, part of
    the 20-30 ms of every ``clone`` command's start this saved
    (docs/benchmarks.md), for an event loop the client never runs.
    Raises ``zmq.Again`` when there is none and ``RuntimeError`` for a message
    that is not a monitor event."""
    msg = recv_frames(monitor, flags)
    if len(msg) != 2 or len(msg[0]) != _MONITOR_HEAD.size:
        raise RuntimeError(f"not a socket monitor event: {len(msg)} frames")
    event, value = _MONITOR_HEAD.unpack(msg[0])
    return {"event": zmq.Event(event), "value": value, "endpoint": msg[1]}
