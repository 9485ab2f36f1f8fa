"""A tiny CHP server in raw pyzmq, for client tests that must not depend on ours.

It runs in a thread with its own context, serves snapshots, republishes KVSETs
with a sequence (deduplicating by uuid), sends HUGZ, and can be told to go
silent, to stop answering snapshots, to ignore the next N snapshot requests (a
passive server refusing votes), to drop some publications (to make holes), or to
send arbitrary frames (garbage).  CALL?s on its snapshot port are recorded in
``calls`` and answered by ``on_call`` if set (a :class:`Reply`, raw frames, or
None for no answer, which is what a Guide server does).  ``stop()`` closes its
sockets, which is what a killed process looks like to its clients.  It does no
TTL and no Binary Star, and like the Guide's servers it answers with KVSYNCs
even when the requester asks for our KVBATCH extension (it only counts those
requests).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import zmq

from clone.errors import ProtocolError
from clone.wire.calls import Call, Reply, decode_call, encode_reply, is_call
from clone.wire.codec import (
    KVMsg,
    decode_icanhaz,
    decode_kvset,
    encode_hugz,
    encode_kthxbai,
    encode_kv,
)
from tests.support.ports import free_base_port

__all__ = ["CALL_TIMEOUT", "FakeServer"]

#: Ceiling of :meth:`FakeServer.call` and of the start: bounds a hang only (a
#: large map's change took over 5 s on a loaded machine).
CALL_TIMEOUT = 60.0


class FakeServer:
    """A CHP server on 127.0.0.1 ports P, P+1, P+2 (``endpoint`` is P)."""

    def __init__(self, *, heartbeat: float = 0.1, port: int | None = None) -> None:
        self.port = port or free_base_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.heartbeat = heartbeat
        self.map: dict[str, KVMsg] = {}
        self.sequence = 0
        self.silent = False  # no HUGZ, no publications, no snapshots
        self.answer_snapshots = True
        self.ignore_next_snapshots = 0  # drop this many requests, then answer again
        self.ignore_kvsets = False  # receive client updates but never apply them
        self.drop_next_publications = 0  # publish with a sequence hole
        self.snapshot_requests = 0
        self.batch_requests = 0  # requests whose connection carried X-CHP-Batch
        # Raw messages sent at the start of every snapshot reply (garbage tests).
        self.snapshot_prefix: list[list[bytes]] = []
        self.kvsets = 0
        # Calls received (decoded), and who answers them, in the server thread.
        self.calls: list[Call] = []
        self.on_call: Callable[[Call], Reply | list[bytes] | None] | None = None
        self._seen: set[bytes] = set()
        self._calls: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"fake-chp-{self.port}", daemon=True)

    def __enter__(self) -> FakeServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(CALL_TIMEOUT):
            raise RuntimeError("fake server did not start")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def inject(self, socket: str, frames: Sequence[bytes]) -> None:
        """Send raw frames on 'pub' or as a snapshot reply ('snapshot', to every
        requester); returns once they are sent."""
        raw = list(frames)

        def send() -> None:
            if socket == "pub":
                self._pub.send_multipart(raw)
            else:
                for ident in self._requesters:
                    try:
                        self._snap.send_multipart([ident, *raw])
                    except zmq.ZMQError as exc:
                        if exc.errno != zmq.EHOSTUNREACH:  # gone: nobody to tell
                            raise

        self.call(send)

    def call(self, fn: Callable[[], object], timeout: float = CALL_TIMEOUT) -> None:
        """Run ``fn`` in the server thread (to change the map consistently); wait for it.

        Waits for ``fn`` to have run, however long a busy machine takes; the
        ceiling only bounds a hang, and a dead server thread fails at once.
        An exception ``fn`` raised is raised here.
        """
        done = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                failed.append(exc)
            finally:
                done.set()

        with self._lock:
            self._calls.append(run)
        deadline = time.monotonic() + timeout
        while not done.wait(0.05):
            if not self._thread.is_alive():
                raise RuntimeError("the fake server's thread is gone: the call never ran")
            if time.monotonic() > deadline:
                raise RuntimeError(f"fake server did not run the call within {timeout} s")
        if failed:
            raise failed[0]

    def publish(self, key: str, body: bytes, uuid: bytes = b"") -> None:
        """Apply and publish an update as if a client had sent it."""
        self.call(lambda: self._apply(KVMsg(key, 0, uuid, (), body)))

    # ------------------------------------------------------------------

    def _run(self) -> None:
        ctx = zmq.Context()
        snap = ctx.socket(zmq.ROUTER)
        pub = ctx.socket(zmq.PUB)
        coll = ctx.socket(zmq.SUB)
        for s in (snap, pub, coll):
            s.setsockopt(zmq.LINGER, 0)
        coll.setsockopt(zmq.SUBSCRIBE, b"")
        # No high-water mark on snapshots: a ROUTER drops silently at the mark,
        # and a test of a large map must not depend on how fast the client reads.
        snap.setsockopt(zmq.SNDHWM, 0)
        # A reply to a requester that is gone fails at once (EHOSTUNREACH)
        # instead of being built and dropped: see _snapshot_port.
        snap.setsockopt(zmq.ROUTER_MANDATORY, 1)
        snap.bind(f"tcp://127.0.0.1:{self.port}")
        pub.bind(f"tcp://127.0.0.1:{self.port + 1}")
        coll.bind(f"tcp://127.0.0.1:{self.port + 2}")
        self._pub = pub
        self._snap = snap
        self._requesters: list[bytes] = []
        poller = zmq.Poller()
        poller.register(snap, zmq.POLLIN)
        poller.register(coll, zmq.POLLIN)
        next_hugz = time.monotonic()
        self._ready.set()
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(10):
                    if sock is snap:
                        self._snapshot_port(snap)
                    elif not self.silent:
                        self._collect(sock.recv_multipart())
                with self._lock:
                    calls, self._calls = self._calls, []
                for fn in calls:
                    fn()
                now = time.monotonic()
                if now >= next_hugz:
                    next_hugz = now + self.heartbeat
                    if not self.silent:
                        pub.send_multipart(encode_hugz(self.sequence))
        finally:
            ctx.destroy(linger=0)

    def _snapshot_port(self, snap: zmq.Socket[bytes]) -> None:
        """Every message waiting on the snapshot port, then one reply per
        requester: its newest request's.

        A large map's reply takes the thread seconds on a loaded machine;
        meanwhile the client (at a 100 ms heartbeat) asks again every 25 ms
        and fails over to a fresh socket.  Answering each request in full,
        each one after the other, the fake fell further behind with every
        reply and a 50,000-key sync never completed in 60 s (seen 2 in 11
        runs beside stress-ng --cpu 4).  Our servers also keep one stream per
        requester (here: per requester and subtree, a client with several
        subtrees asks for each); a requester gone meanwhile gets nothing
        (ROUTER_MANDATORY)."""
        wanted: dict[tuple[bytes, str], None] = {}  # in the order of their newest ask
        while True:
            try:
                parts = snap.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            taken = self._snapshot_request(snap, parts)
            if taken is not None:
                wanted.pop(taken, None)
                wanted[taken] = None
        for ident, subtree in wanted:
            try:
                self._snapshot(snap, ident, subtree)
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:
                    raise

    def _snapshot_request(
        self, snap: zmq.Socket[bytes], parts: list[zmq.Frame]
    ) -> tuple[bytes, str] | None:
        """Count a request (answer a call at once); ``(identity, subtree)`` if
        it is to be answered."""
        ident, rest = parts[0].bytes, [p.bytes for p in parts[1:]]
        if is_call(rest):
            self._call(snap, ident, rest)
            return None
        self.snapshot_requests += 1
        try:
            if len(parts) > 1 and parts[1].get("X-CHP-Batch") == "1":
                self.batch_requests += 1
        except zmq.ZMQError:  # no such property: a requester that did not ask
            pass
        if self.silent or not self.answer_snapshots:
            return None
        if self.ignore_next_snapshots > 0:
            self.ignore_next_snapshots -= 1
            return None
        try:
            req = decode_icanhaz(rest)
        except ProtocolError:
            return None
        return ident, req.subtree

    def _snapshot(self, snap: zmq.Socket[bytes], ident: bytes, subtree: str) -> None:
        self._requesters.append(ident)
        for frames in self.snapshot_prefix:
            snap.send_multipart([ident, *frames])
        for key in sorted(self.map):
            if key.startswith(subtree):
                snap.send_multipart([ident, *encode_kv(self.map[key])])
        snap.send_multipart([ident, *encode_kthxbai(self.sequence, subtree)])

    def _call(self, snap: zmq.Socket[bytes], ident: bytes, frames: list[bytes]) -> None:
        try:
            call = decode_call(frames)
        except ProtocolError:
            return
        self.calls.append(call)
        answer = None if self.silent or self.on_call is None else self.on_call(call)
        if answer is not None:
            raw = encode_reply(answer) if isinstance(answer, Reply) else answer
            try:
                snap.send_multipart([ident, *raw])
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EHOSTUNREACH:  # the caller is gone: as dropped
                    raise

    def _collect(self, frames: list[bytes]) -> None:
        try:
            msg = decode_kvset(frames)
        except ProtocolError:
            return
        self.kvsets += 1
        if self.ignore_kvsets:
            return
        if msg.uuid:
            if msg.uuid in self._seen:
                return
            self._seen.add(msg.uuid)
        self._apply(msg)

    def _apply(self, msg: KVMsg) -> None:
        self.sequence += 1
        out = KVMsg(msg.key, self.sequence, msg.uuid, msg.properties, msg.body)
        if msg.body:
            self.map[msg.key] = out
        else:
            self.map.pop(msg.key, None)
        if self.drop_next_publications > 0:
            self.drop_next_publications -= 1
            return
        self._pub.send_multipart(encode_kv(out))
