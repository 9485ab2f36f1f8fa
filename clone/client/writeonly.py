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
live in :class:`WriteRouter`, which takes ``now`` and returns what to do; the
thread only moves frames.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from clone.argtypes import normalize_endpoint
from clone.client.agent import split_endpoint
from clone.errors import CloneError, ClosedError, ConfirmTimeout, NotActive, NotSynced
from clone.security import KeyPair, configure_client_socket
from clone.wire.calls import (
    CALL,
    MAX_SET_MANY_BYTES,
    MAX_SET_MANY_ENTRIES,
    OP_SET,
    OP_SET_MANY,
    REPLY,
    SET_MANY_ENTRY_OVERHEAD,
    Reply,
    decode_reply,
    encode_set_many,
)
from clone.wire.codec import encode_properties, new_uuid, validate_key
from clone.wire.protocol import HUGZ, PUBLISHER_OFFSET, SNAPSHOT_OFFSET, TTL_PROPERTY

__all__ = ["BulkWriter", "WriteLink", "WriteOnlyClone", "WriteRouter", "set_frames"]

log = logging.getLogger(__name__)

_WRITE, _STOP = b"W", b"S"
_TICK_S = 0.05
#: With no active server, how often each server's port is tried, and for how long.
_PROBE_EVERY_S = 0.5
_PROBE_TIMEOUT_S = 0.2
_OP_SET = OP_SET.encode()
_OP_SET_MANY = OP_SET_MANY.encode()
#: What a server that does not know ``set-many`` says (clone.wire.calls.decode_call).
_UNKNOWN_OP = "unknown CALL? operation"
#: The writes confirmed most recently, kept to be sent again after a failover
#: (:class:`WriteLink`): at most this many, and this many bytes of key,
#: properties and value.  Half the servers' default --dedup-window (65,536
#: ids), so that the new active server still knows each one it applied.
RECONFIRM_ROWS = 32_768
RECONFIRM_BYTES = 16 * 1024 * 1024
#: How long a write sent again after a failover may take to be confirmed.
_RECONFIRM_S = 30.0
#: The properties of a plain ``ok`` REPLY, as the server encodes them.
_OK_PROPERTIES = encode_properties((("status", "ok"),))


#: A write settled: its uuid and its sequence, or why it failed.
_Settled = tuple[bytes, "int | BaseException"]


@dataclass(slots=True)
class _Pending:
    frames: list[bytes]
    deadline: float
    sent_to: int | None = None
    #: Waiting in the link's queue for the next ``set-many`` (batching only).
    queued: bool = False
    #: A write confirmed by a server we left, sent again to the new active
    #: one (its answer is not reported: the write was settled already).
    reconfirm: bool = False


@dataclass(slots=True)
class WriteRouter:
    """Where each write goes and when it has failed; pure (``now`` is given).

    ``heard(i, now)``: server ``i`` sent HUGZ.  ``current``: the server writes
    go to (None: none is known active).  A server is active while heard within
    ``server_timeout``; the pair is dead when no server was heard for
    ``dead_after`` (counted from the start, or from the last HUGZ), or sooner,
    after ``server_timeout``, when every server *refused* a connection since
    it was last heard (``probed(i, refused=True)``: no process listens there,
    a certainty that silence is not).  So a Spark partition that starts after
    the pair died gives up in about a second instead of waiting ``dead_after``.
    """

    servers: int
    server_timeout: float
    dead_after: float
    started: float
    current: int | None = None
    last_heard: list[float | None] = field(default_factory=list)
    refused: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.last_heard = [None] * self.servers
        self.refused = [False] * self.servers

    def heard(self, index: int, now: float) -> bool:
        """Record a HUGZ; True when ``index`` becomes the current server."""
        self.last_heard[index] = now
        self.refused[index] = False
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

    def probed(self, index: int, *, refused: bool) -> None:
        """A connection to server ``index`` was refused, or accepted."""
        self.refused[index] = refused

    def dead(self, now: float) -> bool:
        """No server heard for ``dead_after`` seconds, or every server
        refusing connections and none heard for ``server_timeout``."""
        if self.current is not None:
            return False
        heard = [t for t in self.last_heard if t is not None]
        silent = now - (max(heard) if heard else self.started)
        if all(self.refused):
            return silent > min(self.server_timeout, self.dead_after)
        return silent > self.dead_after


class WriteLink:
    """The sockets of a write-only client and what moves on them; one thread's.

    A SUB (HUGZ only) and a DEALER per server, made by the thread that uses
    them, in the process that uses them: a ZeroMQ socket must not be shared
    between threads, and neither a socket nor its context may cross a fork
    (Spark's Python workers are forked).  :meth:`send` queues or sends a
    ``set`` call, :meth:`handle` reads what the poll found and :meth:`tick`
    judges overdue writes; each returns the writes it settled, as ``(uuid,
    sequence or exception)``.  The decisions are :class:`WriteRouter`'s.
    """

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        endpoints: Sequence[tuple[str, int]],
        router: WriteRouter,
        *,
        curve: tuple[KeyPair, bytes] | None = None,
        clock: Callable[[], float] = time.monotonic,
        batch_rows: int = 0,
    ) -> None:
        if not 0 <= batch_rows <= MAX_SET_MANY_ENTRIES:
            raise ValueError(f"batch_rows is 0 (no batches) to {MAX_SET_MANY_ENTRIES}")
        self.router = router
        self._clock = clock
        #: Rows per ``set-many`` call (0: a ``set`` call per row).  Set to 0
        #: for good when a server says it does not know ``set-many``.
        self.batch_rows = batch_rows
        self._queue: list[bytes] = []
        #: The rows of each ``set-many`` sent and not answered, by the call's
        #: uuid, and the server it went to.
        self._batches: dict[bytes, tuple[list[bytes], int]] = {}
        # The last writes confirmed, and by which server (see _remember).
        self._confirmed: deque[tuple[bytes, list[bytes], int, int]] = deque()
        self._confirmed_bytes = 0
        #: Writes sent again after a failover (reconfirmed, or given up).
        self.reconfirmed = 0
        self.reconfirm_failed = 0
        self._hosts = [(host.removeprefix("tcp://"), base + SNAPSHOT_OFFSET)
                       for host, base in endpoints]  # fmt: skip
        self._next_probe = 0.0
        self.poller = zmq.Poller()
        self.pending: dict[bytes, _Pending] = {}
        self._subs: list[zmq.Socket[bytes]] = []
        self._dealers: list[zmq.Socket[bytes]] = []
        self._index: dict[zmq.Socket[bytes], int] = {}
        for index, (host, base) in enumerate(endpoints):
            sub = ctx.socket(zmq.SUB)
            dealer = ctx.socket(zmq.DEALER)
            for sock in (sub, dealer):
                sock.linger = 0
                if curve is not None:
                    configure_client_socket(sock, *curve)
                self._index[sock] = index
                self.poller.register(sock, zmq.POLLIN)
            sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
            sub.connect(f"{host}:{base + PUBLISHER_OFFSET}")
            dealer.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
            self._subs.append(sub)
            self._dealers.append(dealer)

    def send(self, uuid: bytes, frames: list[bytes], deadline: float) -> None:
        """Send a call now if a server is active, else when one is; batching,
        queue it, and send the queue once it holds ``batch_rows`` rows."""
        self.pending[uuid] = entry = _Pending(frames, deadline)
        if not self.batch_rows:
            self._send(uuid)
            return
        entry.queued = True
        self._queue.append(uuid)
        if len(self._queue) >= self.batch_rows:
            self.flush()

    def flush(self) -> None:
        """Send the queued rows to the current server as ``set-many`` calls
        of up to ``batch_rows`` rows and :data:`MAX_SET_MANY_BYTES` bytes; a
        row too big to share a call goes alone, as a ``set``."""
        current = self.router.current
        if current is None or not self._queue:
            return
        queue, self._queue = self._queue, []
        pending = self.pending
        limit = self.batch_rows or 1
        chunk: list[bytes] = []
        size = 0
        for uuid in queue:
            entry = pending.get(uuid)
            if entry is None:
                continue
            entry.queued = False
            frames = entry.frames
            need = SET_MANY_ENTRY_OVERHEAD + len(frames[3]) + len(frames[4]) + len(frames[5])
            if need > MAX_SET_MANY_BYTES or not self.batch_rows:
                self._send(uuid)
                continue
            if chunk and (len(chunk) >= limit or size + need > MAX_SET_MANY_BYTES):
                self._send_batch(current, chunk)
                chunk, size = [], 0
            chunk.append(uuid)
            size += need
        if chunk:
            self._send_batch(current, chunk)

    def _send_batch(self, current: int, uuids: list[bytes]) -> None:
        pending = self.pending
        entries = [pending[uuid].frames for uuid in uuids]
        body = encode_set_many([(f[2], f[3], f[4], f[5]) for f in entries])
        call_id = new_uuid()
        try:
            self._dealers[current].send_multipart(
                [CALL, _OP_SET_MANY, call_id, b"", b"", body], zmq.NOBLOCK
            )
        except zmq.Again:  # queue full: queued again, sent by the next tick
            for uuid in uuids:
                pending[uuid].queued = True
            self._queue.extend(uuids)
            return
        self._batches[call_id] = (uuids, current)
        for uuid in uuids:
            pending[uuid].sent_to = current

    def _resend(self, uuid: bytes) -> None:
        """A row not answered by the current server: sent again, same uuid."""
        if not self.batch_rows:
            self._send(uuid)
            return
        entry = self.pending.get(uuid)
        if entry is not None and not entry.queued:
            entry.queued = True
            self._queue.append(uuid)

    def handle(self, events: dict[zmq.Socket[bytes], int]) -> list[_Settled]:
        """Read every message waiting on the sockets ``events`` names."""
        settled: list[_Settled] = []
        for sock in self._subs:
            if sock in events:
                self._read_hugz(sock)
        for sock in self._dealers:
            if sock in events:
                index = self._index[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_reply(index, frames, settled)
        return settled

    def tick(self) -> list[_Settled]:
        """Forget a silent server, fail overdue writes (or all, when the pair
        is dead), send what waits for the current server."""
        now = self._clock()
        router = self.router
        router.tick(now)
        pending = self.pending
        if router.current is None and now >= self._next_probe:
            self._next_probe = now + _PROBE_EVERY_S
            self._probe()
        if router.dead(now):
            if all(router.refused):
                why = NotActive(
                    f"no Clone server sent a heartbeat for "
                    f"{min(router.server_timeout, router.dead_after):g}s, "
                    "and every one refused a connection"
                )
            else:
                why = NotActive(f"no Clone server sent a heartbeat for {router.dead_after:g}s")
            return self.fail_all(why)
        settled: list[_Settled] = []
        for uuid, entry in list(pending.items()):
            if now >= entry.deadline:
                del pending[uuid]
                self._settle(uuid, entry, -1, ConfirmTimeout("write not confirmed in time"),
                             settled)  # fmt: skip
            elif entry.sent_to is None or entry.sent_to != router.current:
                self._resend(uuid)
        if self._batches:
            # Forget calls whose server is no longer current or whose rows all
            # settled: their rows were (or will be) sent again.
            for call_id, (uuids, server) in list(self._batches.items()):
                if server != router.current or not any(u in pending for u in uuids):
                    del self._batches[call_id]
        self.flush()
        return settled

    def _probe(self) -> None:
        """No server is active: try a TCP connection to each, to tell a dead
        pair (refused at once) from a slow one."""
        for index, (host, port) in enumerate(self._hosts):
            try:
                socket.create_connection((host.strip("[]"), port), timeout=_PROBE_TIMEOUT_S).close()
            except ConnectionRefusedError:
                self.router.probed(index, refused=True)
            except OSError:  # a timeout, no route: not a certainty
                self.router.probed(index, refused=False)
            else:
                self.router.probed(index, refused=False)

    def fail_all(self, exc: BaseException) -> list[_Settled]:
        settled: list[_Settled] = [(uuid, exc) for uuid, entry in self.pending.items()
                                   if not entry.reconfirm]  # fmt: skip
        self.pending.clear()
        self._queue.clear()
        self._batches.clear()
        return settled

    def close(self) -> None:
        for sock in (*self._subs, *self._dealers):
            sock.close(linger=0)

    def _read_hugz(self, sock: zmq.Socket[bytes]) -> None:
        index = self._index[sock]
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if frames[0] == HUGZ and self.router.heard(index, self._clock()):
                log.debug("writing to server %d", index)
                self._reconfirm(index)
                for uuid in list(self.pending):  # resent with the same uuid
                    self._resend(uuid)
                self.flush()

    def _send(self, uuid: bytes) -> None:
        current = self.router.current
        entry = self.pending.get(uuid)
        if current is None or entry is None:
            return
        try:
            self._dealers[current].send_multipart(entry.frames, zmq.NOBLOCK)
        except zmq.Again:
            return  # queue full: sent again by the next tick
        entry.sent_to = current

    def _on_reply(self, index: int, frames: list[bytes], settled: list[_Settled]) -> None:
        pending = self.pending
        if len(frames) == 4 and frames[3] == _OK_PROPERTIES and frames[0] == REPLY:
            # The common answer, without building a Reply (a bulk load's hot path).
            uuid = frames[1]
            entry = pending.pop(uuid, None)
            if entry is not None and len(frames[2]) == 8:
                self._settle(uuid, entry, index, int.from_bytes(frames[2], "big"), settled)
            return
        try:
            reply = decode_reply(frames)
        except CloneError as exc:
            log.warning("server %d sent a bad reply: %s", index, exc)
            return
        batch = self._batches.pop(reply.uuid, None)
        if batch is not None:
            self._on_batch_reply(index, reply, batch[0], settled)
            return
        if reply.uuid not in pending:
            return  # answered already (a retry's second reply)
        if reply.ok:
            self._settle(reply.uuid, pending.pop(reply.uuid), index, reply.sequence, settled)
        elif reply.reason == "not-active":
            pending[reply.uuid].sent_to = None
            self.router.not_active(index)
        else:
            why = CloneError(f"refused ({reply.reason}): {reply.detail}")
            self._settle(reply.uuid, pending.pop(reply.uuid), index, why, settled)


    def _settle(
        self,
        uuid: bytes,
        entry: _Pending,
        index: int,
        outcome: int | BaseException,
        settled: list[_Settled],
    ) -> None:
        """A write's answer: reported (unless it was only sent again after a
        failover), and remembered if server ``index`` confirmed it."""
        if not isinstance(outcome, BaseException):
            self._remember(uuid, entry.frames, index)
        if not entry.reconfirm:
            settled.append((uuid, outcome))
        elif isinstance(outcome, BaseException):
            self.reconfirm_failed += 1
            if self.reconfirm_failed % 1000 == 1:  # the first, then one line per 1,000
                log.warning("%d writes confirmed before the failover not confirmed again: %s",
                            self.reconfirm_failed, outcome)  # fmt: skip
        else:
            self.reconfirmed += 1

    def _remember(self, uuid: bytes, frames: list[bytes], index: int) -> None:
        """Keep the last writes confirmed (:data:`RECONFIRM_ROWS`,
        :data:`RECONFIRM_BYTES`): a server confirms a write once it is on its
        disk, and replicates it to its peer afterwards, so the writes it
        confirmed just before it died may never have reached the server that
        takes over."""
        size = len(frames[3]) + len(frames[4]) + len(frames[5])
        confirmed = self._confirmed
        confirmed.append((uuid, frames, index, size))
        self._confirmed_bytes += size
        while len(confirmed) > RECONFIRM_ROWS or self._confirmed_bytes > RECONFIRM_BYTES:
            self._confirmed_bytes -= confirmed.popleft()[3]

    def _reconfirm(self, index: int) -> None:
        """Server ``index`` became the current one: send it again, with their
        uuids, the last writes another server confirmed.  It applies only
        those it does not hold (it deduplicates by uuid): the tail the old
        active confirmed and died before replicating."""
        now = self._clock()
        pending = self.pending
        again = 0
        for uuid, frames, server, _ in self._confirmed:
            if server != index and uuid not in pending:
                pending[uuid] = _Pending(frames, now + _RECONFIRM_S, reconfirm=True)
                again += 1
        self._confirmed.clear()
        self._confirmed_bytes = 0
        if again:
            log.info("sending %d writes confirmed by the last server to server %d again",
                     again, index)  # fmt: skip

    def _on_batch_reply(
        self, index: int, reply: Reply, uuids: list[bytes], settled: list[_Settled]
    ) -> None:
        """A ``set-many``'s reply: each row settled by its own entry's answer.

        Refused as a whole, nothing was applied: ``not-active`` waits for the
        next active server, as a ``set`` does; any other refusal (a server
        that does not know ``set-many``, an ACL that refuses one of the keys)
        sends each row again as its own ``set``, so that each gets its own
        answer.  A server that does not know the call gets no more batches.
        """
        pending = self.pending
        if reply.ok and reply.sequences is not None and len(reply.sequences) == len(uuids):
            failed = {i: (why, detail) for i, why, detail in reply.failures}
            for i, (uuid, sequence) in enumerate(zip(uuids, reply.sequences, strict=True)):
                entry = pending.pop(uuid, None)
                if entry is None:
                    continue  # settled already (a resent row's first answer)
                problem = failed.get(i)
                outcome: int | BaseException = sequence
                if problem is not None and problem[0] == "conflict":
                    outcome = CloneError(f"conflict: the key is at {problem[1]}")
                elif problem is not None:
                    outcome = CloneError(f"refused ({problem[0]}): {problem[1]}")
                self._settle(uuid, entry, index, outcome, settled)
            return
        if reply.reason == "not-active":
            for uuid in uuids:
                if uuid in pending:
                    pending[uuid].sent_to = None
            self.router.not_active(index)
            return
        if reply.ok:
            log.warning("server %d answered a set-many of %d rows with %s sequences",
                        index, len(uuids), len(reply.sequences or ()))  # fmt: skip
        elif _UNKNOWN_OP in reply.detail and self.batch_rows:
            log.warning("server %d does not know set-many: a set call per row from now on",
                        index)  # fmt: skip
            self.batch_rows = 0
        for uuid in uuids:
            entry = pending.get(uuid)
            if entry is not None and not entry.queued:
                entry.sent_to = None
                self._send(uuid)


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

    def poll(self, timeout: float) -> list[_Settled]:
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

    def _settle(self, settled: list[_Settled]) -> None:
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
