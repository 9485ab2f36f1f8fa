"""Free loopback ports for socket tests.

The search itself lives in :mod:`clone.tools.procs`, shared with the drills and
benchmarks: ports are drawn below the kernel's ephemeral range, and a CHP base
port comes with its whole run P..P+2 free.
"""

from __future__ import annotations

from clone.tools.procs import free_base_port, free_port, port_is_free

__all__ = ["free_base_port", "free_port", "free_ports", "port_is_free"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports."""
    return [free_port() for _ in range(n)]
