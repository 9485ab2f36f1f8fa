"""The publisher's door in plain mode: a ZAP handler that keeps penalized hosts out.

How this works: a socket with a ZAP domain has libzmq ask the handler bound at
``inproc://zeromq.zap.01`` in its context about every handshake, NULL
mechanism included.  Without CURVE no other handler runs there, so the server
gives only its publisher the domain :data:`PUBLISHER_DOMAIN` and runs this
one: it admits every handshake but one from an address under a flood penalty
(:class:`~clone.server.penalty.FloodPenalty`), which it refuses with status
300 (a temporary refusal, RFC 27: libzmq closes the connection without a
word, and the client retries later) before libzmq attaches the connection to
the socket -- so a refused connection costs the loop nothing
(clone.server.penalty says why that matters).  Under CURVE the Gatekeeper
(clone.security.zap) asks the same penalty.

A thread of its own with its own socket, so that the loop never waits for it
and it answers while the loop is busy.  A bug in the decision admits (the
plain publisher admits everyone anyway); the thread never dies of it.  Should
the thread be gone, libzmq admits (``ZAP_ENFORCE_DOMAIN`` is off in plain
mode), so a missing door never locks subscribers out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from clone.security.zap import PUBLISHER_DOMAIN, ZAP_ENDPOINT
from clone.server.wakeup import WakePipe

__all__ = ["PUBLISHER_DOMAIN", "PublisherDoor"]

log = logging.getLogger(__name__)


class PublisherDoor:
    """Answers ZAP requests in its own thread: 200 unless ``admits`` says no."""

    #: The longest one poll waits (a bound, not a pace: :meth:`stop` wakes it).
    poll_ms = 100

    def __init__(
        self,
        ctx: zmq.Context[Any],
        admits: Callable[[str, float], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ctx = ctx
        self._admits = admits
        self._clock = clock
        self._socket: zmq.Socket[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake: WakePipe | None = None

    def start(self) -> None:
        """Bind the ZAP endpoint (in this thread, so a conflict raises here) and
        start answering.  ``zmq.ZMQError`` if another handler is bound."""
        sock = self._ctx.socket(zmq.REP)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            sock.close(linger=0)
            raise
        self._socket = sock
        self._wake = WakePipe()
        self._thread = threading.Thread(target=self._run, name="clone-publisher-door",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop answering and close the socket; after the publisher is closed.
        The thread is woken at once, not at its poll's timeout."""
        self._stop.set()
        thread, self._thread = self._thread, None
        wake, self._wake = self._wake, None
        if wake is not None:
            wake.wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2.0)
        if wake is not None:
            wake.close()
        sock, self._socket = self._socket, None
        if sock is not None and not sock.closed:
            sock.close(linger=0)

    def _run(self) -> None:
        sock, wake = self._socket, self._wake
        assert sock is not None and wake is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake.fd, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(self.poll_ms))
                if self._stop.is_set() or not ready.get(sock):
                    continue
                request = sock.recv_multipart()
            except zmq.ZMQError:
                return  # closed under us: stopping
            try:
                sock.send_multipart(self.answer(request))
            except zmq.ZMQError:
                return

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply to one request (RFC 27): [version, request id,
        status, text, user id, metadata]."""
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"500",
                    b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address = request[:4]
        try:
            ok = self._admits(address.decode("ascii", "replace"), self._clock())
        except Exception:  # a bug must not close the door on everyone
            log.exception("publisher door: the flood penalty failed; admitting")
            ok = True
        if ok:
            return [version, request_id, b"200", b"OK", b"", b""]
        return [version, request_id, b"300", b"flood penalty", b"", b""]
