"""Free loopback ports for socket tests.

The search itself lives in :mod:`clone.tools.procs`, shared with the drills and
benchmarks: ports are drawn below the kernel's ephemeral range, and a CHP base
port comes with its whole run P..P+2 free.
"""

from __future__ import annotations

import os

from clone.tools.procs import PORT_RANGE, free_base_port, free_port, port_is_free

__all__ = ["free_base_port", "free_port", "free_ports", "port_is_free", "worker_port_range"]


def worker_port_range(worker: str, count: int, whole: tuple[int, int] = PORT_RANGE) -> str:
    """``LOW-HIGH`` for ``$CLONE_PORT_RANGE``: xdist worker ``gwN`` of ``count``
    draws its ports (and those of the servers and drills it starts, which
    inherit the variable) from a slice of its own.  Each worker found a port
    free and its server bound it a moment later; another worker's server
    could bind it in between ("Address already in use": a clean-clone run's
    HTTP test)."""
    index = int(worker.removeprefix("gw")) % count
    low, high = whole
    size = (high - low) // count
    return f"{low + index * size}-{low + (index + 1) * size}"


def claim_worker_port_range() -> None:
    """Set ``$CLONE_PORT_RANGE`` in this process for its xdist worker, unless
    set already or not under xdist."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if worker.startswith("gw") and count > 1 and "CLONE_PORT_RANGE" not in os.environ:
        os.environ["CLONE_PORT_RANGE"] = worker_port_range(worker, count)


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
