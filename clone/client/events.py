"""The frontend's event side: waiters with deadlines, the event dispatcher, callbacks.

The agent writes events to the event pipe without ever blocking (see
:mod:`clone.client.agent` for the frames).  :class:`Dispatcher` reads them in a
thread of its own and routes each kind through a table to one handler: it
resolves the futures of confirmed writes and calls (:class:`Waiters`, which
also fails them at their deadlines), marks leases kept or lost, feeds the
``changes()`` watchers and hands changes to :class:`Callbacks`, whose thread
runs the application's ``on_change`` callbacks, so that a slow or re-entrant
callback can stall neither the agent nor the confirmations.  Nothing here runs
application code in the dispatcher thread.
"""

from __future__ import annotations

import functools
import heapq
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from clone.client import verbs
from clone.client.leases import Lease
from clone.client.results import STOP, Entry, Watcher
from clone.errors import (
    CloneError,
    ConfirmTimeout,
    NotActive,
    SplitConflict,
    WriteRefused,
    refusal,
)
from clone.wire.calls import Reply, decode_reply
from clone.wire.codec import decode_kvset

__all__ = ["Callbacks", "Dispatcher", "Subscription", "Waiters", "entry_of"]

log = logging.getLogger(__name__)

# How often the event dispatcher wakes up at least (to fail overdue writes).
DISPATCH_POLL_S = 0.1

_Item = Entry | Callable[[], None] | object


def entry_of(frames: list[bytes]) -> Entry:
    """A CHANGE event's entry: five frames of a KVSET, then the resync mark or nothing."""
    resync = len(frames) == 6 and frames[5] == verbs.RESYNC_MARK
    msg = decode_kvset(frames[:5] if resync else frames)
    return Entry(msg.key, msg.body or None, msg.sequence, msg.properties, resync=resync)


class Waiters:
    """Confirmed writes and calls in flight: uuid -> future, and their deadlines.

    ``write_text(key, timeout)`` and ``call_text(what, timeout)`` word the
    timeouts (they name the servers, which the frontend knows).
    """

    def __init__(
        self,
        write_text: Callable[[str, float], str],
        call_text: Callable[[str, float], str],
    ) -> None:
        self._lock = threading.Lock()
        self._writes: dict[bytes, Future[int]] = {}
        self._write_deadlines: list[tuple[float, bytes, str, float]] = []
        self._calls: dict[bytes, Future[Reply]] = {}
        self._call_deadlines: list[tuple[float, bytes, str, float]] = []
        self._write_text = write_text
        self._call_text = call_text

    def add_write(self, uuid: bytes, key: str, timeout: float) -> Future[int]:
        fut: Future[int] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._writes[uuid] = fut
            heapq.heappush(self._write_deadlines, (time.monotonic() + timeout, uuid, key, timeout))
        return fut

    def add_call(self, uuid: bytes, what: str, timeout: float) -> Future[Reply]:
        fut: Future[Reply] = Future()
        fut.set_running_or_notify_cancel()
        with self._lock:
            self._calls[uuid] = fut
            heapq.heappush(self._call_deadlines, (time.monotonic() + timeout, uuid, what, timeout))
        return fut

    def discard(self, uuid: bytes) -> None:
        with self._lock:
            self._writes.pop(uuid, None)
            self._calls.pop(uuid, None)

    def pop_write(self, uuid: bytes) -> Future[int] | None:
        with self._lock:
            return self._writes.pop(uuid, None)

    def pop_call(self, uuid: bytes) -> Future[Reply] | None:
        with self._lock:
            return self._calls.pop(uuid, None)

    def key_of(self, uuid: bytes) -> str:
        with self._lock:
            return next((d[2] for d in self._write_deadlines if d[1] == uuid), "?")

    def __len__(self) -> int:
        with self._lock:
            return len(self._writes) + len(self._calls)

    def expire(self) -> float:
        """Fail the writes and calls past their deadline; seconds to the next."""
        now = time.monotonic()
        expired: list[tuple[Future[Any], Exception]] = []
        with self._lock:
            while self._write_deadlines and self._write_deadlines[0][0] <= now:
                _, uuid, key, timeout = heapq.heappop(self._write_deadlines)
                fut = self._writes.pop(uuid, None)
                if fut is not None:
                    expired.append((fut, ConfirmTimeout(self._write_text(key, timeout))))
            while self._call_deadlines and self._call_deadlines[0][0] <= now:
                _, uuid, what, timeout = heapq.heappop(self._call_deadlines)
                call = self._calls.pop(uuid, None)
                if call is not None:
                    expired.append((call, NotActive(self._call_text(what, timeout))))
            heads = [d[0][0] for d in (self._write_deadlines, self._call_deadlines) if d]
            nxt = min(heads, default=now + DISPATCH_POLL_S)
        for fut, exc in expired:
            if not fut.done():
                fut.set_exception(exc)
        return min(nxt - now, DISPATCH_POLL_S)

    def fail_all(self) -> int:
        """For close(): fail every future still waiting; how many there were."""
        from clone.errors import ClosedError

        with self._lock:
            writes, self._writes = list(self._writes.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for fut in writes:
            if not fut.done():
                fut.set_exception(
                    ClosedError("the client was closed while a write awaited confirmation")
                )
        for call in calls:
            if not call.done():
                call.set_exception(ClosedError("the client was closed while a call awaited"))
        return len(writes) + len(calls)


class Subscription:
    """What :meth:`clone.Clone.on_change` returns: :meth:`cancel` unregisters
    the callback (also usable as a context manager)."""

    __slots__ = ("_callbacks", "callback")

    def __init__(self, callbacks: Callbacks, callback: Callable[[Entry], None]) -> None:
        self._callbacks = callbacks
        self.callback = callback

    @property
    def active(self) -> bool:
        return self._callbacks.registered(self.callback)

    def cancel(self) -> None:
        """Stop calling the callback (a change already queued may still reach it)."""
        self._callbacks.remove(self.callback)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Callbacks:
    """The ``on_change`` callbacks and ``changes()`` watchers, and the thread
    (named ``clone-callbacks-N``) that runs callbacks one at a time."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[Entry], None]] = []
        self._watchers: list[Watcher] = []
        self._queue: queue.SimpleQueue[_Item] | None = None
        self._thread: threading.Thread | None = None

    def add(self, callback: Callable[[Entry], None]) -> Subscription:
        with self._lock:
            self._callbacks.append(callback)
            self._started()
        return Subscription(self, callback)

    def remove(self, callback: Callable[[Entry], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

    def registered(self, callback: Callable[[Entry], None]) -> bool:
        with self._lock:
            return callback in self._callbacks

    def add_watcher(self, watcher: Watcher) -> None:
        with self._lock:
            self._watchers = [w for w in self._watchers if not w.closed]
            self._watchers.append(watcher)

    def remove_watcher(self, watcher: Watcher) -> None:
        watcher.closed = True
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def run_soon(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._started().put(fn)

    def deliver(self, change: Entry) -> None:
        with self._lock:
            for watcher in self._watchers:
                if not watcher.closed:
                    watcher.queue.put(change)
            if self._queue is not None and self._callbacks:
                self._queue.put(change)

    def stop(self) -> None:
        """End every watcher and, after what is queued, the callback thread."""
        with self._lock:
            for watcher in self._watchers:
                watcher.queue.put(STOP)
            if self._queue is not None:
                self._queue.put(STOP)

    def join(self, timeout: float) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _started(self) -> queue.SimpleQueue[_Item]:
        """The callback thread's queue, the thread started if need be (hold ``_lock``)."""
        if self._queue is None:
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(
                target=self._run, args=(self._queue,), name=self._name, daemon=True
            )
            self._thread.start()
        return self._queue

    def _run(self, q: queue.SimpleQueue[_Item]) -> None:
        while True:
            item = q.get()
            if item is STOP:
                return
            if not isinstance(item, Entry):
                assert callable(item)
                try:
                    item()
                except Exception:
                    log.exception("callback %r failed", item)
                continue
            with self._lock:
                callbacks = list(self._callbacks)
            for callback in callbacks:
                try:
                    callback(item)
                except Exception:
                    log.exception("on_change callback %r failed for key %r", callback, item.key)


class Dispatcher:
    """The event pipe's reader: one handler per event kind, chosen by a table."""

    def __init__(
        self,
        events: zmq.Socket[bytes],
        waiters: Waiters,
        callbacks: Callbacks,
        leases: dict[str, Lease],
        leases_lock: threading.Lock,
        stopped: threading.Event,
        name: str,
    ) -> None:
        self._events = events
        self.waiters = waiters
        self.callbacks = callbacks
        self._leases = leases
        self._leases_lock = leases_lock
        self.state = "initial"
        self.active = threading.Event()
        self.stopped = stopped
        #: Called with each new state, in this thread (clone.aio's bridge); quick, never blocking.
        self.state_listeners: list[Callable[[str], None]] = []
        #: Clone.on_conflict's callbacks, run in the callback thread.
        self.conflict_callbacks: list[Callable[[SplitConflict], None]] = []
        self._stop = False
        self._table: dict[bytes, Callable[[list[bytes]], None]] = {
            verbs.CONFIRMED: self._confirmed,
            verbs.REPLY: self._replied,
            verbs.LEASEKEPT: self._lease_kept,
            verbs.LEASELOST: self._lease_lost,
            verbs.FAILED: self._failed,
            verbs.REFUSED: self._refused,
            verbs.CONFLICT: self._conflict,
            verbs.CHANGE: self._changed,
            verbs.STATE: self._state_changed,
        }
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout: float) -> None:
        self._stop = True
        self.thread.join(timeout)

    def _run(self) -> None:
        """Never runs user code."""
        while not self._stop:
            wait = self.waiters.expire()
            try:
                if not self._events.poll(max(1, int(wait * 1000))):
                    continue
                frames = self._events.recv_multipart()
            except zmq.ZMQError as exc:
                log.error("client event pipe failed: %s", exc)
                break
            if frames[0] == verbs.STOPPED:
                self.stopped.set()
                break
            handler = self._table.get(frames[0])
            if handler is not None:
                handler(frames)
        self.active.clear()

    def _confirmed(self, frames: list[bytes]) -> None:
        waiter = self.waiters.pop_write(frames[1])
        if waiter is not None and not waiter.done():
            waiter.set_result(int.from_bytes(frames[2], "big"))

    def _replied(self, frames: list[bytes]) -> None:
        call = self.waiters.pop_call(frames[1])
        if call is not None:
            if not call.done():
                call.set_result(decode_reply(frames[2:]))  # the agent's own encoding
            return
        write = self.waiters.pop_write(frames[1])
        if write is not None and not write.done():
            # A confirmed write of a restricted client, made as a call.
            reply = decode_reply(frames[2:])
            if reply.ok:
                write.set_result(reply.sequence)
            else:
                key = self.waiters.key_of(reply.uuid)
                write.set_exception(refusal(reply.reason or reply.status, key))

    def _lease_kept(self, frames: list[bytes]) -> None:
        with self._leases_lock:
            kept = self._leases.get(frames[1].decode("ascii", "replace"))
        if kept is not None:
            kept._kept_until(float(frames[2]))

    def _lease_lost(self, frames: list[bytes]) -> None:
        lease_id, why = (f.decode("utf-8", "replace") for f in frames[1:3])
        with self._leases_lock:
            lease = self._leases.pop(lease_id, None)
        if lease is not None:
            lease._mark_lost(why)

    def _failed(self, frames: list[bytes]) -> None:
        text = frames[2].decode("utf-8", "replace")
        failed: Future[int] | Future[Reply] | None = self.waiters.pop_write(frames[1])
        if failed is None:
            failed = self.waiters.pop_call(frames[1])
        if failed is not None and not failed.done():
            failed.set_exception(CloneError(f"client agent refused the write: {text}"))
        else:
            log.warning("client agent refused a write: %s", text)

    def _refused(self, frames: list[bytes]) -> None:
        reason, key = (f.decode("utf-8", "replace") for f in frames[2:4])
        waiter = self.waiters.pop_write(frames[1])
        refused = (
            SplitConflict(key, frames[1]) if reason == "conflict" else WriteRefused(reason, key)
        )
        waited = waiter is not None and not waiter.done()
        if waiter is not None and waited:
            waiter.set_exception(refused)
        if isinstance(refused, SplitConflict):
            self._tell_conflict(refused, raised=waited)

    def _conflict(self, frames: list[bytes]) -> None:
        """A write confirmed earlier became a split-brain conflict."""
        self._tell_conflict(SplitConflict(frames[2].decode("utf-8", "replace"), frames[1]))

    def _tell_conflict(self, conflict: SplitConflict, *, raised: bool = False) -> None:
        """Hand a conflict to every on_conflict callback (in the callback
        thread); logged unless an exception already told the writer."""
        if not raised:
            log.warning("%s", conflict)
        for callback in list(self.conflict_callbacks):
            self.callbacks.run_soon(functools.partial(callback, conflict))

    def _changed(self, frames: list[bytes]) -> None:
        self.callbacks.deliver(entry_of(frames[1:]))

    def _state_changed(self, frames: list[bytes]) -> None:
        self.state = frames[1].decode()
        if self.state == "active":
            self.active.set()
        else:
            self.active.clear()
        for listener in list(self.state_listeners):
            try:
                listener(self.state)
            except Exception:
                log.exception("state listener %r failed", listener)
