"""The ZAP handler that decides which CURVE keys may connect, and socket setup.

How this works: libzmq asks the ZAP handler bound at
``inproc://zeromq.zap.01`` in the socket's context about every handshake on a
socket that has a ZAP domain.  :class:`Gatekeeper` runs pyzmq's
:class:`~zmq.auth.thread.ThreadAuthenticator` (its own thread and poller, so
the server's reactor never waits for it) with a credentials callback that
admits the pair's own key and the keys of the clients directory, and a
``curve_user_id`` that names the connection: the client's certificate stem, or
:data:`~clone.security.names.PEER_USER` for the pair.  That name arrives with
every message as ``frame.get("User-Id")``; the server looks it up in the ACL.

The ZAP rule: **a CURVE server socket must never be bound while no ZAP
handler runs in its context.**  libzmq asks the handler per handshake, and
with no handler bound it admits *any* CURVE key.  So: ``Gatekeeper.start()``
before binding, ``Gatekeeper.stop()`` only after closing the server sockets.
:func:`configure_server_socket` enforces the first half (it refuses to
configure a socket when no handler is bound) and sets
``ZAP_ENFORCE_DOMAIN``, with which libzmq refuses rather than admits when the
handler is missing, covering the second half.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import zmq
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from clone.errors import SecurityError
from clone.ratelimit import Throttle
from clone.security.certs import ClientKeys, KeyPair, fingerprint
from clone.security.names import PEER_USER

__all__ = [
    "PUBLISHER_DOMAIN",
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "Gatekeeper",
    "configure_server_socket",
]

ZAP_DOMAIN = b"clone"
#: The publisher's ZAP domain (CURVE and plain): its handshakes are also
#: refused while their address is under a flood penalty (clone.server.penalty).
PUBLISHER_DOMAIN = b"clone-publisher"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


class _ReleasingAuthenticator(Authenticator):
    """Unbinds the ZAP endpoint before closing, so that it is free at once.

    ``close`` alone releases an inproc endpoint only when libzmq reaps the
    socket, later; a Gatekeeper restarted in the same context would meet
    "address in use".  Placed after ThreadAuthenticator in the MRO, this runs
    once the ZAP thread has been joined, when the socket is ours to touch.
    """

    def stop(self) -> None:
        if self.zap_socket is not None and not self.zap_socket.closed:
            try:
                self.zap_socket.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
        super().stop()


class _CloneAuthenticator(ThreadAuthenticator, _ReleasingAuthenticator):
    """pyzmq's ZAP thread, refusing everything but CURVE and naming users.

    Everything here runs in the authenticator's thread, one request at a time,
    which is what makes ``_last`` (the decision the User-Id is taken from)
    safe without a lock.
    """

    def __init__(self, gatekeeper: Gatekeeper, context: zmq.Context[Any], log: Any) -> None:
        super().__init__(context=context, log=log)
        self._gatekeeper = gatekeeper
        self._last: tuple[bytes, str] | None = None

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # The base class admits NULL connections to a socket with a ZAP domain;
        # a server configured for CURVE must never hear from anything else.
        if len(msg) >= 6 and msg[5] != b"CURVE":
            self._gatekeeper._refuse_mechanism(msg[5], msg[3])
            self._send_zap_reply(msg[1], b"400", b"CURVE required")
            return
        penalty = self._gatekeeper.penalty
        if len(msg) >= 6 and msg[2] == PUBLISHER_DOMAIN and penalty is not None:
            try:
                admitted = penalty(msg[3].decode("ascii", "replace"), time.monotonic())
            except Exception:  # a bug here must not kill the ZAP thread
                self.log.exception("ZAP: the flood penalty failed; going on to the key")
                admitted = True
            if not admitted:
                self._send_zap_reply(msg[1], b"300", b"flood penalty")
                return
        await super().handle_zap_message(msg)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        """The credentials provider: is this key admitted?  Remembers the name."""
        try:
            name = self._gatekeeper._decide(z85_key)
        except Exception:  # a bug here must refuse, not kill the ZAP thread
            self.log.exception("ZAP decision failed; refusing the connection")
            name = None
        self._last = (z85_key, name) if name is not None else None
        return name is not None

    def curve_user_id(self, client_public_key: bytes) -> str:
        z85_key = z85.encode(client_public_key)
        last = self._last
        self._last = None
        if last is not None and last[0] == z85_key:
            return last[1]
        # Unreachable as the base class calls it right after an admitting
        # callback; an empty name would still match no ACL table (NOTHING).
        self.log.error("ZAP: no decision for key %s; empty User-Id", fingerprint(z85_key))
        return ""


class Gatekeeper:
    """Admits the pair's key and the clients directory's keys to CURVE sockets.

    ``start()`` before binding any CURVE server socket in ``ctx``; ``stop()``
    after closing them (see the module docstring for why).  ``replace_keys``
    swaps the admitted clients at once (SIGHUP); connections already
    established are not affected, as ZAP only runs at the handshake.
    """

    def __init__(
        self,
        ctx: zmq.Context[Any],
        pair_public: bytes,
        client_keys: ClientKeys,
        *,
        log: logging.Logger,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        fingerprint(pair_public)  # ValueError now rather than a silent refusal later
        self._ctx = ctx
        self._pair_public = pair_public
        self._log = log
        self._throttle = Throttle(log, clock)  # used in the ZAP thread only
        self._lock = threading.Lock()
        self._keys = client_keys
        self._admitted = 0
        self._refused = 0
        self._auth: _CloneAuthenticator | None = None
        #: Asked (from the ZAP thread) about each handshake on the publisher's
        #: domain: ``penalty(address, now)``, False to refuse (clone.server.penalty).
        self.penalty: Callable[[str, float], bool] | None = None
        self._warn_pair_in(client_keys)

    # -- lifecycle -------------------------------------------------------

    def start(self) -> None:
        """Bind the ZAP endpoint and start its thread: before any CURVE bind.

        :class:`SecurityError` if another ZAP handler is already bound in this
        context (two gatekeepers, or a plain ``zmq.auth`` one).
        """
        if self._auth is not None:
            raise RuntimeError("Gatekeeper already started")
        auth = _CloneAuthenticator(self, self._ctx, self._log.getChild("zap"))
        auth.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=auth)
        auth.configure_curve_callback(PUBLISHER_DOMAIN.decode(), credentials_provider=auth)
        try:
            auth.start()
        except zmq.ZMQError as e:
            if auth.zap_socket is not None:
                auth.zap_socket.close(linger=0)
                auth.zap_socket = None  # type: ignore[assignment]
            auth.pipe = None  # type: ignore[assignment]  # never created: keep __del__ quiet
            raise SecurityError(
                f"cannot bind the ZAP handler at {ZAP_ENDPOINT}: {e}; only one may run "
                f"per zmq.Context"
            ) from None
        self._auth = auth
        self._log.debug("ZAP handler started for domain %r", ZAP_DOMAIN)

    def stop(self) -> None:
        """Stop the ZAP thread and unbind; after the CURVE server sockets are closed."""
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()
            self._log.debug("ZAP handler stopped")

    def __enter__(self) -> Gatekeeper:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        """Whether the ZAP thread is alive (a dead one means every handshake waits)."""
        return self._auth is not None and self._auth.is_alive()

    # -- keys and counters -----------------------------------------------

    def replace_keys(self, client_keys: ClientKeys) -> None:
        """Admit exactly these clients from the next handshake on (thread-safe)."""
        self._warn_pair_in(client_keys)
        with self._lock:
            self._keys = client_keys

    @property
    def client_keys(self) -> ClientKeys:
        """The clients currently admitted."""
        with self._lock:
            return self._keys

    @property
    def admitted(self) -> int:
        """Handshakes admitted since construction (pair and clients)."""
        with self._lock:
            return self._admitted

    @property
    def refused(self) -> int:
        """Handshakes refused since construction (unknown keys, non-CURVE peers)."""
        with self._lock:
            return self._refused

    # -- called from the ZAP thread --------------------------------------

    def _decide(self, z85_key: bytes) -> str | None:
        with self._lock:
            if z85_key == self._pair_public:
                name: str | None = PEER_USER
            else:
                name = self._keys.name_of(z85_key)
            if name is None:
                self._refused += 1
            else:
                self._admitted += 1
        if name is None:
            self._throttle.log(
                "unknown-key",
                logging.WARNING,
                "refused a CURVE connection from unknown key %s (not in the clients "
                "directory; add its NAME.key there and send SIGHUP to admit it)",
                fingerprint(z85_key),
            )
        else:
            self._log.debug("admitted %s (key %s)", name, fingerprint(z85_key))
        return name

    def _refuse_mechanism(self, mechanism: bytes, address: bytes) -> None:
        with self._lock:
            self._refused += 1
        self._throttle.log(
            "mechanism",
            logging.WARNING,
            "refused a %s connection from %s: this server requires CURVE",
            mechanism.decode("ascii", "replace"),
            address.decode("utf-8", "replace"),
        )

    def _warn_pair_in(self, client_keys: ClientKeys) -> None:
        name = client_keys.name_of(self._pair_public)
        if name is not None:
            self._log.warning(
                "the clients directory holds the server pair's own public key as %r; "
                "that key is admitted only as the pair peer (%s), with full access",
                name,
                PEER_USER,
            )


def _require_zap_handler(ctx: zmq.Context[Any]) -> None:
    """SecurityError unless a ZAP handler is bound in ``ctx``.

    Probing by binding the ZAP endpoint ourselves: if that succeeds nobody is
    there, and the probe is unbound at once.
    """
    probe = ctx.socket(zmq.REP)
    try:
        probe.bind(ZAP_ENDPOINT)
    except zmq.ZMQError as e:
        if e.errno == zmq.EADDRINUSE:
            return
        raise
    finally:
        if not probe.closed:
            try:
                probe.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass
            probe.close(linger=0)
    raise SecurityError(
        "no ZAP handler runs in this zmq.Context: start the Gatekeeper before "
        "configuring or binding a CURVE server socket, or libzmq admits any key"
    )


def configure_server_socket(sock: zmq.Socket[Any], keypair: KeyPair) -> None:
    """Make ``sock`` a CURVE server checked by the Gatekeeper; call before ``bind``.

    Raises :class:`SecurityError` if no Gatekeeper is running in the socket's
    context, and ``ValueError`` if the socket is already bound or connected.
    """
    if sock.get(zmq.LAST_ENDPOINT):
        raise ValueError("configure_server_socket must be called before bind/connect")
    _require_zap_handler(sock.context)
    sock.curve_server = True
    sock.curve_secretkey = keypair.secret
    sock.curve_publickey = keypair.public
    sock.zap_domain = ZAP_DOMAIN
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
