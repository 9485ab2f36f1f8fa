"""How the server opens its sockets: our defaults, CURVE, streams on our loop.

Why a module of its own: every part that opens a socket (the follower, the
healer's DEALER, a relay's link, the publisher's port) needs the same three
things: linger 0 and the size caps, CURVE set up as the security part says
(a server socket only while the ZAP handler runs), and a stream on the
server's loop whose handler is guarded, so that a bug is logged and counted,
never fatal.  :class:`ServerSockets` does them once; parts see it through the
narrow :class:`~clone.server.shared.Sockets` protocol.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

from clone.server.security import Security
from clone.wire.frames import cap_message_size

__all__ = ["ServerSockets"]

log = logging.getLogger("clone.server.reactor")

_F = TypeVar("_F", bytes, zmq.Frame)


class ServerSockets:
    """The server's sockets and streams (:class:`~clone.server.shared.Sockets`).

    ``loop`` is set when the server runs; every stream opened is closed by
    :meth:`close` at the server's stop, whatever part opened it.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        security: Security,
        counters: dict[str, int],
        handshake_timeout: float | None = None,
    ) -> None:
        self._ctx = ctx
        # Bound sockets close a connection whose handshake has not finished
        # in this long (None: libzmq's 30 s).  A connection our door refused
        # with a temporary status (the flood penalty) gets no word and, in
        # libzmq, waits for this timer: 30 s of a descriptor per refusal.
        self._handshake_ms = None if handshake_timeout is None else int(handshake_timeout * 1000)
        self._security = security
        self._counters = counters
        self.loop: IOLoop | None = None
        self._streams: list[ZMQStream] = []
        # Each stream's guarded handler and copy flag, to read it again after a pause.
        self._handlers: dict[ZMQStream, tuple[Callable[[list[Any]], None], bool]] = {}
        self._paused = False

    def socket(self, kind: int, *, bound: bool = False) -> zmq.Socket[Any]:
        """A socket with our defaults; with CURVE on, set up as a server if
        ``bound``, else as a client of the peer (clone.server.security)."""
        sock: zmq.Socket[Any] = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind not in (zmq.PUB, zmq.XPUB):
            cap_message_size(sock)
        if bound and self._handshake_ms is not None:
            sock.setsockopt(zmq.HANDSHAKE_IVL, self._handshake_ms)
        self._security.secure(sock, bound=bound)
        return sock

    def stream(
        self, sock: zmq.Socket[Any], handler: Callable[[list[_F]], None], *, copy: bool = True
    ) -> ZMQStream:
        """``handler`` gets bytes, or ``zmq.Frame``s with ``copy=False``."""
        assert self.loop is not None
        stream = ZMQStream(sock, self.loop)
        guarded = self.guard(handler)
        self._handlers[stream] = (guarded, copy)
        if not self._paused:
            stream.on_recv(guarded, copy=copy)
        self._streams.append(stream)
        return stream

    def pause(self) -> None:
        """Read none of our streams until :meth:`resume`: what gathered
        behind the commit in flight passed its bound, or a commit failed
        (clone.server.gathering).  Binary Star's sockets and the publisher
        are not ours: the heartbeat and the pair's link go on."""
        if self._paused:
            return
        self._paused = True
        for stream in self._streams:
            stream.stop_on_recv()

    def resume(self) -> None:
        """Read every stream again (what arrived meanwhile is read at once)."""
        if not self._paused:
            return
        self._paused = False
        for stream in self._streams:
            how = self._handlers.get(stream)  # None: held for good (stop_reading)
            if how is not None and not stream.closed():
                stream.on_recv(how[0], copy=how[1])

    def stop_reading(self, sock: zmq.Socket[Any]) -> None:
        """Read ``sock`` no more, even after a :meth:`resume` (a handover
        holds the collector: clone.server.handover); it stays open."""
        for stream in self._streams:
            if stream.socket is sock:
                self._handlers.pop(stream, None)
                stream.stop_on_recv()

    def guard(self, handler: Callable[[list[_F]], None]) -> Callable[[list[_F]], None]:
        """Wrap a socket handler so that a bug is logged, never fatal."""
        counters = self._counters

        def guarded(frames: list[_F]) -> None:
            try:
                handler(frames)
            except Exception:
                counters["internal_errors"] += 1
                log.exception("internal error in %s", handler.__name__)

        return guarded

    def forget(self, stream: ZMQStream) -> None:
        """Stop reading ``stream`` and close its socket."""
        if stream in self._streams:
            self._streams.remove(stream)
        self._handlers.pop(stream, None)
        stream.close(linger=0)

    def close(self) -> None:
        """Close every stream still open (the server stops)."""
        for stream in self._streams:
            stream.close(linger=0)
        self._streams.clear()
        self._handlers.clear()
