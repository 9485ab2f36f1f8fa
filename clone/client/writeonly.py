"""A client that only writes: no snapshot, no copy of the store, a reply per write.

How this works: :class:`Clone` keeps a replica of its subtree, so it asks the
active server for a snapshot before it writes; with a million keys and eight
Spark partitions that is eight copies of the store, the pressure issue 29
describes.  :class:`WriteOnlyClone` keeps nothing.  It subscribes to the
servers' HUGZ only (the active server sends them; no update reaches it) and
sends each write as a ``set`` CALL? on a DEALER to the active server's
snapshot port; the REPLY, sent after the update is committed, confirms it
(docs/protocol.md, "CALL?").  So it can write as soon as one HUGZ came in,
whatever the size of the store.

One I/O thread owns the sockets; :meth:`set_async` hands it each write over an
inproc pipe and gets a future, completed by that thread.  When the active
server falls silent for ``server_timeout`` or answers ``not-active``, the
writes not yet answered wait for the next server that sends HUGZ and are sent
to it again with the same uuid: the servers deduplicate by uuid, and a retried
``set`` is answered with the first one's sequence.  When no server has been
heard for ``dead_after`` seconds, every write not answered fails with
:class:`~clone.errors.NotActive` at once (and so does every new one until a
server is heard), so a loader learns that the pair is gone within seconds.

The decisions (which server, when a write is overdue, when the pair is dead)
live in :class:`WriteRouter`, which takes ``now`` and returns what to do; the
thread only moves frames.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from clone.argtypes import normalize_endpoint
from clone.client.agent import split_endpoint
from clone.errors import CloneError, ClosedError, ConfirmTimeout, NotActive, NotSynced
from clone.security import KeyPair, configure_client_socket
from clone.wire.calls import OP_SET, decode_reply, encode_call
from clone.wire.codec import new_uuid, validate_key
from clone.wire.protocol import HUGZ, PUBLISHER_OFFSET, SNAPSHOT_OFFSET, TTL_PROPERTY

__all__ = ["WriteOnlyClone", "WriteRouter"]

log = logging.getLogger(__name__)

_WRITE, _STOP = b"W", b"S"
_TICK_S = 0.05


@dataclass(slots=True)
class _Pending:
    frames: list[bytes]
    deadline: float
    sent_to: int | None = None


@dataclass(slots=True)
class WriteRouter:
    """Where each write goes and when it has failed; pure (``now`` is given).

    ``heard(i, now)``: server ``i`` sent HUGZ.  ``current``: the server writes
    go to (None: none is known active).  A server is active while heard within
    ``server_timeout``; the pair is dead when no server was heard for
    ``dead_after`` (counted from the start, or from the last HUGZ).
    """

    servers: int
    server_timeout: float
    dead_after: float
    started: float
    current: int | None = None
    last_heard: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.last_heard = [None] * self.servers

    def heard(self, index: int, now: float) -> bool:
        """Record a HUGZ; True when ``index`` becomes the current server."""
        self.last_heard[index] = now
        if self.current is None:
            self.current = index
            return True
        return False

    def not_active(self, index: int) -> None:
        """Server ``index`` said it is not active: stop writing to it."""
        self.last_heard[index] = None
        if self.current == index:
            self.current = None

    def tick(self, now: float) -> None:
        """Forget a current server silent for ``server_timeout``."""
        if self.current is not None:
            last = self.last_heard[self.current]
            if last is None or now - last > self.server_timeout:
                log.warning("server %d silent for %.1f s: waiting for an active one",
                            self.current, self.server_timeout)  # fmt: skip
                self.current = None

    def dead(self, now: float) -> bool:
        """No server heard for ``dead_after`` seconds."""
        heard = [t for t in self.last_heard if t is not None]
        last = max(heard) if heard else self.started
        return self.current is None and now - last > self.dead_after


class WriteOnlyClone:
    """Writes confirmed by the active server's reply; see the module docstring.

    The subset of :class:`clone.Clone` a loader needs: :meth:`wait_synced`
    (here: wait until an active server is known), :meth:`set_async` and
    :meth:`close`.
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        curve: tuple[KeyPair, bytes] | None = None,
        server_timeout: float = 2.5,
        confirm_timeout: float = 30.0,
        dead_after: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not servers:
            raise ValueError("no servers given")
        self._endpoints = [split_endpoint(normalize_endpoint(s)) for s in servers]
        self.confirm_timeout = confirm_timeout
        self._clock = clock
        self._router = WriteRouter(len(servers), server_timeout, dead_after, clock())
        self._curve = curve
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._lock = threading.Lock()
        self._futures: dict[bytes, Future[int]] = {}
        self._active = threading.Event()
        self._closed = False  # no more writes taken
        self._released = False  # close() ran
        address = f"inproc://clone-writeonly-{id(self)}-{next(_pipes)}"
        self._pipe = self._ctx.socket(zmq.PAIR)
        self._pipe.linger = 0
        self._pipe.bind(address)
        self._thread = threading.Thread(
            target=self._run, args=(address,), name="clone-writeonly", daemon=True
        )
        self._thread.start()

    # -- the caller's side ------------------------------------------------

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until a server has sent HUGZ (NotSynced after ``timeout``)."""
        if not self._active.wait(timeout):
            raise NotSynced(f"no active Clone server sent a heartbeat in {timeout:g}s")

    def set_async(
        self, key: str, value: bytes | str, ttl: float = 0.0, *, timeout: float | None = None
    ) -> Future[int]:
        """Send a write; the future gets its sequence, or the error."""
        body = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        if not body:
            raise ValueError("an empty value would delete the key")
        validate_key(key.encode("utf-8"))
        props = ((TTL_PROPERTY, repr(float(ttl))),) if ttl else ()
        uuid = new_uuid()
        limit = self.confirm_timeout if timeout is None else timeout
        fut: Future[int] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError("this write-only client is closed")
            self._futures[uuid] = fut
            self._pipe.send_multipart(
                [_WRITE, repr(limit).encode(), *encode_call(OP_SET, uuid, key, props, body)]
            )
        return fut

    def close(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = self._closed = True
            if self._thread.is_alive():
                try:
                    self._pipe.send_multipart([_STOP], zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("the write-only client's thread did not take the stop")
        self._thread.join(10)
        self._pipe.close(linger=0)
        if self._thread.is_alive():
            log.error("the write-only client's thread did not stop")
            return
        self._ctx.term()

    # -- the I/O thread ---------------------------------------------------

    def _settle(self, uuid: bytes, result: int | BaseException) -> None:
        with self._lock:
            fut = self._futures.pop(uuid, None)
        if fut is None:
            return
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def _run(self, address: str) -> None:
        pipe = self._ctx.socket(zmq.PAIR)
        pipe.linger = 0
        pipe.connect(address)
        subs, dealers = [], []
        poller = zmq.Poller()
        poller.register(pipe, zmq.POLLIN)
        for host, base in self._endpoints:
            sub = self._ctx.socket(zmq.SUB)
            dealer = self._ctx.socket(zmq.DEALER)
            for sock in (sub, dealer):
                sock.linger = 0
                if self._curve is not None:
                    configure_client_socket(sock, *self._curve)
            sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
            sub.connect(f"{host}:{base + PUBLISHER_OFFSET}")
            dealer.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
            poller.register(sub, zmq.POLLIN)
            poller.register(dealer, zmq.POLLIN)
            subs.append(sub)
            dealers.append(dealer)
        pending: dict[bytes, _Pending] = {}
        router = self._router
        try:
            while True:
                for sock, _ in poller.poll(int(_TICK_S * 1000)):
                    if sock is pipe:
                        frames = pipe.recv_multipart()
                        if frames[0] == _STOP:
                            for uuid in list(pending):
                                self._settle(uuid, ClosedError("the client was closed"))
                            return
                        limit = float(frames[1])
                        call = frames[2:]
                        pending[call[2]] = _Pending(call, self._clock() + limit)
                        self._send(dealers, pending, call[2])
                    elif sock in subs:
                        index = subs.index(sock)
                        if sock.recv_multipart()[0] == HUGZ and router.heard(index, self._clock()):
                            log.debug("writing to server %d", index)
                            self._active.set()
                            for uuid in list(pending):  # resent with the same uuid
                                self._send(dealers, pending, uuid)
                    else:
                        self._on_reply(dealers.index(sock), sock.recv_multipart(), pending)
                self._tick(dealers, pending)
        except Exception as exc:  # a bug: no future may wait forever for this thread
            log.exception("the write-only client's thread failed")
            with self._lock:
                self._closed = True
                waiting = list(self._futures)
            for uuid in waiting:
                self._settle(uuid, CloneError(f"the write-only client failed: {exc}"))
        finally:
            for sock in (pipe, *subs, *dealers):
                sock.close(linger=0)

    def _send(self, dealers: list[zmq.Socket[bytes]], pending: dict[bytes, _Pending],
              uuid: bytes) -> None:  # fmt: skip
        current = self._router.current
        entry = pending.get(uuid)
        if current is None or entry is None:
            return
        try:
            dealers[current].send_multipart(entry.frames, zmq.NOBLOCK)
        except zmq.Again:
            return  # queue full: sent again by the next tick
        entry.sent_to = current

    def _on_reply(self, index: int, frames: list[bytes], pending: dict[bytes, _Pending]) -> None:
        try:
            reply = decode_reply(frames)
        except CloneError as exc:
            log.warning("server %d sent a bad reply: %s", index, exc)
            return
        if reply.uuid not in pending:
            return  # answered already (a retry's second reply)
        if reply.ok:
            del pending[reply.uuid]
            self._settle(reply.uuid, reply.sequence)
        elif reply.reason == "not-active":
            pending[reply.uuid].sent_to = None
            self._router.not_active(index)
        else:
            del pending[reply.uuid]
            self._settle(reply.uuid, CloneError(f"refused ({reply.reason}): {reply.detail}"))

    def _tick(self, dealers: list[zmq.Socket[bytes]], pending: dict[bytes, _Pending]) -> None:
        now = self._clock()
        router = self._router
        router.tick(now)
        if router.current is None:
            self._active.clear()
        if router.dead(now):
            for uuid in list(pending):
                del pending[uuid]
                self._settle(uuid, NotActive(
                    f"no Clone server sent a heartbeat for {router.dead_after:g}s"
                ))  # fmt: skip
            return
        for uuid, entry in list(pending.items()):
            if now >= entry.deadline:
                del pending[uuid]
                self._settle(uuid, ConfirmTimeout("write not confirmed in time"))
            elif entry.sent_to is None or entry.sent_to != router.current:
                self._send(dealers, pending, uuid)


_pipes = itertools.count()
