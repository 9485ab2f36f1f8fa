"""One default client per process, for scripts: :func:`clone_set`, :func:`clone_get`.

Configured by ``$CLONE_SERVERS`` (comma-separated; default the local pair on
5556/5566) and ``$CLONE_CURVE_SECRET`` / ``$CLONE_SERVER_KEY`` for CURVE,
created at first use and closed at exit.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from clone.security.keys import default_curve_files
from clone.wire.protocol import DEFAULT_BACKUP_PORT, DEFAULT_PRIMARY_PORT

if TYPE_CHECKING:
    from clone.client.frontend import Clone

__all__ = ["DEFAULT_SERVERS", "clone_get", "clone_set", "default_servers"]

DEFAULT_SERVERS = (
    f"tcp://127.0.0.1:{DEFAULT_PRIMARY_PORT}",
    f"tcp://127.0.0.1:{DEFAULT_BACKUP_PORT}",
)


def default_servers() -> list[str]:
    """``$CLONE_SERVERS`` (comma-separated), else the local pair on 5556/5566."""
    env = os.environ.get("CLONE_SERVERS", "")
    servers = [s.strip() for s in env.split(",") if s.strip()]
    return servers or list(DEFAULT_SERVERS)


# --------------------------------------------------------------------------
# One default client per process, for scripts.

_default: Clone | None = None
_default_lock = threading.Lock()


def _default_client() -> Clone:
    global _default
    with _default_lock:
        if _default is None or _default.closed:
            from clone.client.frontend import Clone

            secret, server_key = default_curve_files()
            _default = Clone(default_servers(), curve_secret=secret, server_key=server_key)
        return _default


def _close_default() -> None:
    global _default
    with _default_lock:
        if _default is not None:
            _default.close()
            _default = None


atexit.register(_close_default)


def clone_set(key: str, value: bytes | str, ttl: float = 0, *, timeout: float = 10.0) -> None:
    """A confirmed write through the default client (``$CLONE_SERVERS``, and
    ``$CLONE_CURVE_SECRET`` / ``$CLONE_SERVER_KEY`` for CURVE)."""
    client = _default_client()
    client.set(key, value, ttl, wait=True, timeout=timeout)


def clone_get(key: str, default: bytes | None = None, *, timeout: float = 10.0) -> bytes | None:
    """Read ``key`` from the default client (configured as for :func:`clone_set`),
    waiting up to ``timeout`` for its first sync."""
    client = _default_client()
    client.wait_synced(timeout)
    return client.get(key, default)
