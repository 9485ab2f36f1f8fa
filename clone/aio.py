"""The asyncio API: :class:`AsyncClone`; :class:`Lock`, :class:`Election`, :class:`Registration`.

The same client as :class:`clone.Clone`, with the same semantics: an agent
thread still owns the sockets and the replica.  What an asyncio application
would otherwise build by hand is done here:

* reads (:meth:`AsyncClone.get`, ``entry``, ``get_json``) are plain calls: they
  read the replica the agent keeps, in the loop's thread, with no round trip to
  the agent and nothing to await (about a microsecond; docs/benchmarks.md);
* confirmed writes, calls and lease grants are awaited: the client's
  ``concurrent.futures.Future`` (resolved by its event dispatcher thread) is
  bridged with :func:`asyncio.wrap_future`, so no thread waits for them;
* changes arrive on an ``asyncio.Queue`` fed from the dispatcher with
  ``loop.call_soon_threadsafe`` (:meth:`AsyncClone.changes`);
* what blocks in the threaded API by design (opening, closing, a lock's wait,
  an election's campaign) runs in a short-lived thread of its own, awaited the
  same way, never in the loop.

A read after an awaited ``set`` sees it: the agent applies the server's
update to the replica before it confirms the write.

::

    async with AsyncClone("tcp://127.0.0.1:5556") as c:
        await c.set("/config/flag", b"on")
        assert c.get("/config/flag") == b"on"
        async for change in c.changes("/config/"):
            ...
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import Future
from types import TracebackType
from typing import Any, Literal, TypeVar, overload

from clone import recipes
from clone.client.args import as_bytes, build, format_ttl, to_json
from clone.client.frontend import Clone
from clone.client.leases import Lease
from clone.client.results import STOP, CloseReport, Entry, Freshness, Status, Watcher
from clone.errors import ClosedError, NotSynced
from clone.wire.protocol import TTL_PROPERTY

__all__ = ["AsyncChangeStream", "AsyncClone", "Election", "Lock", "Registration"]

T = TypeVar("T")


async def _in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Run a blocking call in a thread of its own and await it (no executor:
    these are rare, and one stuck call must not hold a pool's thread)."""
    fut: Future[T] = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="clone-aio-call", daemon=True).start()
    return await asyncio.wrap_future(fut)


class _LoopQueue(queue.SimpleQueue[Any]):
    """What the dispatcher puts a watcher's changes on: forwarded to an
    ``asyncio.Queue`` in the loop's thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop, target: asyncio.Queue[Any]) -> None:
        super().__init__()
        self._loop = loop
        self._target = target

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        try:
            self._loop.call_soon_threadsafe(self._target.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening
            pass


class AsyncChangeStream(AsyncIterator[Entry]):
    """What :meth:`AsyncClone.changes` returns: registered from its creation,
    so no change is lost before the first ``__anext__``; ``aclose()`` it (or
    use ``async with``) to stop queueing changes for it."""

    def __init__(self, client: Clone, prefix: str, since: int | None) -> None:
        self._client = client
        self._prefix = prefix
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._watcher: Watcher | None = None
        self._feed_stream: Any = None
        if since is None:
            self._watcher = Watcher()
            self._watcher.queue = _LoopQueue(loop, self._queue)
            client._add_watcher(self._watcher)
        else:
            # The replay reads the server's history with sockets of its own; a
            # thread forwards what it yields.
            stream = client.changes(prefix=prefix, since=since)
            self._feed_stream = stream
            forward = _LoopQueue(loop, self._queue)

            def pump() -> None:
                try:
                    for change in stream:
                        forward.put(change)
                except Exception as exc:
                    forward.put(exc)
                forward.put(STOP)

            threading.Thread(target=pump, name="clone-aio-changes", daemon=True).start()

    def __aiter__(self) -> AsyncChangeStream:
        return self

    async def __anext__(self) -> Entry:
        while True:
            item = await self._queue.get()
            if item is STOP:
                await self.aclose()
                raise StopAsyncIteration
            if isinstance(item, Exception):
                await self.aclose()
                raise item
            assert isinstance(item, Entry)
            if item.key.startswith(self._prefix):
                return item

    async def aclose(self) -> None:
        if self._watcher is not None and not self._watcher.closed:
            self._client._remove_watcher(self._watcher)
        if self._feed_stream is not None:
            self._feed_stream.close()

    async def __aenter__(self) -> AsyncChangeStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncClone:
    """A Clone client for asyncio applications (see the module docstring).

    Takes :class:`clone.Clone`'s arguments, plus ``sync_timeout``: opening
    (``async with``, or :meth:`open`) waits that long for the first sync
    (:class:`~clone.errors.NotSynced` after it; None: do not wait).
    """

    def __init__(
        self,
        servers: str | Sequence[str] | None = None,
        subtree: str | Iterable[str] | None = None,
        *,
        sync_timeout: float | None = 10.0,
        **options: Any,
    ) -> None:
        self._servers = servers
        self._subtree = subtree
        self._options = options
        self._sync_timeout = sync_timeout
        self._client: Clone | None = None

    @property
    def client(self) -> Clone:
        """The threaded client underneath (for what this API does not wrap)."""
        if self._client is None:
            raise ClosedError("this AsyncClone is not open: use 'async with' or await open()")
        return self._client

    async def open(self) -> AsyncClone:
        if self._client is None:
            self._client = await _in_thread(
                lambda: Clone(self._servers, self._subtree, **self._options)
            )
        if self._sync_timeout is not None and self._client._servers:
            await self.wait_synced(self._sync_timeout)
        return self

    async def close(self) -> CloseReport | None:
        """Close the client (leases revoked, threads joined); what it dropped."""
        client = self._client
        if client is None:
            return None
        await _in_thread(client.close)
        return client.close_report

    async def __aenter__(self) -> AsyncClone:
        try:
            return await self.open()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def wait_synced(self, timeout: float = 10.0) -> None:
        """Wait until the client holds a complete snapshot, or raise NotSynced."""
        client = self.client
        events = client._events
        if events.active.is_set():
            return
        loop = asyncio.get_running_loop()
        synced: asyncio.Future[None] = loop.create_future()

        def resolve() -> None:
            if not synced.done():
                synced.set_result(None)

        def listener(state: str) -> None:
            if state == "active":
                loop.call_soon_threadsafe(resolve)

        events.state_listeners.append(listener)
        try:
            if events.active.is_set():  # became active before we listened
                return
            await asyncio.wait_for(synced, timeout)
        except TimeoutError:
            tried = ", ".join(client._servers) or "no servers configured"
            raise NotSynced(
                f"no server answered a snapshot request within {timeout:g} s: tried {tried}"
            ) from None
        finally:
            events.state_listeners.remove(listener)

    # ------------------------------------------------------------------
    # Reads: from the replica, nothing to await

    @overload
    def get(
        self,
        key: str,
        default: bytes | None = ...,
        *,
        with_status: Literal[False] = ...,
        require_synced: bool = ...,
    ) -> bytes | None: ...

    @overload
    def get(
        self,
        key: str,
        default: bytes | None = ...,
        *,
        with_status: Literal[True],
        require_synced: bool = ...,
    ) -> tuple[bytes | None, Freshness]: ...

    def get(
        self,
        key: str,
        default: bytes | None = None,
        *,
        with_status: bool = False,
        require_synced: bool = False,
    ) -> bytes | tuple[bytes | None, Freshness] | None:
        """:meth:`clone.Clone.get`: from the local replica, without blocking."""
        if with_status:
            return self.client.get(key, default, with_status=True, require_synced=require_synced)
        return self.client.get(key, default, require_synced=require_synced)

    def entry(self, key: str, *, require_synced: bool = False) -> Entry | None:
        return self.client.entry(key, require_synced=require_synced)

    def get_json(self, key: str, default: Any = None, *, require_synced: bool = False) -> Any:
        return self.client.get_json(key, default, require_synced=require_synced)

    def freshness(self) -> Freshness:
        return self.client.freshness()

    async def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` under ``prefix`` (a copy made by the agent)."""
        return await _in_thread(self.client.items, prefix)

    async def entries(self, prefix: str = "") -> list[Entry]:
        return await _in_thread(self.client.entries, prefix)

    async def status(self) -> Status:
        return await _in_thread(self.client.status)

    # ------------------------------------------------------------------
    # Writes: awaited until the active server confirmed them

    async def set(
        self,
        key: str,
        value: bytes | str,
        ttl: float = 0,
        *,
        timeout: float | None = None,
        if_sequence: int | None = None,
        lease: Lease | str | None = None,
    ) -> int:
        """A confirmed write (:meth:`clone.Clone.set` with ``wait=True``): the
        sequence the active server gave it; ConfirmTimeout, WriteRefused,
        Conflict, LeaseLost or NotActive as there."""
        client = self.client
        if if_sequence is None and lease is None:
            return await asyncio.wrap_future(client.set_async(key, value, ttl, timeout=timeout))
        body = as_bytes(value)
        if not body:
            raise ValueError("an empty value means delete; call delete() instead")
        ttl_text = format_ttl(ttl)
        props = {TTL_PROPERTY: ttl_text} if ttl_text is not None else {}
        fut = client._caller.call_write_async(key, body, props, timeout, if_sequence, lease)
        return await asyncio.wrap_future(fut)

    def set_nowait(self, key: str, value: bytes | str, ttl: float = 0) -> None:
        """A fire-and-forget write: queued for the agent, not awaited."""
        self.client.set(key, value, ttl)

    async def delete(
        self, key: str, *, timeout: float | None = None, if_sequence: int | None = None
    ) -> int:
        client = self.client
        if if_sequence is None:
            return await asyncio.wrap_future(client.delete_async(key, timeout=timeout))
        build(key, b"", {})  # a bad key is the caller's error, here
        fut = client._caller.call_write_async(key, b"", {}, timeout, if_sequence, None)
        return await asyncio.wrap_future(fut)

    async def set_json(
        self,
        key: str,
        value: Any,
        ttl: float = 0,
        *,
        timeout: float | None = None,
        if_sequence: int | None = None,
        lease: Lease | str | None = None,
    ) -> int:
        """:meth:`set` with ``value`` as a JSON document (NotJSON if it is not one)."""
        body = to_json(value)
        return await self.set(key, body, ttl, timeout=timeout, if_sequence=if_sequence, lease=lease)

    async def lease(
        self, ttl: float = 2.0, *, timeout: float | None = None, for_key: str | None = None
    ) -> Lease:
        """:meth:`clone.Clone.lease`, awaited."""
        return await asyncio.wrap_future(self.client._caller.grant_async(ttl, timeout, for_key))

    # ------------------------------------------------------------------
    # Changes

    def changes(self, prefix: str = "", *, since: int | None = None) -> AsyncChangeStream:
        """``async for change in c.changes("/config/")``: every change under
        ``prefix`` from now on (``since=N``: first every change after sequence
        N from the server's history, as :meth:`clone.Clone.changes`)."""
        client = self.client
        if since is None:
            client._watch()
        return AsyncChangeStream(client, prefix, since)

    def on_change(self, callback: Callable[[Entry], None]) -> Any:
        """:meth:`clone.Clone.on_change` (the callback runs in the client's
        callback thread, not in the loop); returns the unregistering handle."""
        return self.client.on_change(callback)


class Lock:
    """:class:`clone.recipes.Lock` to await: ``async with Lock(c, "/locks/x"):``.

    The wait runs in a thread of its own; ``held``, ``token`` and ``check()``
    read the replica and do not block.
    """

    def __init__(
        self,
        client: AsyncClone,
        name: str,
        *,
        ttl: float = 5.0,
        on_lost: Callable[[str], None] | None = None,
        reacquire: bool = True,
    ) -> None:
        self._lock = recipes.Lock(
            client.client, name, ttl=ttl, on_lost=on_lost, reacquire=reacquire
        )

    @property
    def held(self) -> bool:
        return self._lock.held

    @property
    def token(self) -> int | None:
        return self._lock.token

    def check(self) -> None:
        self._lock.check()

    async def acquire(self, timeout: float | None = None) -> bool:
        return await _in_thread(self._lock.acquire, timeout)

    async def release(self) -> None:
        await _in_thread(self._lock.release)

    async def __aenter__(self) -> Lock:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()


class Registration:
    """:class:`clone.recipes.Registration` to await: ``async with
    Registration(c, "/services/api/node-7", b"10.0.0.7:8080", ttl=5):``.

    Entering grants the lease and writes the key (confirmed) in a thread of
    its own, as the threaded recipe blocks for both; leaving revokes the
    lease, so the key goes.  After a lost lease the recipe registers again
    from its own thread (``reregister``), nothing to do in the loop.
    """

    def __init__(
        self,
        client: AsyncClone,
        key: str,
        value: bytes | str,
        ttl: float = 5.0,
        *,
        on_lost: Callable[[str], None] | None = None,
        reregister: bool = True,
    ) -> None:
        self._client = client
        self._args = (key, value, ttl)
        self._on_lost = on_lost
        self._reregister = reregister
        self._registration: recipes.Registration | None = None

    @property
    def alive(self) -> bool:
        """Registered now (as far as the servers have said)."""
        return self._registration is not None and self._registration.alive

    @property
    def lease(self) -> Lease | None:
        return None if self._registration is None else self._registration.lease

    async def register(self) -> None:
        if self._registration is not None:
            return
        key, value, ttl = self._args
        client = self._client.client
        self._registration = await _in_thread(
            lambda: recipes.Registration(
                client, key, value, ttl, on_lost=self._on_lost, reregister=self._reregister
            )
        )

    async def close(self) -> None:
        """Revoke the lease (the key goes with it) and stop registering again."""
        registration, self._registration = self._registration, None
        if registration is not None:
            await _in_thread(registration.close)

    async def __aenter__(self) -> Registration:
        await self.register()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Election:
    """:class:`clone.recipes.Election` to await; ``async for leader in election``
    yields the leader (a candidate name, or None) each time it changes,
    starting with the current one."""

    def __init__(
        self,
        client: AsyncClone,
        name: str,
        candidate: str,
        *,
        ttl: float = 5.0,
        on_lost: Callable[[str], None] | None = None,
        rejoin: bool = True,
    ) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queues: list[asyncio.Queue[str | None]] = []
        self._seen = False
        self._last: str | None = None
        self._election = recipes.Election(
            client.client,
            name,
            candidate,
            ttl=ttl,
            on_change=self._changed,
            on_lost=on_lost,
            rejoin=rejoin,
        )

    def _changed(self, leader: str | None) -> None:
        """From the election's watcher thread."""
        self._seen, self._last = True, leader
        loop = self._loop
        if loop is None:
            return
        for q in list(self._queues):
            try:
                loop.call_soon_threadsafe(q.put_nowait, leader)
            except RuntimeError:
                return

    @property
    def is_leader(self) -> bool:
        return self._election.is_leader

    @property
    def token(self) -> int | None:
        return self._election.token

    async def campaign(self) -> None:
        self._loop = asyncio.get_running_loop()
        await _in_thread(self._election.campaign)

    async def watch(self) -> None:
        """Follow the leader without standing."""
        self._loop = asyncio.get_running_loop()
        await _in_thread(self._election.watch)

    async def resign(self) -> None:
        await _in_thread(self._election.resign)

    async def close(self) -> None:
        await _in_thread(self._election.close)
        for q in self._queues:
            q.put_nowait(None)

    async def __aenter__(self) -> Election:
        await self.campaign()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def __aiter__(self) -> AsyncIterator[str | None]:
        self._loop = asyncio.get_running_loop()
        q: asyncio.Queue[str | None] = asyncio.Queue()
        self._queues.append(q)
        try:
            if self._seen:
                yield self._last
            last = self._last
            while True:
                leader = await q.get()
                if leader != last:
                    last = leader
                    yield leader
        finally:
            self._queues.remove(q)
