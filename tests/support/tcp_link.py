"""A TCP link that a test can cut and heal: a forwarder between two loopback ports.

Point a server's ``--peer-ha`` at :attr:`CuttableLink.port` and the link
forwards to the peer's real Binary Star port; :meth:`CuttableLink.cut` closes
every connection through it and refuses new ones (accepted and closed at once)
until :meth:`CuttableLink.heal`.  That partitions the Binary Star link of a
pair on loopback, without root, network namespaces or iptables, while clients
still reach both servers (the split whose heal must not stall).

Usage::

    with CuttableLink(target_port) as link:
        ...  # start a server with --peer-ha 127.0.0.1:{link.port}
        link.cut()
        link.heal()
"""

from __future__ import annotations

import selectors
import socket
import threading
from types import TracebackType

from tests.support.ports import free_port

__all__ = ["CuttableLink"]

_CHUNK = 65536


class CuttableLink:
    """127.0.0.1:port -> 127.0.0.1:target, in a thread, with a switch."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._listener.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._peers: dict[socket.socket, socket.socket] = {}
        self._lock = threading.Lock()
        self._cut = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-link", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        """Close every connection through the link; refuse new ones."""
        with self._lock:
            self._cut = True
            for sock in list(self._peers):
                self._close(sock)

    def heal(self) -> None:
        """Forward new connections again (the ends reconnect on their own)."""
        with self._lock:
            self._cut = False

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for sock in list(self._peers):
                self._close(sock)
        self._selector.close()
        self._listener.close()

    def __enter__(self) -> CuttableLink:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, _ in self._selector.select(0.05):
                with self._lock:
                    if key.fileobj is self._listener:
                        self._accept()
                    else:
                        self._forward(key.fileobj)  # type: ignore[arg-type]

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except BlockingIOError:
            return
        if self._cut:
            conn.close()
            return
        try:
            out = socket.create_connection(("127.0.0.1", self.target), timeout=1.0)
        except OSError:
            conn.close()
            return
        for sock in (conn, out):
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[conn], self._peers[out] = out, conn
        self._selector.register(conn, selectors.EVENT_READ, None)
        self._selector.register(out, selectors.EVENT_READ, None)

    def _forward(self, sock: socket.socket) -> None:
        other = self._peers.get(sock)
        if other is None:
            return
        try:
            data = sock.recv(_CHUNK)
            if data:
                other.sendall(data)
                return
        except OSError:
            pass
        self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        other = self._peers.pop(sock, None)
        for s in (sock, other):
            if s is None:
                continue
            self._peers.pop(s, None)
            try:
                self._selector.unregister(s)
            except (KeyError, ValueError):
                pass
            s.close()
