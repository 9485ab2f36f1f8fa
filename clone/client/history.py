"""``changes(since=N)``: every change after sequence N, then the live ones.

How this works: the active server keeps a history of its recent updates
(:mod:`clone.server.history`).  A *history request* -- ``X-CHP-Since: N`` as
ZMTP metadata on a DEALER, without the digest a peer server adds
(:mod:`clone.wire.delta`) -- makes it answer an ``ICANHAZ?`` with the updates
after N, as published, between KVDELTA and a KTHXBAI carrying its sequence S
when the stream opened; or, when the history no longer reaches back to N,
with a KVDELTA saying ``compacted=<oldest held>`` and KTHXBAI at once:
:class:`~clone.errors.HistoryCompacted`.

As in :mod:`clone.client.backup`, the SUB is connected, and has received
something, before the request is sent, so every update published after S
reaches it.  The KVPUBs that arrive while the delta streams are buffered;
after KTHXBAI they are replayed, and the live ones follow: those at or below
the last sequence handed out are duplicates and dropped, the next one must be
exactly one more (for a restricted reader, whose stream has holes by design,
the view heartbeat's count stands in for that rule, as in the client agent).
A hole -- a HUGZ announcing a sequence we never got, a KVPUB that skips one --
does not end the stream: the reader *restarts* from the last sequence it
handed out with a fresh history request, so the caller sees neither a gap
nor a duplicate, only a pause.  A server that goes silent is left for the
next of the list, from the same sequence.

:class:`HistoryReplay` holds those rules (sans-IO: frames in, entries out);
:func:`read_history` does the I/O with its own SUB and DEALER per server.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import zmq

from clone.client.agent import split_endpoint
from clone.client.direct import server_sockets
from clone.client.results import STOP, Entry, Watcher
from clone.errors import HistoryCompacted, ProtocolError
from clone.security import KeyPair
from clone.wire.codec import (
    Hugz,
    KVMsg,
    SnapshotEnd,
    decode_snapshot_reply,
    decode_update,
    encode_icanhaz,
)
from clone.wire.control import ViewHeartbeat, decode_control, is_control
from clone.wire.delta import decode_kvdelta_head, is_kvdelta, since_metadata
from clone.wire.frames import recv_frames

__all__ = ["HistoryFeed", "HistoryReplay", "ReplayRestart", "read_history"]

log = logging.getLogger(__name__)

_MAX_POLL = 0.1  # seconds; the loop re-checks its deadlines and stop flag this often


class ReplayRestart(Exception):
    """A hole in the updates: ask again from the last sequence handed out."""


def _entry(msg: KVMsg) -> Entry:
    return Entry(msg.key, msg.body or None, msg.sequence, msg.properties)


class HistoryReplay:
    """History reply, then live updates -> the changes after ``since``, in order.

    Phases: ``head`` (waiting for KVDELTA) -> ``delta`` (its KVSYNCs, up to
    KTHXBAI; KVPUBs buffered) -> ``live``.  ``last`` is the sequence up to
    which every change has been handed out (or skipped as outside
    ``prefixes``): a restart asks again from it.
    """

    def __init__(
        self,
        since: int,
        prefixes: Sequence[str] = ("",),
        *,
        requested: int | None = None,
        until_live: bool = False,
    ) -> None:
        #: What the caller asked for first (a restart asks from ``last``).
        self.requested = since if requested is None else requested
        #: Stop at the KTHXBAI's sequence (phase ``done``) instead of going live.
        self.until_live = until_live
        self.last = since
        self.prefixes = tuple(prefixes)
        self.phase = "head"
        self.view: str | None = None
        self._view_count = 0
        self._view_applied = 0
        self._buffer: list[list[bytes]] = []

    def _wanted(self, msg: KVMsg) -> list[KVMsg]:
        return [msg] if msg.key.startswith(self.prefixes) else []

    # -- snapshot port ------------------------------------------------------

    def reply(self, frames: list[bytes]) -> list[Entry]:
        """A message on the DEALER: the changes it makes known, in order.

        Raises as :meth:`reply_messages`, which it wraps.
        """
        return [_entry(msg) for msg in self.reply_messages(frames)]

    def reply_messages(self, frames: list[bytes]) -> list[KVMsg]:
        """:meth:`reply`, as the KVMSGs themselves (with their uuid).

        Raises :class:`HistoryCompacted`, :class:`ProtocolError` (a bad reply,
        or a server that answered with a snapshot: no history requests there),
        or :class:`ReplayRestart` (a hole in the buffered updates).
        """
        if self.phase == "head":
            if not frames or not is_kvdelta(frames):
                raise ProtocolError(
                    "the server answered a history request with a snapshot: it does not "
                    "keep a history for clients (an older server, or a Guide server)"
                )
            head = decode_kvdelta_head(frames)
            if head.from_sequence != self.last:
                raise ProtocolError(
                    f"history reply from sequence {head.from_sequence}, asked for {self.last}"
                )
            if head.compacted is not None:
                raise HistoryCompacted(self.requested, head.compacted)
            self.phase = "delta"
            return []
        if self.phase != "delta":
            return []  # a late reply from an earlier request: not ours
        msg = decode_snapshot_reply(frames)
        if isinstance(msg, SnapshotEnd):
            return self._go_live(msg)
        if msg.sequence <= self.last:
            raise ProtocolError(f"history reply went back to {msg.sequence} after {self.last}")
        self.last = msg.sequence
        return self._wanted(msg)

    def _go_live(self, end: SnapshotEnd) -> list[KVMsg]:
        # A filtered delta skips the sequences outside it: all up to the
        # server's sequence when it opened are accounted for.
        self.last = max(self.last, end.sequence)
        if self.until_live:
            # Everything up to the server's sequence at the request: done.
            # The buffered KVPUBs are after it.
            self.phase = "done"
            self._buffer = []
            return []
        self.view = end.view
        if self.view is not None:
            self._view_count = int(dict(end.properties).get("view_count", "0"))
        self.phase = "live"
        out: list[KVMsg] = []
        buffered, self._buffer = self._buffer, []
        for frames in buffered:
            out.extend(self.update_messages(frames))  # ReplayRestart: the caller starts over
        return out

    # -- publisher ----------------------------------------------------------

    def update(self, frames: list[bytes]) -> list[Entry]:
        """A message on the SUB: the change it makes, if any.

        Raises :class:`ReplayRestart` on a hole, ProtocolError on a bad KVPUB.
        """
        return [_entry(msg) for msg in self.update_messages(frames)]

    def update_messages(self, frames: list[bytes]) -> list[KVMsg]:
        """:meth:`update`, as the KVMSGs themselves (with their uuid)."""
        if self.phase == "done":
            return []
        if self.phase != "live":
            self._buffer.append(frames)
            return []
        if is_control(frames):
            control = decode_control(frames)
            if isinstance(control, ViewHeartbeat):
                self._check_view(control)
            return []
        msg = decode_update(frames)
        if isinstance(msg, Hugz):
            # Our servers send HUGZ after every KVPUB up to its sequence on the
            # same socket: one still missing was lost, not late.
            if self.view is None and msg.sequence > self.last:
                raise ReplayRestart(
                    f"HUGZ at sequence {msg.sequence}, but updates after {self.last} never came"
                )
            return []
        if msg.sequence <= self.last:
            return []  # in the history reply already
        if self.view is not None:
            self._view_applied += 1
        elif msg.sequence != self.last + 1:
            raise ReplayRestart(f"updates {self.last + 1}..{msg.sequence - 1} never came")
        self.last = msg.sequence
        return self._wanted(msg)

    def _check_view(self, beat: ViewHeartbeat) -> None:
        if self.view is None:
            return
        if beat.view != self.view:
            raise ReplayRestart(f"our read rights changed (view {self.view} -> {beat.view})")
        if beat.count != self._view_count + self._view_applied:
            raise ReplayRestart(
                f"the view counts {beat.count} updates, we saw "
                f"{self._view_count + self._view_applied}"
            )


class _Silent(Exception):
    """A server did not answer in time."""


def read_history(
    servers: Sequence[str],
    since: int,
    emit: Callable[[Entry], None],
    stop: Callable[[], bool],
    *,
    subtree: str = "",
    prefixes: Sequence[str] = ("",),
    silence: float = 3.0,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    curve: tuple[KeyPair, bytes] | None = None,
    until_live: bool = False,
    on_message: Callable[[KVMsg], None] | None = None,
) -> int:
    """Hand every change after ``since`` to ``emit``, in order, until ``stop`` is set.

    ``subtree`` is asked of the server (its delta holds only that); changes
    are handed out only for keys under one of ``prefixes``.  A server silent
    for ``silence`` seconds, or whose reply is malformed, is left for the next
    of ``servers``, round robin, from the last sequence handed out; a hole
    restarts from there on the same server.  Raises :class:`HistoryCompacted`
    when a server's history does not reach back far enough.

    With ``until_live`` the reader returns once it has handed out every
    change up to the server's sequence when it answered (its KTHXBAI), rather
    than going on with the live ones (an export of the history).
    ``on_message``, if given, receives each change as its KVMSG (uuid
    included) instead of ``emit`` an :class:`Entry`.  Returns the sequence up
    to which every change was handed out.
    """
    deliver: Callable[[KVMsg], None] = (
        on_message if on_message is not None else (lambda msg: emit(_entry(msg)))
    )
    if not servers:
        raise ValueError("no servers to read the history from")
    for endpoint in servers:
        split_endpoint(endpoint)  # ValueError now, not after a timeout
    own_ctx = ctx is None
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
    last = since
    attempt = 0
    try:
        while not stop():
            endpoint = servers[attempt % len(servers)]
            replay = HistoryReplay(last, prefixes, requested=since, until_live=until_live)
            try:
                _read_from(context, endpoint, replay, deliver, stop, subtree, silence, clock, curve)
            except ReplayRestart as exc:
                log.warning("history from %s restarts after %d: %s", endpoint, replay.last, exc)
            except (_Silent, ProtocolError) as exc:
                log.warning("history from %s: %s; trying the next server", endpoint, exc)
                attempt += 1
            last = replay.last
            if replay.phase == "done":
                break
    finally:
        if own_ctx:
            context.destroy(linger=0)
    return last


def _read_from(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    replay: HistoryReplay,
    emit: Callable[[KVMsg], None],
    stop: Callable[[], bool],
    subtree: str,
    silence: float,
    clock: Callable[[], float],
    curve: tuple[KeyPair, bytes] | None,
) -> None:
    # The history request (a libzmq that cannot send it fails here, loudly);
    # the SUB takes everything, not the subtree: the "+1" rule needs every sequence.
    with server_sockets(
        ctx, endpoint, curve=curve, metadata=(since_metadata(replay.last),)
    ) as (sub, dealer, poller):
        asked = False
        heard = clock()
        while not stop() and replay.phase != "done":
            now = clock()
            if now - heard >= silence:
                what = "HUGZ" if not asked else f"message in phase {replay.phase}"
                raise _Silent(f"no {what} for {silence:g} s")
            wait = min(heard + silence - now, _MAX_POLL)
            events = dict(poller.poll(max(1, int(wait * 1000))))
            if dealer in events:
                for _ in range(10_000):
                    try:
                        frames = recv_frames(dealer)
                    except zmq.Again:
                        break
                    heard = clock()
                    for msg in replay.reply_messages(frames):
                        emit(msg)
                    if replay.phase == "done":
                        log.info("history from %s replayed up to %d", endpoint, replay.last)
                        return
                    if replay.phase == "live":
                        log.info("history from %s replayed up to %d; live", endpoint, replay.last)
            if sub in events:
                for _ in range(10_000):
                    try:
                        frames = recv_frames(sub)
                    except zmq.Again:
                        break
                    if not asked:
                        # The subscription is live: updates after the reply's
                        # sequence will reach us.  Now ask.
                        asked = True
                        heard = clock()
                        dealer.send_multipart(encode_icanhaz(subtree))
                        log.info("asked %s for the history after %d", endpoint, replay.last)
                    elif replay.phase == "live":
                        heard = clock()  # only the active's messages count from here
                    for msg in replay.update_messages(frames):
                        emit(msg)


class HistoryFeed:
    """A thread running :func:`read_history` into one :class:`ChangeStream`'s queue.

    It is the stream's registry (``_add_watcher`` starts the thread,
    ``_remove_watcher`` stops it), so :class:`~clone.client.results.ChangeStream`
    is the same iterator with or without ``since``.  An error ends the
    stream: it is queued, and raised by ``next()``.
    """

    def __init__(
        self,
        servers: Sequence[str],
        since: int,
        *,
        subtree: str = "",
        prefixes: Sequence[str] = ("",),
        silence: float = 3.0,
        curve: tuple[KeyPair, bytes] | None = None,
    ) -> None:
        self._servers = list(servers)
        self._since = since
        self._subtree = subtree
        self._prefixes = tuple(prefixes)
        self._silence = silence
        self._curve = curve
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _add_watcher(self, watcher: Watcher) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(watcher,), name="clone-history", daemon=True
        )
        self._thread.start()

    def _remove_watcher(self, watcher: Watcher) -> None:
        watcher.closed = True
        self._stop.set()

    @property
    def stopped(self) -> bool:
        """Whether the reader was told to stop (its stream closed)."""
        return self._stop.is_set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the reader and wait for its thread (its sockets are closed then)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, watcher: Watcher) -> None:
        def stopped() -> bool:
            return self._stop.is_set() or watcher.closed

        try:
            read_history(
                self._servers,
                self._since,
                watcher.queue.put,
                stopped,
                subtree=self._subtree,
                prefixes=self._prefixes,
                silence=self._silence,
                curve=self._curve,
            )
        except Exception as exc:  # handed to the iterator, which raises it
            if not isinstance(exc, HistoryCompacted):
                log.exception("the history reader failed")
            watcher.queue.put(exc)
        watcher.queue.put(STOP)
