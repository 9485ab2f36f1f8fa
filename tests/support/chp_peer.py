"""A minimal CHP peer on raw pyzmq, for end-to-end tests of the server.

It builds and parses frames by hand (``struct``), not with ``clone.wire.codec`` or
the project's client, so the tests check the wire format independently of the
code under test.  Every call that waits takes a deadline; every socket has
``linger=0`` and is closed by :meth:`ChpPeer.close`.

The update publisher is an XPUB: it behaves exactly like the PUB a CHP client
uses, but it also reports each server's subscription, so :meth:`ChpPeer.connect`
can wait until the collectors will really receive what we send (no slow-joiner
losses, no sleeps).
"""

from __future__ import annotations

import struct
import time
import uuid as uuidlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq

__all__ = ["ChpPeer", "Snapshot", "Update", "make_props"]

_SEQ = struct.Struct(">Q")


@dataclass(frozen=True)
class Update:
    """One five-frame message as received (KVPUB, HUGZ, KVSYNC, KTHXBAI)."""

    key: bytes
    sequence: int
    uuid: bytes
    props: dict[str, str]
    body: bytes

    @property
    def is_hugz(self) -> bool:
        return self.key == b"HUGZ"


@dataclass
class Snapshot:
    """A completed ICANHAZ? exchange."""

    entries: dict[bytes, Update] = field(default_factory=dict)
    kvsync_count: int = 0
    sequence: int = -1
    subtree: bytes = b""


def make_props(props: dict[str, str] | None) -> bytes:
    if not props:
        return b""
    return b"".join(f"{k}={v}\n".encode() for k, v in props.items())


def _parse_props(raw: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in raw.decode().split("\n"):
        if line:
            name, _, value = line.partition("=")
            out[name] = value
    return out


def parse(frames: list[bytes]) -> Update:
    assert len(frames) == 5, f"expected 5 frames, got {len(frames)}: {frames!r}"
    key, seq, uuid, props, body = frames
    assert len(seq) == 8, f"sequence frame of {len(seq)} bytes"
    return Update(key, _SEQ.unpack(seq)[0], uuid, _parse_props(props), body)


class ChpPeer:
    """DEALER to P, SUB to P+1, XPUB to P+2 of one or more servers."""

    def __init__(self, ctx: zmq.Context, host: str = "127.0.0.1") -> None:
        self.ctx = ctx
        self.host = host
        self._sockets: list[zmq.Socket] = []
        self.dealer: zmq.Socket | None = None
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.pub = self._socket(zmq.XPUB)
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.pub.setsockopt(zmq.SNDHWM, 0)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    # -- connecting -----------------------------------------------------------

    def connect(
        self, snapshot_port: int, *, updates_from: int | None = None,
        collectors: Iterable[int] = (), timeout: float = 5.0,
    ) -> None:
        """Point the DEALER at one server's P, the SUB at ``updates_from`` (a
        base port, default ``snapshot_port``) and the XPUB at each collector
        base port given; wait until every collector has subscribed."""
        self.use_snapshot_server(snapshot_port)
        self.sub.connect(f"tcp://{self.host}:{(updates_from or snapshot_port) + 1}")
        ports = list(collectors)
        for port in ports:
            self.pub.connect(f"tcp://{self.host}:{port + 2}")
        deadline = time.monotonic() + timeout
        seen = 0
        while seen < len(ports):
            if not self.pub.poll(max(0, int((deadline - time.monotonic()) * 1000))):
                raise TimeoutError(f"{len(ports) - seen} collector(s) never subscribed")
            if self.pub.recv().startswith(b"\x01"):
                seen += 1

    def use_snapshot_server(self, port: int) -> None:
        """A fresh DEALER on ``port`` (a failover, as a client would do it)."""
        if self.dealer is not None:
            self.dealer.close(linger=0)
            self._sockets.remove(self.dealer)
        self.dealer = self._socket(zmq.DEALER)
        self.dealer.connect(f"tcp://{self.host}:{port}")

    def resubscribe(self, base_port: int) -> None:
        self.sub.close(linger=0)
        self._sockets.remove(self.sub)
        self.sub = self._socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.setsockopt(zmq.RCVHWM, 0)
        self.sub.connect(f"tcp://{self.host}:{base_port + 1}")

    def close(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets.clear()

    # -- snapshots ------------------------------------------------------------

    def send_snapshot_frames(self, frames: list[bytes]) -> None:
        assert self.dealer is not None
        self.dealer.send_multipart(frames)

    def snapshot(
        self, subtree: bytes = b"", timeout: float = 5.0,
        on_entry: Callable[[Update], None] | None = None,
    ) -> Snapshot:
        """ICANHAZ? and collect KVSYNCs until KTHXBAI; TimeoutError if none."""
        assert self.dealer is not None
        self.dealer.send_multipart([b"ICANHAZ?", subtree])
        snap = Snapshot()
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.dealer.poll(int(remaining * 1000)):
                raise TimeoutError(f"no KTHXBAI within {timeout} s ({snap.kvsync_count} KVSYNCs)")
            msg = parse(self.dealer.recv_multipart())
            if msg.key == b"KTHXBAI":
                snap.sequence = msg.sequence
                snap.subtree = msg.body
                return snap
            snap.kvsync_count += 1
            snap.entries[msg.key] = msg
            if on_entry is not None:
                on_entry(msg)

    def no_snapshot_reply(self, wait: float) -> bool:
        """Ask and check that nothing at all comes back within ``wait`` seconds."""
        assert self.dealer is not None
        self.dealer.send_multipart([b"ICANHAZ?", b""])
        return not self.dealer.poll(int(wait * 1000))

    # -- updates --------------------------------------------------------------

    def kvset(
        self, key: bytes, value: bytes, *, uuid: bytes | None = None,
        props: dict[str, str] | None = None,
    ) -> bytes:
        """Send a KVSET to every connected collector; return its uuid."""
        uid = uuidlib.uuid4().bytes if uuid is None else uuid
        self.pub.send_multipart([key, _SEQ.pack(0), uid, make_props(props), value])
        return uid

    def send_collector_frames(self, frames: list[bytes]) -> None:
        self.pub.send_multipart(frames)

    def recv(self, timeout: float) -> Update | None:
        if not self.sub.poll(max(0, int(timeout * 1000))):
            return None
        return parse(self.sub.recv_multipart())

    def updates(self, count: int, timeout: float = 5.0, *, hugz: bool = False) -> list[Update]:
        """The next ``count`` KVPUBs (HUGZ skipped unless ``hugz``)."""
        out: list[Update] = []
        deadline = time.monotonic() + timeout
        while len(out) < count:
            msg = self.recv(deadline - time.monotonic())
            if msg is None:
                raise TimeoutError(f"got {len(out)} of {count} updates in {timeout} s: {out!r}")
            if hugz or not msg.is_hugz:
                out.append(msg)
        return out

    def wait_for(self, pred: Callable[[Update], bool], timeout: float = 5.0) -> Update:
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(deadline - time.monotonic())
            if msg is None:
                raise TimeoutError(f"no matching message within {timeout} s")
            if pred(msg):
                return msg

    def wait_hugz(self, timeout: float = 5.0) -> Update:
        """Also proves the subscription reached the server's publisher."""
        return self.wait_for(lambda m: m.is_hugz, timeout)

    def drain(self) -> list[Update]:
        out = []
        while (msg := self.recv(0)) is not None:
            out.append(msg)
        return out
