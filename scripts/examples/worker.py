"""A worker that registers itself for discovery and stands for leader.

    python scripts/examples/worker.py tcp://127.0.0.1:5556 node-1

It registers ``/services/workers/NAME`` (value: its pid) under a lease, and
campaigns in the election ``/elections/workers``.  If its process is frozen
for longer than the ttl (SIGSTOP, a VM pause), the servers end its lease, its
key goes away and it stops leading; after SIGCONT both recipes notice the lost
lease and join again with a fresh lease (and a fresh fencing token).  It prints
one line per leadership change and runs until SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading

from clone import Clone
from clone.recipes import Election, Registration


def main(servers: str, name: str, ttl: float = 0.5) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with Clone(servers, heartbeat=0.1) as client:
        client.wait_synced(10)
        key = f"/services/workers/{name}"
        with Registration(client, key, str(os.getpid()), ttl=ttl):
            election = Election(
                client,
                "/elections/workers",
                name,
                ttl=ttl,
                on_change=lambda leader: print(f"leader: {leader}", flush=True),
                on_lost=lambda why: print(f"lost: {why}", flush=True),
            )
            with election:
                print("ready", flush=True)
                stop.wait()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
