"""CURVE security for Clone: certificates, the ZAP handler, the ACL.

Who may connect is decided by :class:`Gatekeeper` (the ZAP handler: the pair's
own key and the public certificates of the clients directory); what a
connected client may read and write is decided by :class:`Acl`, keyed by the
name the Gatekeeper gives the connection (``frame.get("User-Id")``).  Every
doubt fails closed: an unknown key, a missing ACL table or an unreadable
certificate means no access, never full access.

May import: :mod:`clone.errors`, :mod:`clone.ratelimit` and zmq.  Never
tornado, :mod:`clone.server` or :mod:`clone.client`.

Modules: :mod:`.names` (client names, the reserved peer name), :mod:`.certs`
(certificate files, the clients directory), :mod:`.keys` (a client's
CURVE key files, from arguments or the environment), :mod:`.acl` (the ACL, pure),
:mod:`.zap` (the Gatekeeper and a server socket's setup), :mod:`.clientsocket`
(a client socket's setup).

The server's half (:mod:`.acl`, :mod:`.zap`) is imported on first use of one of
its names: :mod:`.zap` brings pyzmq's ``zmq.auth.thread`` and with it asyncio,
and :mod:`.acl` tomllib: together with ``zmq.utils.monitor``'s asyncio, 20-30 ms
of every ``clone`` command's start (docs/benchmarks.md), for a Gatekeeper and
an ACL no client has.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from clone.security.certs import (
    PUBLIC_SUFFIX,
    SECRET_SUFFIX,
    ClientKeys,
    KeyPair,
    fingerprint,
    keygen,
    load_client_keys,
    load_public,
    load_secret,
)
from clone.security.clientsocket import configure_client_socket
from clone.security.keys import default_curve_files, load_curve_keys
from clone.security.names import PEER_USER, name_problem

if TYPE_CHECKING:
    from clone.security.acl import FULL, NOTHING, Acl, Rights
    from clone.security.zap import ZAP_DOMAIN, ZAP_ENDPOINT, Gatekeeper, configure_server_socket

#: The names imported on first use, and their module.
_LAZY = {
    "FULL": "acl",
    "NOTHING": "acl",
    "Acl": "acl",
    "Rights": "acl",
    "ZAP_DOMAIN": "zap",
    "ZAP_ENDPOINT": "zap",
    "Gatekeeper": "zap",
    "configure_server_socket": "zap",
}

__all__ = [
    "FULL",
    "NOTHING",
    "PEER_USER",
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "ZAP_DOMAIN",
    "ZAP_ENDPOINT",
    "Acl",
    "ClientKeys",
    "Gatekeeper",
    "KeyPair",
    "Rights",
    "configure_client_socket",
    "configure_server_socket",
    "default_curve_files",
    "fingerprint",
    "keygen",
    "load_client_keys",
    "load_curve_keys",
    "load_public",
    "load_secret",
    "name_problem",
]


def __getattr__(name: str) -> Any:
    """PEP 562: the server's half, imported when a name of it is first used."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
