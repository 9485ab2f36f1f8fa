"""WriteLink: the sockets of a write-only client and what moves on them.

How this works: one SUB (HUGZ only) and one DEALER per server.  Each write
is a ``set`` CALL? sent to the active server (:class:`~clone.client.writerouter.WriteRouter`
says which), or queued and sent many at a time as a ``set-many``; each REPLY
settles its writes.  A write not answered by the server that was current is
sent again, with the same uuid, to the next one, and the last writes a server
confirmed are sent again to the server that takes over (it applies only those
it lacks).  Used by :class:`~clone.client.writeonly.WriteOnlyClone` (from its
I/O thread) and :class:`~clone.client.writeonly.BulkWriter` (from the caller's).
"""

from __future__ import annotations

import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from clone.client.writerouter import WriteRouter
from clone.errors import CloneError, ConfirmTimeout, NotActive
from clone.security import KeyPair, configure_client_socket
from clone.wire.calls import (
    CALL,
    MAX_SET_MANY_BYTES,
    MAX_SET_MANY_ENTRIES,
    OP_SET_MANY,
    REPLY,
    SET_MANY_ENTRY_OVERHEAD,
    Reply,
    decode_reply,
    encode_set_many,
)
from clone.wire.codec import encode_properties, new_uuid
from clone.wire.protocol import HUGZ, PUBLISHER_OFFSET, SNAPSHOT_OFFSET

__all__ = ["RECONFIRM_BYTES", "RECONFIRM_ROWS", "Settled", "WriteLink"]

log = logging.getLogger(__name__)

#: With no active server, how often each server's port is tried, and for how long.
_PROBE_EVERY_S = 0.5
_PROBE_TIMEOUT_S = 0.2
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
Settled = tuple[bytes, "int | BaseException"]


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

    def handle(self, events: dict[zmq.Socket[bytes], int]) -> list[Settled]:
        """Read every message waiting on the sockets ``events`` names."""
        settled: list[Settled] = []
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

    def tick(self) -> list[Settled]:
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
        settled: list[Settled] = []
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

    def fail_all(self, exc: BaseException) -> list[Settled]:
        settled: list[Settled] = [(uuid, exc) for uuid, entry in self.pending.items()
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
                # Resent with the same uuids, all in the order they were
                # written: rows queued while no server was current go after
                # the reconfirmed ones too, not ahead of them.
                for entry in self.pending.values():
                    entry.queued = False
                self._queue = []
                for uuid in list(self.pending):
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

    def _on_reply(self, index: int, frames: list[bytes], settled: list[Settled]) -> None:
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
        settled: list[Settled],
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
        first: dict[bytes, _Pending] = {}
        for uuid, frames, server, _ in self._confirmed:
            if server != index and uuid not in pending:
                first[uuid] = _Pending(frames, now + _RECONFIRM_S, reconfirm=True)
        again = len(first)
        if first:
            # They go before the writes still waiting, which were sent after
            # them: the new server applies them in the order they were
            # written, so a row rewritten since is not taken back by its
            # older value, and each confirmed row gets its sequence again.
            first.update(pending)
            pending.clear()
            pending.update(first)
        self._confirmed.clear()
        self._confirmed_bytes = 0
        if again:
            log.info("sending %d writes confirmed by the last server to server %d again",
                     again, index)  # fmt: skip

    def _on_batch_reply(
        self, index: int, reply: Reply, uuids: list[bytes], settled: list[Settled]
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
