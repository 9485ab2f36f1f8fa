"""A client that only writes: no snapshot, no copy of the store, a reply per write.

How this works: :class:`Clone` keeps a replica of its subtree, so it asks the
active server for a snapshot before it writes; with a million keys and eight
Spark partitions that is eight copies of the store, the pressure a
million-row load puts on the servers.  :class:`WriteOnlyClone` keeps nothing.  It subscribes to the
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
live in :class:`~clone.client.writerouter.WriteRouter`, which takes ``now``
and returns what to do; the sockets, the batching into ``set-many`` calls and
the resends after a failover in :class:`~clone.client.writelink.WriteLink`
(both re-exported here); this module holds the two writers over them.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import zmq

from clone.argtypes import normalize_endpoint
from clone.client.agent import split_endpoint
from clone.client.writelink import Settled, WriteLink
from clone.client.writerouter import WriteRouter
from clone.errors import CloneError, ClosedError, NotSynced
from clone.security import KeyPair
from clone.wire.calls import CALL, OP_SET
from clone.wire.codec import encode_properties, new_uuid, validate_key
from clone.wire.protocol import TTL_PROPERTY

__all__ = ["BulkWriter", "WriteLink", "WriteOnlyClone", "WriteRouter", "set_frames"]

log = logging.getLogger(__name__)

_WRITE, _STOP = b"W", b"S"
_TICK_S = 0.05
_OP_SET = OP_SET.encode()


def set_frames(key: str, value: bytes | str, ttl: float = 0.0) -> tuple[bytes, list[bytes]]:
    """A ``set`` call's uuid and frames, the value and key checked as the
    server will (ValueError for an empty value: it would delete the key)."""
    body = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    if not body:
        raise ValueError("an empty value would delete the key")
    raw = key.encode("utf-8")
    validate_key(raw)
    props = _encode_ttl(ttl) if ttl else b""
    uuid = new_uuid()
    return uuid, [CALL, _OP_SET, uuid, raw, props, body]


def _encode_ttl(ttl: float) -> bytes:
    return encode_properties(((TTL_PROPERTY, repr(float(ttl))),))


def _routing(
    servers: Sequence[str], server_timeout: float, dead_after: float, now: float
) -> tuple[list[tuple[str, int]], WriteRouter]:
    """What both writers start from: each server's endpoint and the router
    over them (``ValueError`` without a server)."""
    if not servers:
        raise ValueError("no servers given")
    endpoints = [split_endpoint(normalize_endpoint(s)) for s in servers]
    return endpoints, WriteRouter(len(endpoints), server_timeout, dead_after, now)


class BulkWriter:
    """Pipelined ``set`` calls from the caller's own thread: no I/O thread,
    no futures (a bulk load's hot path: :mod:`clone.pipeline.writer`).

    :meth:`submit` sends a write and returns its uuid; :meth:`poll` waits up
    to ``timeout`` for answers and returns the writes settled, as ``(uuid,
    sequence or exception)`` (:class:`~clone.errors.ConfirmTimeout`,
    :class:`~clone.errors.NotActive` when the pair is dead, a refusal).  The
    same failover rules as :class:`WriteOnlyClone` (same uuid to the next
    active server).  Make it in the thread and process that use it.

    With ``batch_rows`` (the default, 64) writes are sent ``batch_rows`` at a
    time as one ``set-many`` call (docs/protocol.md, "Batched sets"): the
    queue goes out when it is full and at every :meth:`poll`.  Each row keeps
    its own uuid and answer.  Against a server that does not know the call
    the writer falls back to a ``set`` per row by itself; ``batch_rows=0``
    never batches.
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
        batch_rows: int = 64,
    ) -> None:
        endpoints, router = _routing(servers, server_timeout, dead_after, clock())
        self.confirm_timeout = confirm_timeout
        self._clock = clock
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._link = WriteLink(self._ctx, endpoints, router, curve=curve, clock=clock,
                               batch_rows=batch_rows)  # fmt: skip
        self._next_tick = clock() + _TICK_S
        self._closed = False

    @property
    def outstanding(self) -> int:
        """Writes sent (or waiting for an active server) and not yet settled."""
        return len(self._link.pending)

    @property
    def reconfirmed(self) -> tuple[int, int]:
        """Writes sent again after a failover: (confirmed again, given up)."""
        return self._link.reconfirmed, self._link.reconfirm_failed

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until a server has sent HUGZ (NotSynced after ``timeout``)."""
        deadline = self._clock() + timeout
        link = self._link
        while link.router.current is None:
            left = deadline - self._clock()
            if left <= 0:
                raise NotSynced(f"no active Clone server sent a heartbeat in {timeout:g}s")
            link.handle(dict(link.poller.poll(max(1, int(min(left, _TICK_S) * 1000)))))
            link.tick()
            if link.router.dead(self._clock()):
                raise NotSynced("no Clone server accepts connections (the pair is down)")

    def submit(self, key: str, value: bytes | str, ttl: float = 0.0) -> bytes:
        """Send a write (or hold it until a server is active); its uuid."""
        if self._closed:
            raise ClosedError("this bulk writer is closed")
        uuid, frames = set_frames(key, value, ttl)
        self._link.send(uuid, frames, self._clock() + self.confirm_timeout)
        return uuid

    def poll(self, timeout: float) -> list[Settled]:
        """Wait up to ``timeout`` s for answers; the writes settled meanwhile."""
        link = self._link
        link.flush()  # a partial batch goes out before we wait for answers
        wait = max(0, min(int(timeout * 1000), int(_TICK_S * 1000)))
        settled = link.handle(dict(link.poller.poll(wait)))
        now = self._clock()
        if now >= self._next_tick:
            self._next_tick = now + _TICK_S
            settled.extend(link.tick())
        return settled

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._link.close()
        self._ctx.term()


class WriteOnlyClone:
    """Writes confirmed by the active server's reply; see the module docstring.

    The subset of :class:`clone.Clone` a loader needs: :meth:`wait_synced`
    (here: wait until an active server is known), :meth:`set_async` and
    :meth:`close`.  Its I/O thread drives a :class:`WriteLink`.
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
        self._endpoints, self._router = _routing(servers, server_timeout, dead_after, clock())
        self.confirm_timeout = confirm_timeout
        self._clock = clock
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
        uuid, frames = set_frames(key, value, ttl)
        limit = self.confirm_timeout if timeout is None else timeout
        fut: Future[int] = Future()
        with self._lock:
            if self._closed:
                raise ClosedError("this write-only client is closed")
            self._futures[uuid] = fut
            self._pipe.send_multipart([_WRITE, repr(limit).encode(), *frames])
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

    def _settle(self, settled: list[Settled]) -> None:
        for uuid, result in settled:
            with self._lock:
                fut = self._futures.pop(uuid, None)
            if fut is None:
                continue
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)

    def _run(self, address: str) -> None:
        pipe = self._ctx.socket(zmq.PAIR)
        pipe.linger = 0
        pipe.connect(address)
        link = WriteLink(self._ctx, self._endpoints, self._router, curve=self._curve,
                         clock=self._clock)  # fmt: skip
        link.poller.register(pipe, zmq.POLLIN)
        try:
            while True:
                events = dict(link.poller.poll(int(_TICK_S * 1000)))
                if pipe in events:
                    frames = pipe.recv_multipart()
                    if frames[0] == _STOP:
                        self._settle(link.fail_all(ClosedError("the client was closed")))
                        return
                    call = frames[2:]
                    link.send(call[2], call, self._clock() + float(frames[1]))
                self._settle(link.handle(events))
                if self._router.current is not None:
                    self._active.set()
                self._settle(link.tick())
                if self._router.current is None:
                    self._active.clear()
        except Exception as exc:  # a bug: no future may wait forever for this thread
            log.exception("the write-only client's thread failed")
            with self._lock:
                self._closed = True
                waiting = list(self._futures)
            self._settle([(uuid, CloneError(f"the write-only client failed: {exc}"))
                          for uuid in waiting])  # fmt: skip
        finally:
            pipe.close(linger=0)
            link.close()


_pipes = itertools.count()
