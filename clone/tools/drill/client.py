"""One drill client: a real ``clone.Clone`` writing on a schedule and logging events.

Run by :mod:`clone.tools.drill` as ``python -m clone.tools.drill.client ...``.

How this works: the process syncs the ``/drill/`` subtree, waits for the shared
start time, then writes unique keys ``/drill/<id>/g<gen>/<n>`` at ``--rate`` per
second: every ``--confirm-every``-th write is a confirmed write (``wait=True``),
the others fire and forget.  ``<gen>`` is the incarnation: a client restarted by
the drill writes new keys, so every write is decidable at the end (present or
lost).  With ``--ttl-per-tick`` it also writes ephemeral keys
``/drill/<id>/ttl/g<gen>/<n>`` that must all be gone at the end.  Each value is
``<id>|g<gen>|<n>|<write id>|`` padded: the write id (a UUIDv7, hex) is what the
``uuid`` field of the events carries, for writes and for the updates that bring
them back.

With ``--shared-keys N`` (the drill passes 8 by default) every tick also writes
one of N keys that every client overwrites, ``/drill/shared/<k>`` with ``k``
drawn at random: written once, a key cannot show a revert to an older value,
so these keys are there to be overwritten, by everyone, with confirmed (every
``--confirm-every``-th of them) and unconfirmed writes alike.  Their values have
the same form, ``<id>|g<gen>|<m>|<write id>|`` with ``m`` counting the client's
shared writes, so the drill can tell which write a final value came from.

Every change the client applies is logged as an ``update`` (key, sequence, write
id, and the server it was synced from); a ``write_confirmed`` names that server
too.  A thread polls ``status()`` every 20 ms: when the server the client is
active on changes, it logs ``failover_detected`` and then ``failover_done`` with
``gap_s``, the longest silence between two updates around the failover -- from
the last update the old server delivered to the first one from the new server
once its snapshot is complete (the agent delivers nothing in between).

With ``--lock-hold S`` (the drill gives it to ``--lock-clients`` of the
clients) a second ``Clone``, on its own subtree ``/drill-lock/`` so that the
lock's keys stay out of the ``/drill/`` state the drill compares, contends
for one lock, :data:`LOCK_NAME`, during the write period: it takes it
(:class:`clone.recipes.Lock`, ``--lock-ttl``), logs ``lock_acquired`` with the
lock's fencing ``token``, holds it ``S`` seconds, logs ``lock_released`` (or
``lock_lost`` if the lock was no longer held by then) with the same token, lets
go, and queues again.  The drill checks that no holder got the same or a lower
token than one before it (:func:`clone.tools.drill.analysis.lock_fencing`).

With ``--locks N`` every tick also takes a step on one of N lock keys
``/drill/lock/<k>``: if the client holds it, it releases it (a delete with
``if_sequence``, ``lock_released``), else it tries to take it (a confirmed
write with ``if_sequence=0``, only if absent: ``lock_taken`` with the
sequence, or nothing when another holds it).  A split brain's heal may keep a
take or release of the island's as a conflict: the client is told
(``Clone.on_conflict``), logs ``write_conflict`` for any such write and
``lock_lost`` for a lock it believed it held.

After the write period and a settle time, it logs ``final_state``: a SHA-256 of
the sorted ``/drill/`` items and the key count, and writes the items to
``--state`` for the drill to compare.  Events go one JSON object per line to
``--events``, line-buffered, so a client killed with -9 loses at most the line
being written.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import json
import logging
import random
import re
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, TextIO

from clone import Clone, ConfirmTimeout, Entry
from clone.errors import CloneError, Conflict, SplitConflict
from clone.recipes import Lock
from clone.wire.codec import new_uuid

__all__ = [
    "DEFAULT_SHARED_KEYS",
    "DRILL_PREFIX",
    "FENCED_LOCK_PREFIX",
    "LOCK_NAME",
    "SHARED_PREFIX",
    "LOCK_PREFIX",
    "EventLog",
    "burst_key",
    "main",
    "parse_value",
    "shared_key",
    "state_hash",
    "write_key",
]

log = logging.getLogger("clone.tools.drill.client")

DRILL_PREFIX = "/drill/"
# Keys every client overwrites; no client id may be "shared".
#: A unique key: ``/drill/<client>/[ttl/]g<gen>/<n>``, written once.
UNIQUE_KEY_RE = re.compile(r"^/drill/(?P<client>[^/]+)/(?P<ttl>ttl/)?g(?P<gen>\d+)/(?P<n>\d+)$")
SHARED_PREFIX = DRILL_PREFIX + "shared/"
# Keys taken and released with compare-and-set (--locks); no client id may be "lock".
LOCK_PREFIX = DRILL_PREFIX + "lock/"
DEFAULT_SHARED_KEYS = 8
#: The one lock the lock workload contends for, in a subtree of its own.
FENCED_LOCK_PREFIX = "/drill-lock/"
LOCK_NAME = FENCED_LOCK_PREFIX + "one"
_POLL_S = 0.02


def write_key(client: str, gen: int, n: int, *, ttl: bool = False) -> str:
    return f"{DRILL_PREFIX}{client}/{'ttl/' if ttl else ''}g{gen}/{n}"


def shared_key(k: int) -> str:
    return f"{SHARED_PREFIX}{k}"


def make_value(client: str, gen: int, n: int, write_id: str, size: int) -> bytes:
    text = f"{client}|g{gen}|{n}|{write_id}|"
    return text.ljust(size, ".").encode()


def parse_value(value: bytes | None) -> str | None:
    """The write id carried in a drill value, or None."""
    if not value:
        return None
    parts = value.split(b"|")
    if len(parts) < 5:
        return None
    return parts[3].decode("ascii", "replace")


def state_hash(items: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 over the sorted (key, value) pairs: equal states, equal hashes."""
    h = hashlib.sha256()
    for key, value in sorted(items):
        h.update(key.encode())
        h.update(b"\0")
        h.update(len(value).to_bytes(4, "big"))
        h.update(value)
    return h.hexdigest()


class EventLog:
    """events.jsonl writer shared by threads; one flushed line per event."""

    def __init__(self, stream: TextIO, client: str) -> None:
        self._stream = stream
        self._client = client
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        record = {"ts": time.time(), "client": self._client, "event": event}
        record.update({k: v for k, v in fields.items() if v is not None})
        line = json.dumps(record, separators=(",", ":")) + "\n"
        with self._lock:
            self._stream.write(line)
            self._stream.flush()


class _UpdateTracker:
    """Timestamps of updates (for failover gaps) and the update log."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        # The server the client is synced from, as the failover watch last saw it
        # (20 ms polls): which server an update came from, for the partition drills.
        self.server: str | None = None
        self.lock = threading.Lock()
        self.times: list[float] = []
        self.count = 0

    def on_change(self, entry: Entry) -> None:
        now = time.time()
        wire_uuid: bytes = getattr(entry, "uuid", b"") or b""
        uid = parse_value(entry.value) or (wire_uuid.hex() if wire_uuid else None)
        with self.lock:
            self.times.append(now)
            self.count += 1
        self.events.emit("update", key=entry.key, seq=entry.sequence, uuid=uid,
                         server=self.server)

    def last_before(self, t: float) -> float | None:
        with self.lock:
            i = bisect.bisect_left(self.times, t)
            return self.times[i - 1] if i else None

    def first_after(self, t: float) -> float | None:
        with self.lock:
            i = bisect.bisect_right(self.times, t)
            return self.times[i] if i < len(self.times) else None

    def max_gap(self, start: float, end: float) -> float:
        """The longest interval between consecutive updates that overlaps [start, end]."""
        with self.lock:
            lo = max(0, bisect.bisect_left(self.times, start) - 1)
            hi = bisect.bisect_right(self.times, end) + 1
            window = self.times[lo:hi]
        return max((b - a for a, b in itertools.pairwise(window)), default=0.0)


class _FailoverWatch(threading.Thread):
    """Polls status(); logs failover_detected / failover_done with the observed gap."""

    def __init__(
        self, client: Clone, tracker: _UpdateTracker, events: EventLog, names: dict[str, str]
    ) -> None:
        super().__init__(name="drill-failover-watch", daemon=True)
        self.client, self.tracker, self.events = client, tracker, events
        self.names = names
        self.stop = threading.Event()
        self.active_server: str | None = None
        self.failovers = 0

    def run(self) -> None:
        detected_at: float | None = None
        detected_from: str | None = None
        waiting: tuple[str | None, str, float, float] | None = None
        while not self.stop.wait(_POLL_S):
            try:
                st = self.client.status()
            except CloneError as exc:
                log.warning("status() failed: %s", exc)
                continue
            now = time.time()
            server = None if st.server is None else self.names.get(st.server, st.server)
            self.tracker.server = server
            if waiting is not None and self._finish(waiting, now):
                waiting = None
            if self.active_server is None:
                if st.state == "active":
                    self.active_server = server
                continue
            # Leaving the server we were active on: the agent fails over to the next
            # one at once (its status names the server it now syncs from).  A resync
            # from the same server (after a gap) is not a failover.
            if detected_at is None and server != self.active_server:
                detected_at, detected_from = now, self.active_server
                self.events.emit("failover_detected", **{"from": detected_from})
            if st.state == "active" and server is not None and detected_at is not None:
                waiting = (detected_from, server, detected_at, now)
                self.active_server = server
                detected_at = detected_from = None

    def _finish(self, waiting: tuple[str | None, str, float, float], now: float) -> bool:
        """Log failover_done once the new server delivered its first update."""
        old, new, t_detect, t_active = waiting
        first_new = self.tracker.first_after(t_active - 2 * _POLL_S)
        if first_new is None and now - t_active < 30:
            return False
        end = first_new if first_new is not None else now
        last_old = self.tracker.last_before(t_detect - 2 * _POLL_S)
        gap = self.tracker.max_gap(last_old if last_old is not None else t_detect, end)
        self.events.emit("failover_done", gap_s=round(gap, 4), **{"from": old, "to": new})
        self.failovers += 1
        return True


class _LockWorkload(threading.Thread):
    """Contends for :data:`LOCK_NAME` until stopped, logging each hold with its token.

    A client of its own (subtree ``/drill-lock/``), started and closed here.
    """

    def __init__(
        self, args: argparse.Namespace, events: EventLog, names: dict[str, str]
    ) -> None:
        super().__init__(name="drill-lock", daemon=True)
        self.args, self.events, self.names = args, events, names
        self.stop = threading.Event()

    def run(self) -> None:
        args = self.args
        client = Clone(None, subtree=FENCED_LOCK_PREFIX, heartbeat=args.heartbeat,
                       confirm_timeout=args.confirm_timeout)
        with client:
            for endpoint in args.servers.split(","):
                client.connect(endpoint)
            while not self.stop.is_set():
                try:
                    client.wait_synced(args.sync_timeout)
                    self._hold_once(client)
                except CloneError as exc:  # a failover or a cut: try again
                    self.events.emit("lock_error", error=str(exc)[:200])
                    self.stop.wait(0.2)

    def _hold_once(self, client: Clone) -> None:
        lock = Lock(client, LOCK_NAME, ttl=self.args.lock_ttl)
        before = self._server(client)
        if not lock.acquire(timeout=1.0):
            return
        token = lock.token
        try:
            # Which server granted it, as far as the client knows (a split brain
            # has two that do).  Asked after the grant, the client may already
            # have failed over: ``servers`` names every one it was on from
            # before the acquire to now, so the judge can see a grant that may
            # have been either side's.
            server = self._server(client)
            servers = sorted({n for n in (before, server) if n is not None})
            self.events.emit("lock_acquired", token=token, server=server, servers=servers)
            self.stop.wait(self.args.lock_hold)
            self.events.emit("lock_released" if lock.held else "lock_lost", token=token)
        finally:
            lock.release()

    def _server(self, client: Clone) -> str | None:
        where = client.status().server
        return None if where is None else self.names.get(where, where)


def _sleep_until(t: float) -> None:
    while True:
        d = t - time.time()
        if d <= 0:
            return
        time.sleep(min(d, 0.5))


def _await_start(args: argparse.Namespace) -> None:
    """Say we are synced (``<events>.ready``), then wait for the drill's start
    time in ``--start-file`` and move every planned time by as much: on a busy
    machine a client took longer to start than the drill allowed, and wrote
    nothing before its fault."""
    Path(args.events).with_suffix(".ready").touch()
    start = Path(args.start_file)
    deadline = time.monotonic() + args.sync_timeout + 120
    while not start.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        begin = float(start.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        log.warning("%s: no start time in %s; starting as planned", args.id, start)
        return
    shift = begin - args.start_at
    args.start_at += shift
    args.final_at += shift
    if args.burst_at:
        args.burst_at += shift


def run(args: argparse.Namespace) -> int:
    rng = random.Random(f"{args.seed}-{args.id}-{args.gen}")
    Path(args.events).parent.mkdir(parents=True, exist_ok=True)
    with open(args.events, "a", buffering=1) as stream:
        events = EventLog(stream, args.id)
        tracker = _UpdateTracker(events)
        client = Clone(
            None,
            subtree=DRILL_PREFIX,
            heartbeat=args.heartbeat,
            confirm_timeout=args.confirm_timeout,
        )
        locks = _Locks(client, events, args)
        with client:
            client.on_change(tracker.on_change)
            client.on_conflict(locks.on_conflict)
            for endpoint in args.servers.split(","):
                client.connect(endpoint)
            t0 = time.monotonic()
            client.wait_synced(args.sync_timeout)
            log.info("%s g%d synced in %.3f s: %s", args.id, args.gen, time.monotonic() - t0,
                     client.status())
            endpoints = args.servers.split(",")
            names = dict(zip(endpoints, args.names.split(","), strict=False)) if args.names else {}
            watch = _FailoverWatch(client, tracker, events, names)
            watch.start()
            locker = _LockWorkload(args, events, names) if args.lock_hold > 0 else None
            if args.start_file:
                _await_start(args)
            _sleep_until(args.start_at)
            if locker is not None:
                locker.start()
            _write_loop(client, events, args, rng, names, locks)
            if locker is not None:
                locker.stop.set()
                locker.join(args.lock_ttl + args.confirm_timeout)
            _sleep_until(args.final_at)
            watch.stop.set()
            watch.join(2)
            items = client.items(DRILL_PREFIX)
            digest = state_hash(items)
            events.emit("final_state", hash=digest, keys=len(items))
            state = {k: parse_value(v) for k, v in items}
            Path(args.state).write_text(json.dumps(
                {"client": args.id, "gen": args.gen, "hash": digest, "items": state,
                 "status": _status_dict(client)}
            ))
            log.info("%s final state: %d keys, hash %s", args.id, len(items), digest[:12])
    return 0


def _status_dict(client: Clone) -> dict[str, Any]:
    st = client.status()
    return {"state": st.state, "server": st.server, "sequence": st.sequence, "keys": st.keys,
            "pending_writes": st.pending_writes, "counters": st.counters}


def _write_loop(
    client: Clone,
    events: EventLog,
    args: argparse.Namespace,
    rng: random.Random,
    names: dict[str, str],
    locks: _Locks,
) -> None:
    interval = 1.0 / args.rate
    next_t = time.time()
    end = args.start_at + args.write_seconds
    n = ttl_n = shared_n = 0
    # Its own generator, so that the ttl choices stay what they were without it.
    pick = random.Random(f"{args.seed}-{args.id}-{args.gen}-shared")
    burst = args.burst
    while True:
        now = time.time()
        if burst and now >= args.burst_at:
            _burst(client, events, args, burst)
            burst = 0
            continue
        if now >= end:
            return
        if next_t > now:
            time.sleep(min(next_t - now, end - now))
            continue
        # Keep a steady rate, but do not burst to catch up after a long stall.
        next_t = max(next_t + interval, now - 0.5)
        confirmed = args.confirm_every > 0 and n % args.confirm_every == 0
        _one_write(client, events, args, write_key(args.id, args.gen, n), n, confirmed,
                   names=names)
        n += 1
        # A confirmed write may wait up to --confirm-timeout: a tick that began
        # before the end and waited past it starts nothing more, or its later
        # steps change the state after the others took theirs (a loaded run: one
        # client's lock step 0.5 s after another's final state, "not converged").
        if args.shared_keys > 0 and time.time() < end:
            key = shared_key(pick.randrange(args.shared_keys))
            confirmed = args.confirm_every > 0 and shared_n % args.confirm_every == 0
            _one_write(client, events, args, key, shared_n, confirmed, names=names)
            shared_n += 1
        if args.locks > 0 and time.time() < end:
            locks.step(pick.randrange(args.locks))
        if time.time() >= end:
            return
        for _ in range(args.ttl_per_tick):
            ttl = round(rng.uniform(args.ttl_min, args.ttl_max), 3)
            key = write_key(args.id, args.gen, ttl_n, ttl=True)
            _one_write(client, events, args, key, ttl_n, False, ttl=ttl)
            ttl_n += 1


class _Locks:
    """--locks: take and release lock keys with compare-and-set; hear conflicts."""

    def __init__(self, client: Clone, events: EventLog, args: argparse.Namespace) -> None:
        self.client = client
        self.events = events
        self.args = args
        self.held: dict[str, tuple[int, str]] = {}  # key -> (sequence, write id)
        self.lock = threading.Lock()
        self.n = 0

    def step(self, k: int) -> None:
        key = f"{LOCK_PREFIX}{k}"
        with self.lock:
            held = self.held.get(key)
        try:
            if held is not None:
                self.client.delete(key, wait=True, if_sequence=held[0])
                with self.lock:
                    self.held.pop(key, None)
                self.events.emit("lock_released", key=key, uuid=held[1])
                return
            write_id = new_uuid().hex()
            value = make_value(self.args.id, self.args.gen, self.n, write_id, self.args.value_size)
            self.n += 1
            seq = self.client.set(key, value, wait=True, if_sequence=0)
            with self.lock:
                self.held[key] = (seq, write_id)
            self.events.emit("lock_taken", key=key, uuid=write_id, seq=seq)
        except Conflict:
            if held is not None:  # our hold is gone (another side's heal)
                with self.lock:
                    self.held.pop(key, None)
                self.events.emit("lock_lost", key=key, uuid=held[1], why="conflict")
        except CloneError as exc:  # a timeout, a refusal: the lock is not ours to count
            log.info("lock step on %s: %s", key, exc)

    def on_conflict(self, conflict: SplitConflict) -> None:
        """A confirmed write of ours became a split-brain conflict."""
        self.events.emit("write_conflict", key=conflict.key, uuid=conflict.uuid.hex())
        with self.lock:
            held = self.held.pop(conflict.key, None) if conflict.key.startswith(LOCK_PREFIX) \
                else None
        if held is not None:
            self.events.emit("lock_lost", key=conflict.key, uuid=held[1], why="split-conflict")


def burst_key(client: str, gen: int, n: int) -> str:
    return f"{DRILL_PREFIX}{client}/burst/g{gen}/{n}"


def _burst(client: Clone, events: EventLog, args: argparse.Namespace, count: int) -> None:
    """``count`` unconfirmed writes as fast as the client takes them (the
    partition-split drill's split-brain backlog), each logged as a write."""
    started = time.time()
    events.emit("burst_start", count=count)
    for n in range(count):
        _one_write(client, events, args, burst_key(args.id, args.gen, n), n, False)
    events.emit("burst_done", count=count, seconds=round(time.time() - started, 3))
    log.info("%s wrote %d burst keys in %.1f s", args.id, count, time.time() - started)


def _one_write(
    client: Clone,
    events: EventLog,
    args: argparse.Namespace,
    key: str,
    n: int,
    confirmed: bool,
    ttl: float = 0,
    names: dict[str, str] | None = None,
) -> None:
    write_id = new_uuid().hex()
    value = make_value(args.id, args.gen, n, write_id, args.value_size)
    events.emit("write_sent", key=key, uuid=write_id, confirmed=confirmed)
    try:
        client.set(key, value, ttl=ttl, wait=confirmed)
    except ConfirmTimeout:
        events.emit("write_timeout", key=key, uuid=write_id, confirmed=False)
        return
    except CloneError as exc:  # e.g. the agent did not answer in time
        log.warning("write of %s failed: %s", key, exc)
        events.emit("write_timeout", key=key, uuid=write_id, confirmed=False)
        return
    if confirmed:
        # Whose KVPUB confirmed it: the server the client is synced from (a
        # failover in between can blur it by a poll; the partition drills use it).
        try:
            where = client.status().server
        except CloneError:
            where = None
        server = None if where is None else (names or {}).get(where, where)
        events.emit("write_confirmed", key=key, uuid=write_id, confirmed=True, server=server)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clone.tools.drill.client")
    p.add_argument("--id", required=True, help="client id, e.g. c0")
    p.add_argument("--gen", type=int, default=0, help="incarnation (restarts count up)")
    p.add_argument("--servers", required=True, help="comma-separated CHP endpoints")
    p.add_argument("--names", default="", help="names of the servers, same order")
    p.add_argument("--heartbeat", type=float, default=1.0, help="servers' heartbeat, seconds")
    p.add_argument("--rate", type=float, default=20.0, help="writes per second")
    p.add_argument("--confirm-every", type=int, default=4, help="every k-th write is confirmed")
    p.add_argument("--confirm-timeout", type=float, default=10.0)
    p.add_argument("--ttl-per-tick", type=int, default=0, help="ephemeral writes per tick")
    p.add_argument("--shared-keys", type=int, default=0,
                   help="also overwrite one of this many shared keys per tick (0: none)")
    p.add_argument("--lock-hold", type=float, default=0.0,
                   help="also take the drill's lock and hold it S seconds, again and again"
                   " (0: no lock workload)")
    p.add_argument("--lock-ttl", type=float, default=2.0, help="the lock's lease ttl")
    p.add_argument("--locks", type=int, default=0,
                   help="also take or release one of this many lock keys per tick (0: none)")
    p.add_argument("--ttl-min", type=float, default=0.5)
    p.add_argument("--ttl-max", type=float, default=2.0)
    p.add_argument("--value-size", type=int, default=64)
    p.add_argument("--start-at", type=float, required=True, help="Unix time to start writing")
    p.add_argument("--write-seconds", type=float, required=True)
    p.add_argument("--final-at", type=float, required=True, help="Unix time to take the state")
    p.add_argument("--sync-timeout", type=float, default=30.0)
    p.add_argument("--start-file", default="",
                   help="once synced, touch <events>.ready and wait for this file: its first"
                   " number is the real start time, and every planned time moves with it")
    p.add_argument("--events", required=True, help="events file (JSON lines, appended)")
    p.add_argument("--state", required=True, help="final state file (JSON)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--burst", type=int, default=0,
                   help="also write this many keys, unconfirmed, as fast as possible")
    p.add_argument("--burst-at", type=float, default=0.0, help="Unix time of the burst")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
