"""Why no server gave us a snapshot: the cause, for an error without ``-v``.

How this works: after a :class:`~clone.errors.NotSynced`, one fresh DEALER per
server asks ``STATUS?`` (as ``clone status`` does) with a socket monitor on it,
for a second at most.  The monitor tells a refused key (the CURVE handshake
failed with an auth error) and nothing listening (the connection was retried
and never made) apart from a server that answered, whose status says whether
it is passive: a client that lists only the passive of a pair never syncs,
because a passive server votes for failover but serves no snapshot until its
peer is gone.  Read-only, like ``clone status``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq

from clone.client.agent import split_endpoint
from clone.errors import ProtocolError
from clone.security import KeyPair, configure_client_socket
from clone.wire.frames import Offers, cap_message_size, recv_monitor_event
from clone.wire.protocol import MAX_STATUS_BYTES, SNAPSHOT_OFFSET
from clone.wire.status import decode_status, encode_status_request

__all__ = ["Probe", "explain", "probe"]

_AUTH_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class Probe:
    """What one server showed: ``role`` if it answered, else what the monitor saw."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.role: str | None = None
        self.connected = False
        self.retried = False
        self.refused_key = False
        self.handshake_failed = False


def probe(
    endpoints: Sequence[str], timeout: float, curve: tuple[KeyPair, bytes] | None
) -> list[Probe]:
    """Ask every endpoint at once; stop at the first of all answered or ``timeout``."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    probes = [Probe(e) for e in endpoints]
    socks: list[tuple[Probe, zmq.Socket[bytes], zmq.Socket[bytes]]] = []
    offers = Offers(encode_status_request())
    try:
        poller = zmq.Poller()
        for p in probes:
            host, base = split_endpoint(p.endpoint)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            cap_message_size(sock, MAX_STATUS_BYTES + 64)
            if curve is not None:
                configure_client_socket(sock, *curve)
            monitor = sock.get_monitor_socket()
            sock.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
            offers.offer(sock)  # a refused handshake may leave no connection (Offers)
            poller.register(sock, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            socks.append((p, sock, monitor))
        deadline = time.monotonic() + timeout
        while any(p.role is None and not p.refused_key for p in probes):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready = dict(poller.poll(offers.poll_ms(left)))
            for p, sock, monitor in socks:
                if monitor in ready:
                    _read_monitor(p, monitor)
                if sock in ready:
                    try:
                        p.role = str(decode_status(sock.recv_multipart(zmq.NOBLOCK))["role"])
                    except (zmq.Again, ProtocolError, KeyError):
                        continue
    finally:
        for _, sock, monitor in socks:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
        ctx.term()
    return probes


def _read_monitor(p: Probe, monitor: zmq.Socket[bytes]) -> None:
    while True:
        try:
            event = recv_monitor_event(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        kind = event["event"]
        if kind == zmq.EVENT_CONNECTED:
            p.connected = True
        elif kind == zmq.EVENT_CONNECT_RETRIED:
            p.retried = True
        elif kind == _AUTH_FAILED:
            p.refused_key = True
        elif kind in _HANDSHAKE_FAILED:
            p.handshake_failed = True


def _cause(p: Probe, curve: bool) -> str:
    if p.refused_key:
        return (
            f"{p.endpoint} refused our key: check --curve-secret and --server-key, and that "
            "the server's clients directory holds our public key"
            if curve
            else f"{p.endpoint} requires CURVE: pass --curve-secret and --server-key"
        )
    if p.handshake_failed:
        return (
            f"{p.endpoint} failed the handshake: "
            + ("is it running without CURVE?" if curve else "it may require CURVE "
               "(--curve-secret and --server-key)")
        )
    if p.role is not None:
        return f"{p.endpoint} is {p.role}"
    if not p.connected:
        return f"nothing listening at {p.endpoint}"
    return f"{p.endpoint} accepted the connection but did not answer"


def explain(
    endpoints: Sequence[str], timeout: float, curve: tuple[KeyPair, bytes] | None
) -> str | None:
    """The cause of a failed sync in one line, or None if no server shows one
    (an active answered: the snapshot was only slow)."""
    probes = probe(endpoints, timeout, curve)
    if any(p.role == "active" for p in probes):
        return None
    causes = [_cause(p, curve is not None) for p in probes]
    passive = [p.endpoint for p in probes if p.role == "passive"]
    if passive and len(passive) == len(probes):
        return f"{', '.join(passive)} {'is' if len(passive) == 1 else 'are'} passive; " \
               "list the active too"
    if passive:
        return "; ".join(causes) + "; a passive server serves no snapshot: list the active too"
    return "; ".join(causes)
