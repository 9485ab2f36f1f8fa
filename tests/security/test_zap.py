"""The Gatekeeper with real CURVE sockets on 127.0.0.1 ephemeral ports.

Every test has its own zmq.Context (the ZAP endpoint is per context), closes
every socket with linger 0 and terms the context; every wait has a deadline.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import zmq

from clone.errors import SecurityError
from clone.security import (
    PEER_USER,
    ClientKeys,
    Gatekeeper,
    KeyPair,
    configure_client_socket,
    configure_server_socket,
    fingerprint,
)

WAIT = 2.0  # seconds for what must arrive
SILENCE = 0.5  # seconds during which what must not arrive does not

LOG = logging.getLogger("tests.security.gatekeeper")


def _pair() -> KeyPair:
    public, secret = zmq.curve_keypair()
    return KeyPair(public=public, secret=secret)


class Net:
    """A context plus every socket made from it, all closed at teardown."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sockets: list[zmq.Socket[Any]] = []
        self.gatekeepers: list[Gatekeeper] = []

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        self.sockets.append(sock)
        return sock

    def gatekeeper(self, pair_public: bytes, keys: ClientKeys, **kw: Any) -> Gatekeeper:
        gk = Gatekeeper(self.ctx, pair_public, keys, log=LOG, **kw)
        self.gatekeepers.append(gk)
        return gk

    def server(self, keypair: KeyPair) -> tuple[zmq.Socket[Any], str]:
        sock = self.socket(zmq.ROUTER)
        configure_server_socket(sock, keypair)
        sock.bind("tcp://127.0.0.1:*")
        return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def client(
        self, endpoint: str, keypair: KeyPair | None, server_public: bytes
    ) -> zmq.Socket[Any]:
        sock = self.socket(zmq.DEALER)
        sock.sndtimeo = int(WAIT * 1000)  # an admitted send never hangs a test
        if keypair is not None:
            configure_client_socket(sock, keypair, server_public)
        sock.connect(endpoint)
        return sock

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)
        for gk in self.gatekeepers:  # after the sockets: the ZAP rule
            gk.stop()
        self.ctx.term()


@pytest.fixture
def net() -> Iterator[Net]:
    n = Net()
    try:
        yield n
    finally:
        n.close()


def _receive(server: zmq.Socket[Any], timeout: float) -> list[zmq.Frame] | None:
    if not server.poll(int(timeout * 1000)):
        return None
    return server.recv_multipart(copy=False)


def _eventually(check: Callable[[], bool], timeout: float = WAIT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return check()


def _knock(sock: zmq.Socket[Any], payload: bytes = b"x") -> None:
    """A message from a client the handler refuses: without waiting for a
    peer to take it.  After a refused handshake libzmq may hold no pipe for
    the message, and a blocking send waits for a connection that never comes
    (loaded runs hung here until pytest-timeout's 60 s); the connect alone
    makes the handshake the tests count."""
    try:
        sock.send(payload, zmq.NOBLOCK)
    except zmq.Again:
        pass


def test_known_client_gets_its_name_as_user_id(net: Net) -> None:
    server_keys, alice = _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {alice.public: "alice"}))
    gk.start()
    server, endpoint = net.server(server_keys)
    net.client(endpoint, alice, server_keys.public).send(b"hello")
    frames = _receive(server, WAIT)
    assert frames is not None
    assert frames[1].bytes == b"hello"
    assert frames[1].get("User-Id") == "alice"
    assert gk.admitted == 1 and gk.refused == 0


def test_unknown_key_gets_nothing_through_and_is_logged_by_fingerprint(
    net: Net, caplog: pytest.LogCaptureFixture
) -> None:
    server_keys, alice, mallory = _pair(), _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {alice.public: "alice"}))
    gk.start()
    server, endpoint = net.server(server_keys)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        _knock(net.client(endpoint, mallory, server_keys.public), b"let me in")
        assert _receive(server, SILENCE) is None
        assert _eventually(lambda: gk.refused >= 1)
    assert gk.admitted == 0
    assert fingerprint(mallory.public) in caplog.text
    assert "unknown key" in caplog.text
    assert mallory.public.decode() not in caplog.text


def test_pair_key_is_the_peer(net: Net) -> None:
    server_keys = _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {}))
    gk.start()
    server, endpoint = net.server(server_keys)
    net.client(endpoint, server_keys, server_keys.public).send(b"bstar")
    frames = _receive(server, WAIT)
    assert frames is not None
    assert frames[1].get("User-Id") == PEER_USER


def test_pair_key_wins_over_a_client_file_holding_it(
    net: Net, caplog: pytest.LogCaptureFixture
) -> None:
    server_keys = _pair()
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        gk = net.gatekeeper(server_keys.public, ClientKeys(None, {server_keys.public: "copy"}))
    assert "pair's own public key" in caplog.text
    gk.start()
    server, endpoint = net.server(server_keys)
    net.client(endpoint, server_keys, server_keys.public).send(b"x")
    frames = _receive(server, WAIT)
    assert frames is not None and frames[1].get("User-Id") == PEER_USER


def test_replace_keys_admits_a_new_client_without_restart(net: Net) -> None:
    server_keys, bob = _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {}))
    gk.start()
    server, endpoint = net.server(server_keys)
    _knock(net.client(endpoint, bob, server_keys.public), b"early")
    assert _receive(server, SILENCE) is None
    assert _eventually(lambda: gk.refused >= 1)

    gk.replace_keys(ClientKeys(None, {bob.public: "bob"}))
    assert gk.client_keys.name_of(bob.public) == "bob"
    net.client(endpoint, bob, server_keys.public).send(b"now")
    frames = _receive(server, WAIT)
    assert frames is not None
    assert frames[1].bytes == b"now" and frames[1].get("User-Id") == "bob"
    assert gk.running


def test_replace_keys_removes_a_client(net: Net) -> None:
    server_keys, carol = _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {carol.public: "carol"}))
    gk.start()
    server, endpoint = net.server(server_keys)
    gk.replace_keys(ClientKeys(None, {}))
    _knock(net.client(endpoint, carol, server_keys.public))
    assert _receive(server, SILENCE) is None


def test_plain_client_gets_nothing_through(net: Net) -> None:
    server_keys, alice = _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {alice.public: "alice"}))
    gk.start()
    server, endpoint = net.server(server_keys)
    _knock(net.client(endpoint, None, server_keys.public), b"plain")
    assert _receive(server, SILENCE) is None


def test_null_mechanism_on_a_zap_socket_is_refused(net: Net) -> None:
    # The base pyzmq authenticator admits NULL; ours only ever admits CURVE.
    gk = net.gatekeeper(_pair().public, ClientKeys(None, {}))
    gk.start()
    server = net.socket(zmq.ROUTER)
    server.zap_domain = b"clone"
    server.bind("tcp://127.0.0.1:*")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    _knock(net.client(endpoint, None, b""), b"plain")
    assert _receive(server, SILENCE) is None
    assert _eventually(lambda: gk.refused >= 1)


def test_refusals_are_rate_limited(net: Net, caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    server_keys = _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {}), clock=lambda: now[0])
    gk.start()
    server, endpoint = net.server(server_keys)
    with caplog.at_level(logging.WARNING, logger=LOG.name):
        for _ in range(3):
            _knock(net.client(endpoint, _pair(), server_keys.public))
        assert _eventually(lambda: gk.refused >= 3)
        assert caplog.text.count("unknown key") == 1
        now[0] = 60.0
        _knock(net.client(endpoint, _pair(), server_keys.public))
        assert _eventually(lambda: gk.refused >= 4)
        assert _eventually(lambda: caplog.text.count("unknown key") == 2)
    assert "2 more like this" in caplog.text
    assert _receive(server, 0.0) is None


# -- the ZAP-before-bind rule -------------------------------------------------


def test_libzmq_admits_any_key_when_no_zap_handler_runs(net: Net) -> None:
    """Why the rule exists: without a handler (and without ZAP_ENFORCE_DOMAIN)
    libzmq lets every CURVE key in.  This is what configure_server_socket guards."""
    server_keys, stranger = _pair(), _pair()
    server = net.socket(zmq.ROUTER)
    server.curve_server = True
    server.curve_secretkey = server_keys.secret
    server.curve_publickey = server_keys.public
    server.zap_domain = b"clone"
    server.bind("tcp://127.0.0.1:*")
    endpoint = server.getsockopt_string(zmq.LAST_ENDPOINT)
    net.client(endpoint, stranger, server_keys.public).send(b"in")
    assert _receive(server, WAIT) is not None


def test_configure_server_socket_refuses_without_a_gatekeeper(net: Net) -> None:
    sock = net.socket(zmq.ROUTER)
    with pytest.raises(SecurityError, match="start the Gatekeeper before"):
        configure_server_socket(sock, _pair())
    # and the probe left the endpoint free for a Gatekeeper started now
    net.gatekeeper(_pair().public, ClientKeys(None, {})).start()
    configure_server_socket(sock, _pair())


def test_configure_after_bind_is_misuse(net: Net) -> None:
    net.gatekeeper(_pair().public, ClientKeys(None, {})).start()
    sock = net.socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="before bind"):
        configure_server_socket(sock, _pair())
    client = net.socket(zmq.DEALER)
    client.connect(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    with pytest.raises(ValueError, match="before connect"):
        configure_client_socket(client, _pair(), _pair().public)


def test_after_stop_nobody_gets_in(net: Net) -> None:
    """ZAP_ENFORCE_DOMAIN: a server socket outliving its Gatekeeper refuses, not admits."""
    server_keys, alice = _pair(), _pair()
    gk = net.gatekeeper(server_keys.public, ClientKeys(None, {alice.public: "alice"}))
    gk.start()
    server, endpoint = net.server(server_keys)
    gk.stop()
    assert not gk.running
    _knock(net.client(endpoint, alice, server_keys.public))
    assert _receive(server, SILENCE) is None


def test_two_gatekeepers_in_one_context(net: Net) -> None:
    net.gatekeeper(_pair().public, ClientKeys(None, {})).start()
    second = net.gatekeeper(_pair().public, ClientKeys(None, {}))
    with pytest.raises(SecurityError, match="only one may run"):
        second.start()
    assert not second.running


def test_context_manager_and_restart_guard(net: Net) -> None:
    gk = net.gatekeeper(_pair().public, ClientKeys(None, {}))
    with gk:
        assert gk.running
        with pytest.raises(RuntimeError):
            gk.start()
    assert not gk.running
    gk.start()  # the endpoint was released
    assert gk.running


def test_bad_pair_key_is_misuse(net: Net) -> None:
    with pytest.raises(ValueError):
        Gatekeeper(net.ctx, b"short", ClientKeys(None, {}), log=LOG)
