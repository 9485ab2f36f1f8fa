"""Test doubles that ship with Clone: a real server for tests, and an in-memory fake.

* :class:`CloneServer` starts a real ``clone-server`` (standalone, in memory,
  on free loopback ports) in a child process and stops it; the pytest plugin
  :mod:`clone.testing.pytest_plugin` gives it to a test as the
  ``clone_server`` fixture.  Use it where the behaviour under test is the
  store's: confirmations, leases, compare-and-set, change streams.
* :class:`FakeClone` has the client's API over a dict, in the test's thread:
  no sockets, no threads, no waiting.  Use it for unit tests of code that only
  reads and writes keys.  What it does not model: other clients, failover,
  ttl expiry and lease keepalives (:meth:`FakeClone.lose_lease` plays a lost
  lease).

::

    # conftest.py
    pytest_plugins = ["clone.testing.pytest_plugin"]

    # test_flags.py
    def test_flag_flip(clone_server):
        with Clone(clone_server.endpoint) as c:
            c.wait_synced(10)
            c.set("/flags/beta", b"on", wait=True)
            assert my_app.is_enabled(c, "beta")

    def test_flag_logic(fake_clone):
        fake_clone.set("/flags/beta", b"on")
        assert my_app.is_enabled(fake_clone, "beta")
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from clone.client.args import as_bytes, from_json, to_json
from clone.client.events import Subscription
from clone.client.leases import Lease
from clone.client.results import STOP, ChangeStream, Entry, Freshness, Status, Watcher
from clone.errors import ClosedError, Conflict, LeaseLost, ServerStartError
from clone.wire.calls import lease_id_of
from clone.wire.codec import new_uuid

__all__ = ["CloneServer", "FakeClone"]

log = logging.getLogger(__name__)


class CloneServer:
    """A real standalone ``clone-server``, in memory, on free loopback ports.

    ``endpoint`` is what a client connects to.  ``heartbeat`` in seconds (short,
    so that tests of failure detection are fast).  A context manager; or call
    :meth:`start` and :meth:`stop`.  Its log is ``log_path`` (a temporary file
    unless ``log_dir`` is given), shown in the error if it does not start.
    """

    def __init__(
        self, *extra: str, heartbeat: float = 0.1, log_dir: str | os.PathLike[str] | None = None
    ) -> None:
        self.extra = extra
        self.heartbeat = heartbeat
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self.port = 0
        self.log_path: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> CloneServer:
        from clone import Clone
        from clone.tools.procs import free_base_port

        self.port = free_base_port()
        log_dir = self._log_dir or Path(tempfile.mkdtemp(prefix="clone-testing-"))
        self.log_path = log_dir / f"clone-server-{self.port}.log"
        args = [
            sys.executable,
            "-m",
            "clone.server.cli",
            "--standalone",
            "--in-memory",
            "--bind",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--heartbeat",
            str(max(1, round(self.heartbeat * 1000))),
            *self.extra,
        ]
        with open(self.log_path, "ab") as out:
            self._proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        with Clone(self.endpoint, heartbeat=self.heartbeat) as probe:
            deadline = time.monotonic() + timeout
            while not probe._events.active.wait(0.05):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    tail = self.log_path.read_text(errors="replace")[-2000:]
                    self.stop()
                    raise ServerStartError(f"clone-server did not start on {self.port}:\n{tail}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def __enter__(self) -> CloneServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FakeClone:
    """An in-memory stand-in for :class:`clone.Clone` (see the module docstring).

    Writes apply at once and get the next sequence; ``on_change`` callbacks run
    inline, in the writer's thread; ``changes()`` streams see the writes made
    after they were created.  Always synced.
    """

    def __init__(self, servers: Any = None, subtree: Any = None, **options: Any) -> None:
        self._map: dict[str, Entry] = {}
        self._sequence = 0
        self._callbacks: list[Callable[[Entry], None]] = []
        self._watchers: list[Watcher] = []
        self._leases: dict[str, Lease] = {}
        self._closed = False

    # The client's API -------------------------------------------------

    def __enter__(self) -> FakeClone:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        for lease in list(self._leases.values()):
            lease._mark_ended()
            self._drop_lease(lease.id)
        for watcher in self._watchers:
            watcher.queue.put(STOP)
        self._closed = True

    def wait_synced(self, timeout: float = 10.0) -> None:
        self._check_open()

    def connect(self, endpoint: str) -> None:
        self._check_open()

    def freshness(self) -> Freshness:
        return Freshness(synced=True, state="active", silent_for=0.0)

    def get(
        self,
        key: str,
        default: bytes | None = None,
        *,
        with_status: bool = False,
        require_synced: bool = False,
    ) -> Any:
        found = self.entry(key)
        value = default if found is None else found.value
        return (value, self.freshness()) if with_status else value

    def entry(self, key: str, *, require_synced: bool = False) -> Entry | None:
        self._check_open()
        if not isinstance(key, str):
            raise TypeError(f"key must be str, not {type(key).__name__}")
        return self._map.get(key)

    def entries(self, prefix: str = "") -> list[Entry]:
        self._check_open()
        return [e for k, e in sorted(self._map.items()) if k.startswith(prefix)]

    def iter_entries(self, prefix: str = "", *, page: int = 10_000) -> Iterator[Entry]:
        """As the client's: the entries of one moment (here, the call's)."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        if not 1 <= page <= 1_000_000:
            raise ValueError(f"page must be 1 to 1000000 rows, not {page}")
        return iter(self.entries(prefix))

    def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        return [(e.key, e.value or b"") for e in self.entries(prefix)]

    def get_json(self, key: str, default: Any = None, *, require_synced: bool = False) -> Any:
        found = self.entry(key)
        return default if found is None else from_json(key, found.value or b"")

    def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = 0,
        *,
        wait: bool = False,
        timeout: float | None = None,
        if_sequence: int | None = None,
        lease: Lease | str | None = None,
    ) -> int | None:
        body = as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete() instead")
        sequence = self._apply(key, body, if_sequence, lease)
        return sequence if wait or if_sequence is not None or lease is not None else None

    def set_json(self, key: str, value: Any, ttl: float = 0, **kwargs: Any) -> int | None:
        return self.set(key, to_json(value), ttl, **kwargs)

    def delete(
        self,
        key: str,
        *,
        wait: bool = False,
        timeout: float | None = None,
        if_sequence: int | None = None,
    ) -> int | None:
        sequence = self._apply(key, b"", if_sequence, None)
        return sequence if wait or if_sequence is not None else None

    def set_async(
        self, key: str, value: bytes | str, ttl: float = 0, *, timeout: float | None = None
    ) -> Future[int]:
        return self._done(lambda: self.set(key, value, ttl, wait=True))

    def delete_async(self, key: str, *, timeout: float | None = None) -> Future[int]:
        return self._done(lambda: self.delete(key, wait=True))

    def lease(
        self, ttl: float = 2.0, *, timeout: float | None = None, for_key: str | None = None
    ) -> Lease:
        self._check_open()
        lease = Lease(self, lease_id_of(new_uuid()), float(ttl))
        self._leases[lease.id] = lease
        return lease

    def on_change(self, callback: Callable[[Entry], None]) -> Subscription:
        if not callable(callback):
            raise TypeError("callback must be callable")
        self._check_open()
        self._callbacks.append(callback)
        return Subscription(self, callback)  # type: ignore[arg-type]

    def changes(
        self, timeout: float | None = None, prefix: str = "", *, since: int | None = None
    ) -> ChangeStream:
        if since is not None:
            raise NotImplementedError(
                "FakeClone keeps no history: changes(since=...) needs a server"
            )
        return ChangeStream(self, timeout, prefix)

    def status(self) -> Status:
        return Status(
            state="active",
            server="fake",
            sequence=self._sequence,
            keys=len(self._map),
            pending_writes=0,
            leases=len(self._leases),
        )

    # For tests -------------------------------------------------------------

    def lose_lease(self, lease: Lease, why: str = "unknown-lease (FakeClone.lose_lease)") -> None:
        """Play the servers saying ``lease`` is gone: its keys are deleted and
        its ``on_lost`` callbacks run (inline)."""
        self._drop_lease(lease.id)
        lease._mark_lost(why)

    # What Lease, Subscription and ChangeStream call back ---------------------

    def _revoke_lease(self, lease: Lease, timeout: float | None) -> None:
        self._drop_lease(lease.id)

    def _run_soon(self, fn: Callable[[], None]) -> None:
        fn()

    def _add_watcher(self, watcher: Watcher) -> None:
        self._check_open()
        self._watchers = [w for w in self._watchers if not w.closed]
        self._watchers.append(watcher)

    def _remove_watcher(self, watcher: Watcher) -> None:
        watcher.closed = True
        if watcher in self._watchers:
            self._watchers.remove(watcher)

    def remove(self, callback: Callable[[Entry], None]) -> None:
        """For :class:`Subscription`."""
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def registered(self, callback: Callable[[Entry], None]) -> bool:
        return callback in self._callbacks

    # ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("this FakeClone is closed")

    def _apply(
        self, key: str, body: bytes, if_sequence: int | None, lease: Lease | str | None
    ) -> int:
        self._check_open()
        if not isinstance(key, str) or not key:
            raise ValueError(f"not a key: {key!r}")
        current = self._map.get(key)
        if if_sequence is not None and (current.sequence if current else 0) != if_sequence:
            raise Conflict(key, if_sequence, current.sequence if current else 0)
        props: tuple[tuple[str, str], ...] = ()
        if lease is not None:
            lease_id = lease.id if isinstance(lease, Lease) else lease
            held = self._leases.get(lease_id)
            if held is None or not held.alive:
                raise LeaseLost(lease_id, "unknown to the fake")
            props = (("lease", lease_id),)
        self._sequence += 1
        change = Entry(key, body or None, self._sequence, props)
        if body:
            self._map[key] = change
        else:
            self._map.pop(key, None)
        if current is not None or body:
            self._notify(change)
        return self._sequence

    def _drop_lease(self, lease_id: str) -> None:
        self._leases.pop(lease_id, None)
        for entry in [e for e in self._map.values() if e.lease == lease_id]:
            self._apply(entry.key, b"", None, None)

    def _notify(self, change: Entry) -> None:
        for watcher in self._watchers:
            if not watcher.closed:
                watcher.queue.put(change)
        for callback in list(self._callbacks):
            try:
                callback(change)
            except Exception:
                log.exception("on_change callback %r failed for key %r", callback, change.key)

    @staticmethod
    def _done(fn: Callable[[], int | None]) -> Future[int]:
        fut: Future[int] = Future()
        try:
            result = fn()
            assert result is not None
            fut.set_result(result)
        except Exception as exc:
            fut.set_exception(exc)
        return fut
