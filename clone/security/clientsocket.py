"""A CURVE client socket's setup: the one piece of the package a client needs.

Kept apart from :mod:`.zap` (the server's Gatekeeper), which imports pyzmq's
``zmq.auth.thread`` and with it asyncio, part of the 20-30 ms this saved every
``clone`` command's start (docs/benchmarks.md), for a ZAP handler a client
never runs.
"""

from __future__ import annotations

from typing import Any

import zmq

from clone.security.certs import KeyPair

__all__ = ["configure_client_socket"]


def configure_client_socket(sock: zmq.Socket[Any], keypair: KeyPair, server_public: bytes) -> None:
    """Make ``sock`` a CURVE client of the server holding ``server_public``; before ``connect``."""
    if sock.get(zmq.LAST_ENDPOINT):
        raise ValueError("configure_client_socket must be called before connect/bind")
    sock.curve_serverkey = server_public
    sock.curve_publickey = keypair.public
    sock.curve_secretkey = keypair.secret
