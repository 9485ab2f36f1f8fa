"""How the agent syncs: snapshot replies into a side map, then the swap.

How this works: the I/O loop hands snapshot replies over raw, thousands per
SNAPSHOT_BATCH event.  KVSYNCs are taken by
:func:`clone.wire.codec.fast_kvsync_entry` (exactly what the codec accepts, no
message object), KVBATCHes are decoded whole by :mod:`clone.wire.batch`, and
anything else goes through the codec, which says what it is (a KTHXBAI) or why
it is dropped.  Updates that arrive meanwhile are buffered.  On the last
KTHXBAI, :meth:`SnapshotSync._swap` replays the buffer over the side map and
makes it the map, so the application reads the old map until then.  A mixin
over :class:`~clone.client.state.AgentState`; sans-IO.
"""

from __future__ import annotations

import logging
from itertools import repeat

from clone.client.state import (
    _BODY,
    Action,
    AgentState,
    Changed,
    Confirmed,
    SendUpdate,
    State,
    _differs,
    _message,
    _shows_active,
    _Stored,
    _stored,
)
from clone.errors import ProtocolError
from clone.wire.batch import KVBatch, decode_kvbatch, is_kvbatch
from clone.wire.codec import Hugz, KVMsg, SnapshotEnd, decode_snapshot_reply, fast_kvsync_entry
from clone.wire.control import ViewHeartbeat

__all__ = ["SnapshotSync", "restricted_view"]

log = logging.getLogger(__name__)


class SnapshotSync(AgentState):
    """The SNAPSHOT_BATCH handlers and the updates and HUGZ met while syncing."""

    def _store_entry(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._got_snapshot_data(now)
        if msg.body and self._subtree_of(msg.key) is not None:
            self._side[msg.key] = _stored(msg)
        return []

    def _store_batch(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Many replies at once: the hot path of a sync, so it avoids per-entry calls.

        :func:`~clone.wire.codec.fast_kvsync_entry` takes the KVSYNCs (exactly
        those the codec accepts); KVBATCHes are decoded whole; whatever else
        (KTHXBAI, anything odd) goes through the codec, which says what it is.
        """
        actions: list[Action] = []
        side = self._side
        subtrees = self.subtrees
        request = self._request_id
        stored = False  # valid snapshot data for the current request
        for index, frames in enumerate(batch):
            entry = fast_kvsync_entry(frames)
            if entry is not None:
                stored = True
                key, value = entry
                if value[_BODY] and key.startswith(subtrees):  # not a delete, and ours
                    side[key] = value
                continue
            if is_kvbatch(frames):
                try:
                    kvbatch = decode_kvbatch(frames)
                except ProtocolError as exc:
                    # Rejected whole: storing part of a batch would hide the error.
                    actions.append(self._malformed(server, "snapshot batch", exc))
                    continue
                stored = True
                self._store_kvbatch(kvbatch)
                continue
            try:
                msg = decode_snapshot_reply(frames)
            except ProtocolError as exc:
                actions.append(self._malformed(server, "snapshot reply", exc))
                continue
            if isinstance(msg, KVMsg):  # not reached: the fast path takes every KVSYNC
                actions.extend(self._store_entry(server, msg, now))
                continue
            stored = False  # _end_snapshot takes note of the data itself
            actions.extend(self._end_snapshot(server, msg, now))
            if self._request_id != request:
                # Asked again: the rest answer the old request, whose socket
                # the loop will close.
                return actions
            if self.state is State.ACTIVE:  # swapped: the rest are late replies
                actions.extend(self._late_replies(server, batch[index + 1 :], now))
                return actions
        if stored:
            self._got_snapshot_data(now)
        return actions

    def _store_kvbatch(self, batch: KVBatch) -> None:
        """A KVBATCH's entries into the side map, without a Python step per entry
        when nothing needs filtering (the usual case)."""
        values = zip(batch.sequences, batch.uuids, batch.properties, batch.bodies, strict=True)
        entries = zip(batch.keys, values, strict=True)
        subtrees = self.subtrees
        if all(batch.bodies) and (
            "" in subtrees or all(map(str.startswith, batch.keys, repeat(subtrees)))
        ):
            self._side.update(entries)
        else:  # deletes, or keys outside our subtrees
            self._side.update(
                (key, value) for key, value in entries if value[_BODY] and key.startswith(subtrees)
            )

    def _end_snapshot(self, server: int, end: SnapshotEnd, now: float) -> list[Action]:
        self._got_snapshot_data(now)
        waiting = [s for s in self.subtrees if s not in self._ends]
        if end.subtree in waiting:
            subtree = end.subtree
        elif len(waiting) == 1:
            subtree = waiting[0]  # a server that does not echo the subtree
        else:
            self.counters.protocol_errors += 1
            log.warning("KTHXBAI for subtree %r that we are not waiting for", end.subtree)
            return []
        self._ends[subtree] = end.sequence
        view, count = end.view, end.view_count
        if view is not None and count is not None:
            self._end_views[subtree] = (view, count)
        if len(self._ends) < len(self.subtrees):
            return []
        return self._swap(now)

    def _late_replies(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """Replies after the snapshot completed: they prove the server alive, and
        malformed ones are still counted."""
        self._alive(now)
        actions: list[Action] = []
        for frames in batch:
            batched = is_kvbatch(frames)
            try:
                if batched:
                    decode_kvbatch(frames)
                else:
                    decode_snapshot_reply(frames)
            except ProtocolError as exc:
                what = "snapshot batch" if batched else "snapshot reply"
                actions.append(self._malformed(server, what, exc))
        return actions

    def _buffer_update(self, server: int, msg: KVMsg, now: float) -> list[Action]:
        self._shown_active = True
        self._alive_if_answered(now)
        self._buffer.append(msg)
        return []

    def _heartbeat_while_syncing(
        self, server: int, hugz: Hugz | ViewHeartbeat, now: float
    ) -> list[Action]:
        self._note_heartbeat(server, hugz)
        if _shows_active(hugz):
            self._shown_active = True
        self._alive_if_answered(now)
        return []

    def _swap(self, now: float) -> list[Action]:
        """Replay the buffered updates over the side map, then make it the map.

        A restricted requester (its KTHXBAI says its view) is fed a filtered
        stream, with holes in the sequence by design: it takes any higher
        sequence and counts what it applies, for the view heartbeats to check
        (:func:`restricted_view`).
        """
        side = self._side
        last = min(self._ends.values())
        view = restricted_view(self._ends, self._end_views)
        applied = 0
        for msg in self._buffer:
            self._mark_published(msg.uuid)
            if msg.sequence <= last:
                continue
            if view is not None:
                applied += 1  # holes are expected: the view heartbeat checks the count
            elif msg.sequence != last + 1:
                self.counters.gaps += 1
                assert self.current is not None
                log.warning(
                    "sequence gap while syncing from %s: got %d after %d; resyncing",
                    self.servers[self.current],
                    msg.sequence,
                    last,
                )
                return self._start_sync(self.current, now)
            last = msg.sequence
            subtree = self._subtree_of(msg.key)
            if subtree is None or msg.sequence <= self._ends[subtree]:
                continue
            held = side.get(msg.key)
            if held is not None and held[0] >= msg.sequence:
                continue  # the fuzzy snapshot already holds a newer value
            if msg.body:
                side[msg.key] = _stored(msg)
            else:
                side.pop(msg.key, None)
        old, self._map = self._map, side
        self._side, self._buffer, self._ends, self._end_views = {}, [], {}, {}
        self.view, self.view_count = view if view is not None else (None, 0)
        self.view_applied = applied
        self._reask_at = None
        self.last_sequence = last
        self.counters.snapshots += 1
        if self._left_at is not None:
            self.counters.last_failover_gap_ms = round(1000 * (now - self._left_at))
            self._left_at = None
        actions = self._set_state(State.ACTIVE)
        if self.emit_changes:  # a 1M-key diff costs seconds: only for watchers
            actions.extend(_diff(old, side))
        for uuid, p in self._pending.items():
            # A write is in the new map if its key holds its uuid (uuids are unique).
            entry = side.get(p.msg.key)
            if entry is not None and entry[1] == uuid:
                p.published = True
        flushed, self._held = self._held, []
        actions.extend(SendUpdate(msg) for msg in flushed)
        held_uuids = {msg.uuid for msg in flushed}
        for uuid, p in list(self._pending.items()):
            if p.published:
                del self._pending[uuid]
                actions.append(Confirmed(uuid))
            elif uuid in held_uuids:
                p.next_send = now + self.config.resend_interval
            else:
                # The new server may never have seen it: send again, same uuid.
                p.next_send = now + self.config.resend_interval
                self.counters.resent += 1
                actions.append(SendUpdate(p.msg))
        return actions


def restricted_view(
    ends: dict[str, int], views: dict[str, tuple[str, int]]
) -> tuple[str, int] | None:
    """The view id and count a completed snapshot starts from, or None if the
    requester is not restricted.

    With several subtrees there are several KTHXBAIs, each with the view's
    count at its own sequence; updates are replayed from the lowest of those
    sequences, so that KTHXBAI's count is the one to add them to.  A requester
    is restricted if any KTHXBAI says so; if the lowest one does not, its count
    is unknown: -1, which no view heartbeat matches, so the first one resyncs.
    """
    if not views:
        return None
    lowest = min(ends, key=ends.__getitem__)
    if lowest in views:
        return views[lowest]
    return next(iter(views.values()))[0], -1


def _diff(old: dict[str, _Stored], new: dict[str, _Stored]) -> list[Action]:
    """The changes that turn ``old`` into ``new``, by key."""
    out: list[Action] = [Changed(k, None) for k in old if k not in new]
    out.extend(Changed(k, _message(k, v)) for k, v in new.items() if _differs(old.get(k), v))
    return out
