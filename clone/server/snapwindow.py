"""The bytes of snapshots handed to libzmq and not yet written out, per stream and in all.

Why: the snapshot port's high-water mark counts messages, so a requester that
reads nothing could pin ``--snapshot-hwm`` messages of any size in our memory
(64 such requesters over 60 KiB values held 6 GB).  libzmq cannot count bytes,
so we do: each stream may have at most :meth:`SnapshotBudget.window` bytes
handed to libzmq that libzmq has not written to the connection yet, and the
windows of all streams together, with the snapshots encoded once for many
requesters (:mod:`.sharedsnap`), stay within ``--snapshot-bytes``.

How it is measured: tracking every message (a zero-copy send with a
:class:`zmq.MessageTracker`) costs too much for 1 KB KVSYNCs, so only
*checkpoints* are tracked: a message is tracked when the bytes sent since the
last checkpoint reach a quarter of the window, or when it fills the window.
libzmq writes one connection's messages in order, so once a checkpoint is done
every byte before it has left too.  A full window always ends with a tracked
message, so a reader that keeps reading always opens it again.  So does a full
pipe (``--snapshot-hwm`` messages queued): the first message sent after it is
tracked (:meth:`SendWindow.blocked`).  A reader's window grows to its whole
share (64 MiB with ``--max-snapshots 2``), a checkpoint then came only every
16 MiB, and a reader paced by its pipe rather than its window showed no
progress for that long: it was aborted as stalled while it read.

A requester *reads* when its checkpoints complete; that, not our sends, is its
progress (:attr:`SendWindow.done_bytes`), and what the stall and slot rules
look at (:func:`stalest`).

Sans-IO: a tracker is anything with a ``done`` property; no clock is read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

__all__ = [
    "FIRST_WINDOW",
    "GROW_AFTER",
    "RETRY_MAX",
    "RETRY_MIN",
    "SnapshotBudget",
    "SendWindow",
    "Tracker",
    "retry_delay",
    "stalest",
]

#: A new requester's window: it shows it reads before it gets more.
FIRST_WINDOW = 64 * 1024
#: Bytes a requester must have read before its window grows: what the kernel's
#: send buffer may take for a connection whose reader reads nothing (Linux's
#: default ``tcp_wmem`` maximum), so that filling it does not look like reading.
GROW_AFTER = 4 * 1024 * 1024
#: Seconds before a stream whose window is full looks again, right after progress ...
RETRY_MIN = 0.002
#: ... and at most, for a requester that has read nothing for a while: 64
#: stalled requesters then cost the loop a few hundred wake-ups a second, not thousands.
RETRY_MAX = 0.1

K = TypeVar("K")


class Tracker(Protocol):
    """What :class:`SendWindow` needs of a :class:`zmq.MessageTracker`."""

    @property
    def done(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class SnapshotBudget:
    """``--snapshot-bytes`` shared by at most ``--max-snapshots`` streams and
    the snapshots encoded once for many requesters (:mod:`.sharedsnap`).

    A quarter of the total (:attr:`shared`) is for the shared snapshots'
    encoded messages; each stream's window is an equal share of the rest for
    a full house, so the total holds whatever the streams do, and a healthy
    requester always has its share, however many others stopped reading.  A
    reader of a shared snapshot sends its large frames by reference, so its
    window holds no copy of them.  One stream may overshoot its window by one
    message (a KVBATCH of up to ``MAX_BATCH_BYTES``), so the bytes in flight
    stay below ``total + max_snapshots * largest message``.
    """

    total: int
    max_snapshots: int

    def __post_init__(self) -> None:
        if self.total < 1 or self.max_snapshots < 1:
            raise ValueError("the snapshot budget and the number of snapshots must be >= 1")

    @property
    def shared(self) -> int:
        """Bytes the shared snapshots' encoded messages may hold, all together."""
        return self.total // 4

    @property
    def window(self) -> int:
        """Bytes one stream may have unwritten in libzmq (at least 1: one message)."""
        return max(1, (self.total - self.shared) // self.max_snapshots)


class SendWindow:
    """One stream's bytes sent, and how many of them libzmq has written out.

    The window starts small (:data:`FIRST_WINDOW`) and becomes the
    requester's whole share (``limit``) once it has read :data:`GROW_AFTER`
    bytes.  A requester that never reads still seems to read what the
    kernel's buffers take, so anything less would let it grow; held to 64 KiB
    it costs the loop a few dozen sends, and a reader gets its share after
    4 MiB (four KVBATCHes).

    One window per *requester* (its routing id), kept after its stream ends
    until libzmq has written what it holds: a stream aborted or replaced
    leaves its messages in the requester's pipe, and a new stream for it must
    count them (re-asking every 5 s, 200 requesters that never read had
    stacked 330 MB there).
    """

    __slots__ = (
        "_checkpoints",
        "_track_next",
        "_untracked",
        "done_bytes",
        "limit",
        "sent_bytes",
        "window",
    )

    def __init__(self, limit: int, first: int | None = None) -> None:
        if limit < 1:
            raise ValueError(f"window must be >= 1, not {limit}")
        self.limit = limit
        self.window = min(limit, FIRST_WINDOW if first is None else max(1, first))
        #: Bytes handed to libzmq so far.
        self.sent_bytes = 0
        #: Bytes libzmq has written (as of the last completed checkpoint).
        self.done_bytes = 0
        self._untracked = 0  # bytes sent since the last checkpoint
        self._track_next = False  # the pipe was full: track the next message
        self._checkpoints: deque[tuple[Tracker, int]] = deque()

    @property
    def in_flight(self) -> int:
        """Bytes sent and not known to be written (call :meth:`update` first)."""
        return self.sent_bytes - self.done_bytes

    def update(self) -> bool:
        """Take the completed checkpoints; True if the requester read something."""
        checkpoints = self._checkpoints
        moved = False
        while checkpoints and checkpoints[0][0].done:
            _, self.done_bytes = checkpoints.popleft()
            moved = True
        if moved and self.window < self.limit and self.done_bytes >= GROW_AFTER:
            # It has read more than the kernel's buffers could have taken: a
            # reader, which gets its whole share.
            self.window = self.limit
        return moved

    @property
    def proven(self) -> bool:
        """The requester has shown it reads: it has read more than the
        kernel's buffers take for one that reads nothing (call :meth:`update`
        first).  Its host gets a reader's weight in the loop's slice
        (:func:`~clone.server.fairshare.host_weights`)."""
        return self.done_bytes >= GROW_AFTER

    @property
    def settled(self) -> bool:
        """No tracked message is unwritten (an untracked tail of less than a
        quarter window may be): the window may be forgotten."""
        return not self._checkpoints

    def may_send(self) -> bool:
        """Whether another message may go: the window is not full (an empty one always)."""
        return self.in_flight < self.window

    def blocked(self) -> None:
        """The requester's pipe was full (its high-water mark), whatever the
        window: the next message sent is tracked, so a requester that drains
        its pipe shows it reads within one pipe's worth of messages."""
        if self._untracked:
            self._track_next = True

    def track_next(self, nbytes: int) -> bool:
        """Whether the next message, of ``nbytes``, must be tracked: it closes a
        quarter-window's worth of untracked bytes, fills the window, or is the
        first since the pipe was full."""
        return (
            self._track_next
            or self._untracked + nbytes >= max(1, self.window // 4)
            or self.in_flight + nbytes >= self.window
        )

    def sent(self, nbytes: int, tracker: Tracker | None = None) -> None:
        """A message of ``nbytes`` was handed to libzmq (tracked, if ``tracker``)."""
        self.sent_bytes += nbytes
        if tracker is None:
            self._untracked += nbytes
        else:
            self._untracked = 0
            self._track_next = False
            self._checkpoints.append((tracker, self.sent_bytes))


def retry_delay(idle: float) -> float:
    """Seconds until a stream with a full window looks again, after ``idle``
    seconds without progress: soon for a reader, seldom for one that stopped."""
    return min(RETRY_MAX, max(RETRY_MIN, idle / 4))


def stalest(progress: Mapping[K, float], now: float, idle: float,
            exclude: Iterable[K] = ()) -> K | None:  # fmt: skip
    """The stream that has made no progress for longest, if for at least
    ``idle`` seconds (``progress``: stream -> the time of its last progress)."""
    skip = set(exclude)
    best: K | None = None
    best_at = now - idle
    for stream, at in progress.items():
        if at <= best_at and stream not in skip:
            best, best_at = stream, at
    return best
