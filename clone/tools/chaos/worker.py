"""One chaos client process: a real ``clone.Clone`` doing one kind of traffic and
recording every operation with its invoke and complete times.

Run by :mod:`clone.tools.chaos.runner` as ``python -m clone.tools.chaos.worker
--role ROLE ...``.  The roles (history records: :mod:`.checker`):

* ``writer``: confirmed writes, alternately to a shared key every writer
  overwrites and to a key of its own, each followed by a read of a shared key
  from the local replica;
* ``cas``: increments of a few counters by compare-and-set: read the counter
  from the replica, write ``count+1`` if it is still at that sequence;
* ``lock``: takes the lock (:class:`clone.recipes.Lock`), enters the fenced
  section twice (before and after holding it a while) with the lock's token,
  releases it; the fenced resource (:class:`FencedResource`) is a file that
  refuses a token lower than the last it accepted;
* ``lease``: takes a lease, binds a key to it, and dies (``os._exit``: no
  revoke) after a random while: the checker wants the key gone in time;
* ``watcher``: records every change it is told of (key, sequence, value) and
  every resync its change stream tells (:class:`WatchLog`: the ``epoch``), and
  its client's applied sequence (``status``, whose ``epoch`` is its client's
  resyncs + failovers + gaps, read in the same call).

Times are ``time.monotonic()``: one clock for every process on a machine, and
no wall-clock step (a fault of the run) moves it.  Each record is one flushed
JSON line, so a process stopped with -9 loses at most the line it was writing.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import logging
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from clone import Clone, Entry
from clone.errors import CloneError, Conflict, WriteRefused
from clone.recipes import Lock
from clone.tools.chaos.checker import counter_value, parse_counter

__all__ = ["CHAOS_PREFIX", "LOCK_NAME", "FencedResource", "Recorder", "WatchLog", "main"]

log = logging.getLogger("clone.tools.chaos.worker")

CHAOS_PREFIX = "/chaos/"
SHARED = CHAOS_PREFIX + "shared/"
COUNTERS = CHAOS_PREFIX + "counter/"
LEASES = CHAOS_PREFIX + "lease/"
LOCK_NAME = "/chaos-lock/one"  # outside /chaos/: the lock's keys are not data


class Recorder:
    """history lines of one process; thread-safe, one flushed line per record."""

    def __init__(self, path: Path, proc: str) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(path, "a", buffering=1)
        self._proc = proc
        self._lock = threading.Lock()

    def emit(self, f: str, **fields: Any) -> None:
        rec = {"proc": self._proc, "f": f, **fields}
        line = json.dumps(rec, separators=(",", ":")) + "\n"
        with self._lock:
            self._f.write(line)
            self._f.flush()

    def close(self) -> None:
        self._f.close()


class WatchLog:
    """A watcher's records: every change it is told of (``update``), each
    stamped with its ``epoch``, the number of resyncs told so far, and a
    ``resync`` record where a resync's changes begin.

    The epoch comes from the change stream itself (:attr:`clone.Entry.resync`,
    in order with the changes), not from the client's counters: callbacks run
    in the client's callback thread, behind its agent, so a counter read when
    a change is recorded can already count a resync that came after it (a
    change recorded late, under load or after a pause, then looked like the
    resync's own, and the transitions the resync skipped like a watcher's
    loss: the chaos run's ``watchers`` check failed on it).
    """

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        self.epoch = 0
        # The keys of the resync's changes told since the last live one: a
        # resync tells each key once, so a key told again is the next resync's.
        self._resync_keys: set[str] = set()

    def on_change(self, entry: Entry) -> None:
        t = time.monotonic()
        if not entry.resync:
            self._resync_keys.clear()
        elif not self._resync_keys or entry.key in self._resync_keys:
            self.epoch += 1
            self._resync_keys = {entry.key}
            self._rec.emit("resync", t0=t, t1=t, epoch=self.epoch)
        else:
            self._resync_keys.add(entry.key)
        self._rec.emit("update", key=entry.key, seq=entry.sequence, t0=t, t1=t,
                       epoch=self.epoch,
                       value=None if entry.value is None else entry.value.decode())


class FencedResource:
    """The resource a lock guards: a file that keeps the highest token it
    accepted and refuses a lower one (and the same token from another holder).
    ``flock`` makes each visit atomic across processes; ``n`` orders visits."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def visit(self, token: int, holder: str) -> dict[str, Any]:
        with open(self.path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read().strip()
            state: dict[str, Any] = (json.loads(text) if text
                                     else {"token": -1, "holder": None, "n": 0})
            n = int(state["n"]) + 1
            last = int(state["token"])
            accepted = token > last or (token == last and holder == state["holder"])
            state["n"] = n
            if accepted:
                state["token"], state["holder"] = token, holder
            f.seek(0)
            f.truncate()
            f.write(json.dumps(state))
            f.flush()
            return {"accepted": accepted, "last": last, "n": n}


def _unknown(exc: BaseException) -> str:
    if isinstance(exc, Conflict):
        return "conflict"
    if isinstance(exc, WriteRefused):
        return "refused"
    return "unknown"


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rec = Recorder(Path(args.history), args.id)
        self.rng = random.Random(f"{args.seed}/{args.id}")
        # The lock's keys are not data: only its holders see them.
        subtree = [CHAOS_PREFIX, "/chaos-lock/"] if args.role == "lock" else CHAOS_PREFIX
        self.client = Clone(args.servers, subtree=subtree,
                            heartbeat=args.heartbeat, confirm_timeout=args.timeout)

    def run(self) -> None:
        try:
            self.client.wait_synced(timeout=60)
        except CloneError as exc:
            self.rec.emit("error", t0=time.monotonic(), what=f"not synced: {exc}")
            return
        if self.args.start_file and not self._await_start(Path(self.args.start_file)):
            return
        role = getattr(self, f"_{self.args.role}")
        role()

    def _await_start(self, start: Path) -> bool:
        """Say we are synced (``<history>.ready``), then wait for the run's
        start and end in ``start`` (monotonic times): every client starts
        together, the watchers synced before anyone writes, and the run
        starts when the last one is ready rather than at a fixed delay."""
        Path(self.args.history).with_suffix(".ready").touch()
        deadline = time.monotonic() + 180
        while not start.exists():
            if time.monotonic() >= deadline:
                self.rec.emit("error", t0=time.monotonic(), what=f"no start in {start}")
                return False
            time.sleep(0.02)
        t0, until = (float(x) for x in start.read_text().split()[:2])
        self.args.until = until
        while time.monotonic() < t0:
            time.sleep(min(0.02, max(0.0, t0 - time.monotonic())))
        return True

    def _pace(self) -> None:
        time.sleep(self.rng.uniform(0.5, 1.5) / self.args.rate)

    def _running(self) -> bool:
        until: float = self.args.until
        return time.monotonic() < until

    # -- roles -----------------------------------------------------------------

    def _writer(self) -> None:
        n = 0
        while self._running():
            n += 1
            if n % 2 and self.args.shared_keys:
                key = f"{SHARED}{self.rng.randrange(self.args.shared_keys)}"
            else:
                key = f"{CHAOS_PREFIX}{self.args.id}/{n}"
            value = f"{self.args.id}|{n}"
            t0 = time.monotonic()
            try:
                seq = self.client.set(key, value, wait=True, timeout=self.args.timeout)
                self.rec.emit("write", key=key, value=value, t0=t0, t1=time.monotonic(),
                              res="ok", seq=seq)
            except CloneError as exc:
                self.rec.emit("write", key=key, value=value, t0=t0, t1=time.monotonic(),
                              res=_unknown(exc), why=type(exc).__name__)
            if self.args.shared_keys:
                self._read(f"{SHARED}{self.rng.randrange(self.args.shared_keys)}")
            self._pace()

    def _read(self, key: str) -> None:
        t = time.monotonic()
        e = self.client.entry(key)
        self.rec.emit("read", key=key, t0=t, t1=t, seq=None if e is None else e.sequence,
                      value=None if e is None or e.value is None else e.value.decode())

    def _cas(self) -> None:
        n = 0
        while self._running():
            n += 1
            key = f"{COUNTERS}{self.rng.randrange(self.args.counters)}"
            e = self.client.entry(key)
            expect = 0 if e is None else e.sequence
            count = 0 if e is None or e.value is None else (parse_counter(e.value.decode()) or 0)
            tag = f"{self.args.id}.{n}"
            value = counter_value(count + 1, tag)
            t0 = time.monotonic()
            try:
                seq = self.client.set(key, value, if_sequence=expect, timeout=self.args.timeout)
                self.rec.emit("cas", key=key, expect=expect, value=count + 1, tag=tag, t0=t0,
                              t1=time.monotonic(), res="ok", seq=seq)
            except CloneError as exc:
                self.rec.emit("cas", key=key, expect=expect, value=count + 1, tag=tag, t0=t0,
                              t1=time.monotonic(), res=_unknown(exc), why=type(exc).__name__)
            self._pace()

    def _lock(self) -> None:
        resource = FencedResource(Path(self.args.fence))
        n = 0
        while self._running():
            n += 1
            holder = f"{self.args.id}.{n}"
            lock = Lock(self.client, LOCK_NAME, ttl=self.args.lock_ttl)
            t0 = time.monotonic()
            try:
                got = lock.acquire(timeout=self.args.timeout)
            except CloneError as exc:
                self.rec.emit("acquire", holder=holder, t0=t0, t1=time.monotonic(),
                              res="unknown", why=type(exc).__name__)
                time.sleep(0.2)
                continue
            token = lock.token
            if not got or token is None:
                self.rec.emit("acquire", holder=holder, t0=t0, t1=time.monotonic(), res="fail")
                continue
            self.rec.emit("acquire", holder=holder, t0=t0, t1=time.monotonic(), res="ok",
                          token=token)
            for _ in range(2):
                t = time.monotonic()
                answer = resource.visit(token, holder)
                self.rec.emit("fence", holder=holder, token=token, t0=t, t1=time.monotonic(),
                              **answer)
                time.sleep(self.args.hold)
            self.rec.emit("release", holder=holder, token=token, t0=time.monotonic())
            try:
                lock.release()
            except CloneError as exc:
                log.debug("release: %s", exc)
            self._pace()

    def _lease(self) -> None:
        key = f"{LEASES}{self.args.id}"
        t0 = time.monotonic()
        try:
            lease = self.client.lease(self.args.lease_ttl, timeout=self.args.timeout)
            self.client.set(key, f"{self.args.id}|lease", lease=lease, timeout=self.args.timeout)
            self.rec.emit("lease", key=key, ttl=lease.ttl, t0=t0, t1=time.monotonic(), res="ok")
        except CloneError as exc:
            self.rec.emit("lease", key=key, ttl=self.args.lease_ttl, t0=t0, t1=time.monotonic(),
                          res=_unknown(exc), why=type(exc).__name__)
        time.sleep(self.rng.uniform(0.2, 1.5))
        self.rec.emit("died", t0=time.monotonic())
        self.rec.close()
        os._exit(0)  # no revoke, no goodbye: a dead owner

    def _watcher(self) -> None:
        watch = WatchLog(self.rec)
        self.client.on_change(watch.on_change)
        shown = -1
        while self._running():
            epoch, seq = self._epoch_and_sequence()
            t = time.monotonic()
            if seq != shown:  # the client's applied sequence: never down outside a resync
                self.rec.emit("status", t0=t, t1=t, seq=seq, epoch=epoch)
                shown = seq
            time.sleep(0.05)

    def _epoch_and_sequence(self) -> tuple[int, int]:
        try:
            st = self.client.status()
        except CloneError:
            return 0, 0
        c = st.counters
        return (int(c.get("resyncs", 0)) + int(c.get("failovers", 0)) + int(c.get("gaps", 0)),
                st.sequence)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.rec.close()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clone.tools.chaos.worker")
    p.add_argument("--role", required=True,
                   choices=("writer", "cas", "lock", "lease", "watcher"))
    p.add_argument("--id", required=True)
    p.add_argument("--servers", required=True)
    p.add_argument("--history", required=True)
    p.add_argument("--until", type=float, default=0.0, help="monotonic time to stop")
    p.add_argument("--start-file", default=None,
                   help="once synced, touch <history>.ready and wait for this file: "
                        "'T0 UNTIL' (monotonic), when to start and to stop")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat", type=float, default=0.25)
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--shared-keys", type=int, default=4)
    p.add_argument("--counters", type=int, default=2)
    p.add_argument("--fence", default="fence.state")
    p.add_argument("--lock-ttl", type=float, default=2.0)
    p.add_argument("--hold", type=float, default=0.05)
    p.add_argument("--lease-ttl", type=float, default=1.0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    worker = Worker(args)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
