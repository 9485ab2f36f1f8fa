"""The frontend's command pipe to its agent thread: strict request/reply, bounded.

Two inproc PAIR pipes join a :class:`~clone.client.frontend.Clone` to its agent:
this one carries commands (one caller at a time, under :attr:`CommandPipe.lock`,
every wait bounded by ``timeout``), the other carries events, which the agent
writes without ever blocking (:mod:`clone.client.events` reads them).  A
command the agent does not take or answer in time raises
:class:`~clone.errors.AgentTimeout`, a ``TimeoutError`` like every other wait;
time this process did not run meanwhile (:data:`FROZEN_S`) does not count: a
status() call in flight when the process was stopped for 10 s, with its
answer in the pipe or a moment away, raised it at SIGCONT.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time

import zmq

from clone.client import verbs
from clone.errors import AgentTimeout, CloneError, ClosedError

__all__ = ["FROZEN_S", "PIPE_HWM", "CommandPipe"]

log = logging.getLogger(__name__)

# Commands queued for the agent at most; a writer that gets ahead waits.
PIPE_HWM = 10_000
#: A wait for the agent's answer that came back this much (s) later than it
#: was asked to was a freeze of this process, its agent's too: the agent gets
#: its whole timeout again (as the agent's freeze_gap does not blame the
#: server for our own freeze).
FROZEN_S = 1.0

_Socket = zmq.Socket[bytes]


def _pair(
    ctx: zmq.Context[_Socket], address: str, hwm: int, timeout: float
) -> tuple[_Socket, _Socket]:
    front = ctx.socket(zmq.PAIR)
    back = ctx.socket(zmq.PAIR)
    for sock in (front, back):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.RCVHWM, hwm)
    if hwm:
        front.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
    front.bind(address)
    back.connect(address)
    return front, back


class CommandPipe:
    """Both pipes' sockets, and the command side's request/reply.

    ``stopped`` is set (by the event dispatcher) when the agent said it stopped:
    a command that then goes unanswered is a :class:`~clone.errors.ClosedError`.
    """

    def __init__(self, ctx: zmq.Context[_Socket], number: int, timeout: float) -> None:
        # Commands are bounded, so a writer cannot outrun the agent without
        # limit; events are not, so the agent never blocks on a slow reader.
        self.commands = _pair(ctx, f"inproc://clone-{number}-commands", PIPE_HWM, timeout)
        self.events = _pair(ctx, f"inproc://clone-{number}-events", 0, timeout)
        self.timeout = timeout
        self.lock = threading.Lock()  # the command pipe, one caller at a time
        self.closed = False
        self.stopped = threading.Event()
        self._rids = itertools.count(1)

    def request(self, verb: bytes, args: list[bytes]) -> list[bytes]:
        with self.lock:
            if self.closed:
                raise ClosedError("this Clone client is closed")
            return self.request_locked(verb, args, self.timeout)

    def request_locked(self, verb: bytes, args: list[bytes], timeout: float) -> list[bytes]:
        pipe = self.commands[0]
        rid = str(next(self._rids)).encode()
        try:
            pipe.send_multipart([verb, rid, *args])
        except zmq.Again:
            raise AgentTimeout(
                f"the client agent did not take {verb.decode()} within {timeout:g} s"
            ) from None
        last = time.monotonic()
        deadline = last + timeout
        while True:
            wait = max(0, int((deadline - last) * 1000))
            ready = pipe.poll(wait)
            now = time.monotonic()
            overshoot, last = now - last - wait / 1000, now
            if not ready and overshoot > FROZEN_S:
                # This process did not run (SIGSTOP, a starved host) while we
                # waited, and neither did its agent: it gets its whole time
                # again from now.
                deadline = now + timeout
                continue
            if not ready:
                if self.stopped.is_set():
                    raise ClosedError("the client agent has stopped")
                raise AgentTimeout(
                    f"the client agent did not answer {verb.decode()} within {timeout:g} s"
                )
            reply = pipe.recv_multipart()
            if len(reply) >= 2 and reply[1] == rid:
                break
            log.debug("dropped a late agent reply %r", reply[:2])
        if reply[0] != verbs.OK:
            text = reply[2].decode("utf-8", "replace") if len(reply) > 2 else "?"
            raise CloneError(f"client agent refused {verb.decode()}: {text}")
        return reply[2:]

    def send_oneway(self, verb: bytes, args: list[bytes]) -> None:
        """A command the agent does not answer: writes stream without a round trip.

        The pipe is bounded (``PIPE_HWM``), so an application that writes faster
        than the agent can send waits here, for at most ``timeout``.
        """
        with self.lock:
            if self.closed:
                raise ClosedError("this Clone client is closed")
            try:
                self.commands[0].send_multipart([verb, b"", *args])
            except zmq.Again:
                raise AgentTimeout(
                    f"the client agent did not take {verb.decode()} within {self.timeout:g} s"
                ) from None

    def close_front(self) -> None:
        """Close the frontend's ends (the agent closes its own)."""
        self.commands[0].close(linger=0)
        self.events[0].close(linger=0)
