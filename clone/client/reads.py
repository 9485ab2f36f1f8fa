"""The client's reads and change streams: the replica, its freshness, watching.

A read (:meth:`~Reads.get`, :meth:`~Reads.entry`) is answered in the caller's
thread from the replica the agent keeps (:meth:`AgentFSM.peek
<clone.client.fsm.AgentFSM.peek>`), with no round trip to the agent; a listing
(:meth:`~Reads.items`) asks the agent, which sorts and packs every row at once.
Changes reach callbacks and :class:`~clone.client.results.ChangeStream` s
through the callback thread; ``changes(since=N)`` first replays the server's
update history with a reader of its own (:mod:`clone.client.history`).
"""

from __future__ import annotations

import json
import logging
import marshal
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal, overload

from clone.client import verbs
from clone.client.args import from_json, history_subtree
from clone.client.events import Subscription
from clone.client.handle import ClientHandle
from clone.client.history import HistoryFeed
from clone.client.results import ChangeStream, Entry, Freshness, Status, Watcher
from clone.errors import CloneError, ClosedError, NotSynced, SplitConflict
from clone.wire.codec import Properties

__all__ = ["Reads"]

log = logging.getLogger(__name__)

# ITEMS: the agent's time per key held, on top of command_timeout.  Sorting and
# packing a million rows is a few seconds; on a 2-core machine shared with other
# work it overran the 5 s default.  20 us per key is +20 s at 1M.
_ITEMS_SECONDS_PER_KEY = 20e-6


class Reads(ClientHandle):
    """Reads from the replica, the agent's status, and the streams of changes."""

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
        """The value of ``key`` in our replica, or ``default``.

        Read in the caller's thread from the replica the agent keeps, with no
        round trip to the agent (a microsecond or two).  A read after a
        confirmed write sees it.  ``with_status=True`` returns ``(value,
        freshness)`` (:class:`Freshness`: synced or not, seconds since the
        server was last heard); ``require_synced=True`` raises
        :class:`~clone.errors.NotSynced` rather than answer from a replica
        that is not live (before the first sync, during an outage).
        """
        row = self._row(key, require_synced)
        value = default if row is None else row[3]
        return (value, self.freshness()) if with_status else value

    def entry(self, key: str, *, require_synced: bool = False) -> Entry | None:
        """``key`` with its sequence and properties, or None; its
        ``freshness`` says how current the read is (see :meth:`get`)."""
        row = self._row(key, require_synced)
        if row is None:
            return None
        return Entry(key, row[3], row[0], row[2], self.freshness())

    def _row(self, key: str, require_synced: bool) -> tuple[int, bytes, Properties, bytes] | None:
        if not isinstance(key, str):
            raise TypeError(f"key must be str, not {type(key).__name__}")
        if self._closed:
            raise ClosedError("this Clone client is closed")
        if require_synced and not self._events.active.is_set():
            raise NotSynced(
                f"not synced (state {self._events.state}): the read of {key!r} would "
                f"come from a replica that is not live; servers: "
                f"{', '.join(self._servers) or 'none'}"
            )
        return self._fsm.peek(key)

    def freshness(self) -> Freshness:
        """How current reads from the replica are right now."""
        heard = self._fsm.heard_at
        return Freshness(
            synced=self._events.active.is_set(),
            state=self._events.state,
            silent_for=None if heard is None else max(0.0, time.monotonic() - heard),
        )

    def get_json(self, key: str, default: Any = None, *, require_synced: bool = False) -> Any:
        """The JSON document ``key`` holds, decoded, or ``default`` if absent;
        :class:`~clone.errors.NotJSON` if it holds something else."""
        row = self._row(key, require_synced)
        return default if row is None else from_json(key, row[3])

    def entries(self, prefix: str = "") -> list[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key."""
        return [Entry(k, body, seq, props) for k, (seq, _, props, body) in self._rows(prefix)]

    def iter_entries(self, prefix: str = "", *, page: int = 10_000) -> Iterator[Entry]:
        """Every entry whose key starts with ``prefix``, sorted by key, as
        :meth:`entries` gives them, read from the agent ``page`` rows at a
        time: for listings too large to hold twice (``clone dump`` of 10M
        keys).  The listing is taken when the first entry is asked for, and
        every page comes from that same moment (:mod:`clone.client.listings`).
        Stop early and the agent drops it (on ``close()`` or garbage
        collection of the iterator); a client holds at most four open, and
        reading one dropped for a newer one raises
        :class:`~clone.errors.CloneError`."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        if not 1 <= page <= 1_000_000:
            raise ValueError(f"page must be 1 to 1000000 rows, not {page}")
        return self._listing(prefix, page)

    def _listing(self, prefix: str, page: int) -> Iterator[Entry]:
        # Sorting is the agent's only per-key work here: ITEMS's allowance.
        listing = self._request_per_key(verbs.LIST, prefix)[0]
        more = True
        try:
            while more:
                more_frame, rows_frame = self._request(verbs.PAGE, [listing, b"%d" % page])
                more = more_frame == b"1"
                rows: list[tuple[str, tuple[int, bytes, Properties, bytes]]]
                rows = marshal.loads(rows_frame)  # our own agent's, never the network's
                for k, (seq, _, props, body) in rows:
                    yield Entry(k, body, seq, props)
        finally:
            if more and not self._pipe.closed:
                try:
                    self._request(verbs.UNLIST, [listing])
                except CloneError as exc:  # closing: the agent drops it with itself
                    log.debug("listing %s not dropped: %s", listing.decode(), exc)

    def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """``(key, value)`` for every key starting with ``prefix``, sorted by key."""
        return [(k, row[3]) for k, row in self._rows(prefix)]

    def _rows(self, prefix: str) -> list[tuple[str, tuple[int, bytes, Properties, bytes]]]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, not {type(prefix).__name__}")
        reply = self._request_per_key(verbs.ITEMS, prefix)
        # One marshal frame from our own agent thread, never from the network.
        rows: list[tuple[str, tuple[int, bytes, Properties, bytes]]] = marshal.loads(reply[0])
        return rows

    def _request_per_key(self, verb: bytes, prefix: str) -> list[bytes]:
        """Ask the agent for work that grows with the keys it holds (sorting and
        packing rows: seconds at a million keys on a busy machine): the wait
        is ``command_timeout`` plus 20 us per key, from its key count ("did
        not answer ITEMS within 5 s" at 1M keys, before)."""
        keys = int(json.loads(self._request(verbs.STATUS, [])[0])["keys"])
        pipe = self._pipe
        with pipe.lock:
            if pipe.closed:
                raise ClosedError("this Clone client is closed")
            return pipe.request_locked(
                verb, [prefix.encode("utf-8")], self.command_timeout + keys * _ITEMS_SECONDS_PER_KEY
            )

    def status(self) -> Status:
        raw = json.loads(self._request(verbs.STATUS, [])[0])
        return Status(
            state=raw["state"],
            server=raw["server"],
            sequence=raw["sequence"],
            keys=raw["keys"],
            pending_writes=raw["pending_writes"],
            pending_calls=raw["pending_calls"],
            leases=raw["leases"],
            servers=tuple(raw["servers"]),
            subtrees=tuple(raw["subtrees"]),
            counters=raw["counters"],
        )

    def wait_synced(self, timeout: float = 10.0) -> None:
        """Block until the client holds a complete snapshot, or raise NotSynced."""
        if self._events.active.wait(timeout):
            return
        if self._closed:
            raise ClosedError("this Clone client is closed")
        tried = ", ".join(self._servers) or "no servers configured"
        raise NotSynced(
            f"no server answered a snapshot request within {timeout:g} s: tried {tried}"
        )

    def on_change(self, callback: Callable[[Entry], None]) -> Subscription:
        """Call ``callback(entry)`` for every change to a key in our subtrees.

        Callbacks run one at a time in this client's callback thread (named
        ``clone-callbacks-N``), never in the agent thread, so they may call this
        client, even a confirmed ``set``.  Exceptions are logged and swallowed.
        Only changes after registration are reported; a resync reports the keys
        that differ from what we held, marked ``entry.resync``.  Returns a :class:`Subscription`:
        ``cancel()`` it (or use it as a context manager) to unregister.
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        if self._closed:
            raise ClosedError("this Clone client is closed")
        subscription = self._callbacks.add(callback)
        self._watch()
        return subscription

    def on_conflict(self, callback: Callable[[SplitConflict], None]) -> None:
        """Call ``callback(conflict)`` when a write of ours that a server
        confirmed during a split brain was not kept when the pair healed (the
        other side had changed its key): docs/client.md, "Split-brain conflicts".

        ``conflict`` is a :class:`~clone.errors.SplitConflict` (``key``,
        ``uuid``); a write still waited on also raises it.  Callbacks run in
        the callback thread, like :meth:`on_change`'s; exceptions are logged.
        A conflict is told once, best effort (a notice on the update stream,
        for writes confirmed among this client's last 65,536).
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            self._events.conflict_callbacks.append(callback)

    def changes(
        self, timeout: float | None = None, prefix: str = "", *, since: int | None = None
    ) -> ChangeStream:
        """An iterator over changes (deleted keys have ``value`` None) as they happen.

        It is registered when this call returns, so a change that arrives before
        the first ``next()`` is not lost.  It ends ``timeout`` seconds after this
        call (None: when the client closes) or when closed; close it (or use it
        as a context manager) to stop queueing changes for it.

        ``since=N`` first replays every change after sequence N from the active
        server's update history, then goes on with the live ones, with no gap
        and no duplicate (a reader with its own sockets: :mod:`clone.client.history`).
        Iterating raises :class:`~clone.errors.HistoryCompacted` if the history
        no longer reaches back to N.
        """
        if since is None:
            return ChangeStream(self, timeout, prefix)
        if isinstance(since, bool) or not isinstance(since, int):
            raise TypeError(f"since must be an int sequence, not {type(since).__name__}")
        if not 0 <= since < 2**64:
            raise ValueError(f"since must be a sequence in 0..2**64-1, not {since}")
        with self._shared:
            if self._closed:
                raise ClosedError("this Clone client is closed")
            servers = list(self._servers)
        if not servers:
            raise ValueError("changes(since=...) needs a server: connect() one first")
        feed = HistoryFeed(
            servers,
            since,
            subtree=history_subtree(prefix, self._subtrees),
            prefixes=self._subtrees,
            silence=self._silence,
            curve=self._curve,
        )
        with self._shared:
            self._feeds = [f for f in self._feeds if not f.stopped]
            self._feeds.append(feed)
        return ChangeStream(feed, timeout, prefix)

    def _add_watcher(self, watcher: Watcher) -> None:
        if self._closed:
            raise ClosedError("this Clone client is closed")
        self._callbacks.add_watcher(watcher)
        self._watch()

    def _remove_watcher(self, watcher: Watcher) -> None:
        self._callbacks.remove_watcher(watcher)

    def _watch(self) -> None:
        if not self._watching:
            self._request(verbs.WATCH, [b"1"])
            self._watching = True

