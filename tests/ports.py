"""Free loopback ports for socket tests.

The OS hands out an ephemeral port for a socket bound to port 0; we close it and
hand the number on. CHP needs runs of consecutive ports (P, P+1, P+2), so
``free_base_port`` checks that the whole run is free before it answers.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port", "free_ports", "free_base_port"]

_handed_out: set[int] = set()


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """One free TCP port on 127.0.0.1, never the same twice in a test run."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]


def free_base_port(span: int = 3) -> int:
    """A base port P such that P .. P+span-1 are all free.

    Drawn below the kernel's ephemeral range (usually 32768+) so that outgoing
    connections do not grab the run between our check and the server's bind.
    """
    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, 32000 - span)
        run = range(base, base + span)
        if any(p in _handed_out for p in run):
            continue
        if all(_is_free(p) for p in run):
            _handed_out.update(run)
            return base
    raise RuntimeError("no free run of loopback ports found")
