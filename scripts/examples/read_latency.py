"""Read latency of the client's replica, threaded and on an asyncio loop.

    PYTHONPATH=. python scripts/examples/read_latency.py

Starts a real in-memory clone-server (clone.testing.CloneServer), writes one
key, and times get() (median of five runs of 50,000 calls), the old path
through the agent's command pipe, and a sequential awaited confirmed set.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

from clone import Clone
from clone.aio import AsyncClone
from clone.client import verbs
from clone.testing import CloneServer


def per_call(fn: Callable[[], object], n: int = 50_000) -> float:
    """Microseconds per call, the median of five runs."""
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(runs)


async def on_the_loop(endpoint: str) -> None:
    async with AsyncClone(endpoint, heartbeat=0.1) as c:
        await c.set("/flags/x", b"1")
        print(f"AsyncClone.get on the loop: {per_call(lambda: c.get('/flags/x')):.2f} us")
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            await c.set("/flags/y", b"1")
        print(
            f"await set, confirmed, one at a time: {(time.perf_counter() - start) / n * 1e6:.0f} us"
        )


def main() -> None:
    with CloneServer() as srv:
        with Clone(srv.endpoint, heartbeat=0.1) as c:
            c.wait_synced(10)
            c.set("/flags/x", b"1", wait=True)
            print(f"Clone.get, a key present: {per_call(lambda: c.get('/flags/x')):.2f} us")
            print(f"Clone.get, a key absent: {per_call(lambda: c.get('/flags/none')):.2f} us")
            through_pipe = per_call(lambda: c._request(verbs.GET, [b"/flags/x"]), 5000)
            print(f"GET through the agent's command pipe (the old path): {through_pipe:.2f} us")
        asyncio.run(on_the_loop(srv.endpoint))


if __name__ == "__main__":
    main()
