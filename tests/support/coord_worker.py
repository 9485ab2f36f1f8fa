"""A worker process for the coordination tests: a real client in its
own process, so a test can ``kill -9`` it and watch the servers clean up.

    python -m tests.support.coord_worker MODE ENDPOINTS ARGS...

Modes (each prints ``ready`` once set up, and one line per event, flushed):

* ``lease KEY TTL``: a lease, KEY bound to it; then sleep until killed.
* ``cas KEY N``: N compare-and-set increments of the integer at KEY; prints
  ``done CONFLICTS`` and exits.
* ``lock NAME TTL ROUNDS HOLD FILE``: ROUNDS times take the lock, and inside
  it check that FILE is empty, write our pid, hold for HOLD s, check that FILE
  still holds our pid and empty it; prints ``overlap`` on any violation;
  ``ROUNDS`` 0: take it once and hold it until killed (prints ``held``).
* ``elect NAME CANDIDATE TTL``: campaign, print ``leader X`` on each change.
"""

from __future__ import annotations

import os
import sys
import time

from clone import Clone
from clone.errors import Conflict
from clone.recipes import Election, Lock


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _client(endpoints: str) -> Clone:
    client = Clone(endpoints.split(","), heartbeat=0.1, server_timeout=0.5)
    client.wait_synced(10)
    return client


def _lease(client: Clone, key: str, ttl: float) -> None:
    lease = client.lease(ttl)
    client.set(key, str(os.getpid()), lease=lease)
    _say(f"ready {lease.id}")
    while True:
        time.sleep(1)


def _cas(client: Clone, key: str, n: int) -> None:
    _say("ready")
    conflicts = 0
    done = 0
    while done < n:
        entry = client.entry(key)
        value = int(entry.value) if entry is not None and entry.value else 0
        seq = entry.sequence if entry is not None else 0
        try:
            client.set(key, str(value + 1), if_sequence=seq)
        except Conflict as exc:
            conflicts += 1
            # Our replica lags the server: read again once it holds what
            # the server had (the key at exc.current, or later).
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                now = client.entry(key)
                if (now.sequence if now is not None else 0) >= exc.current:
                    break
                time.sleep(0.001)
            continue
        done += 1
    _say(f"done {conflicts}")


def _lock(client: Clone, name: str, ttl: float, rounds: int, hold: float, path: str) -> None:
    _say("ready")
    pid = str(os.getpid())
    if rounds == 0:
        lock = Lock(client, name, ttl=ttl)
        lock.acquire()
        _say("held")
        while True:
            time.sleep(1)
    for _ in range(rounds):
        with Lock(client, name, ttl=ttl):
            with open(path, "r+") as f:
                if f.read():
                    _say("overlap")
                f.seek(0)
                f.truncate()
                f.write(pid)
            time.sleep(hold)
            with open(path, "r+") as f:
                if f.read() != pid:
                    _say("overlap")
                f.seek(0)
                f.truncate()
    _say("done")


def _elect(client: Clone, name: str, candidate: str, ttl: float) -> None:
    election = Election(client, name, candidate, ttl=ttl, on_change=lambda x: _say(f"leader {x}"))
    election.campaign()
    _say("ready")
    while True:
        time.sleep(1)


def main(argv: list[str]) -> int:
    mode, endpoints, *args = argv
    client = _client(endpoints)
    try:
        if mode == "lease":
            _lease(client, args[0], float(args[1]))
        elif mode == "cas":
            _cas(client, args[0], int(args[1]))
        elif mode == "lock":
            _lock(client, args[0], float(args[1]), int(args[2]), float(args[3]), args[4])
        elif mode == "elect":
            _elect(client, args[0], args[1], float(args[2]))
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
