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

A catch-up (our KVDELTA extension, docs/protocol.md): a client that holds the
whole map at some sequence, and knows the update it applied there, names both
in its request (:meth:`AgentState._catch_up_point`).  A server whose history
still reaches back and holds that same update answers with a KVDELTA and then
only the updates after it, which are applied to the map in place, in strict
"+1" order, exactly like KVPUBs (change events included); every one leaves a
whole, older state, so a catch-up cut short costs nothing.  At its KTHXBAI
the buffered KVPUBs are replayed as after a snapshot.  Any other reply is a
full snapshot.  A KVDELTA that does not decode, that we did not ask for, that
names another sequence or does not come first, or a catch-up with a hole or a
malformed update, is given up: nothing after it is read, and the next request
is a full snapshot (``_full_next``).
"""

from __future__ import annotations

import logging
from itertools import repeat

from clone.client.actions import (
    Action,
    Changed,
    Confirmed,
    SendUpdate,
    State,
)
from clone.client.state import (
    _BODY,
    _NEVER,
    AgentState,
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
from clone.wire.delta import decode_kvdelta_head, is_kvdelta

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
        if self._delta:
            return self._catch_up_batch(server, batch, now)
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
            if frames and is_kvdelta(frames):
                first = index == 0 and not self._reply_seen
                actions.extend(self._start_catch_up(server, frames, first, now))
                if self._request_id == request:  # accepted: the rest is its updates
                    actions.extend(self._catch_up_batch(server, batch[index + 1 :], now))
                return actions
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
        self._reply_seen = True
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
        if self._frames_in is not None:
            self._buffer_frames[msg.sequence] = self._frames_in
        return []

    # ----------------------------------------------------------------------
    # Catch-up (KVDELTA)

    def _start_catch_up(
        self, server: int, frames: list[bytes], first: bool, now: float
    ) -> list[Action]:
        """A KVDELTA: accept it as the head of the catch-up we asked for, or
        give the catch-up up."""
        self._got_snapshot_data(now)
        try:
            head = decode_kvdelta_head(frames)
        except ProtocolError as exc:
            return [self._malformed(server, "KVDELTA", exc), *self._abandon_catch_up(now)]
        why = None
        if self._asked_since is None:
            why = "we asked for a full snapshot"
        elif not first:
            why = "it came after other replies"
        elif head.compacted is not None:
            why = f"it says compacted={head.compacted}, the reply to a history request"
        elif head.from_sequence != self._asked_since or head.from_sequence != self.last_sequence:
            why = f"we asked for the updates after {self._asked_since}"
        if why is not None:
            error = ProtocolError(f"unexpected KVDELTA from {head.from_sequence}: {why}")
            return [self._malformed(server, "KVDELTA", error), *self._abandon_catch_up(now)]
        self._delta = True
        return []

    def _catch_up_batch(self, server: int, batch: list[list[bytes]], now: float) -> list[Action]:
        """The updates of a catch-up, applied in place like KVPUBs, up to its KTHXBAI."""
        if not batch:
            return []
        self._got_snapshot_data(now)
        actions: list[Action] = []
        for index, frames in enumerate(batch):
            try:
                msg = decode_snapshot_reply(frames)
            except ProtocolError as exc:
                # A lost update would be a hole: nothing after it can be applied.
                actions.append(self._malformed(server, "catch-up update", exc))
                return actions + self._abandon_catch_up(now)
            if isinstance(msg, SnapshotEnd):
                actions.extend(self._end_catch_up(server, msg, now))
                if self.state is State.ACTIVE:  # the rest are late replies
                    actions.extend(self._late_replies(server, batch[index + 1 :], now))
                return actions
            if msg.sequence != self.last_sequence + 1:
                self.counters.gaps += 1
                log.warning(
                    "catch-up from %s: update %d after %d; asking for a full snapshot",
                    self.servers[server],
                    msg.sequence,
                    self.last_sequence,
                )
                return actions + self._abandon_catch_up(now)
            self.counters.catchup_updates += 1
            actions.extend(self._apply_in_place(msg, frames))
        return actions

    def _end_catch_up(self, server: int, end: SnapshotEnd, now: float) -> list[Action]:
        """KTHXBAI of a catch-up: it must end at the last update it sent; then
        the buffered KVPUBs are replayed, as after a snapshot."""
        if end.sequence != self.last_sequence or end.view is not None:
            if end.sequence > self.last_sequence:
                self.counters.gaps += 1
            log.warning(
                "catch-up from %s ended at sequence %d%s, but its updates end at %d; "
                "asking for a full snapshot",
                self.servers[server],
                end.sequence,
                "" if end.view is None else f" for view {end.view}",
                self.last_sequence,
            )
            return self._abandon_catch_up(now)
        self._delta = False
        self.counters.syncs_catchup += 1
        assert self.current is not None
        log.info("caught up from %s at sequence %d", self.servers[server], end.sequence)
        buffered, frames = self._buffer, self._buffer_frames
        self._buffer, self._buffer_frames = [], {}
        actions: list[Action] = []
        request = self._request_id
        for msg in buffered:
            self._mark_published(msg.uuid, msg.sequence)
            if msg.sequence <= self.last_sequence:
                actions.extend(self._confirm_if_pending(msg.uuid, msg.sequence))
                continue
            self._frames_in = frames.get(msg.sequence)
            try:
                actions.extend(self._apply_live(server, msg, now))
            finally:
                self._frames_in = None
            if self._request_id != request:
                return actions  # a hole in the buffer: a new sync started
        return actions + self._synced(now, [])

    def _abandon_catch_up(self, now: float) -> list[Action]:
        """Give a catch-up up: read nothing more of it, ask for a full snapshot."""
        assert self.current is not None
        self.counters.catchups_abandoned += 1
        self._full_next = True
        self._delta = False
        log.warning(
            "catch-up from %s given up; asking for a full snapshot", self.servers[self.current]
        )
        return self._start_sync(self.current, now)

    def _heartbeat_while_syncing(
        self, server: int, hugz: Hugz | ViewHeartbeat, now: float
    ) -> list[Action]:
        self._note_heartbeat(server, hugz)
        if _shows_active(hugz):
            self._shown_active = True
        self._alive_if_answered(now)
        if self._answered and server == self.current and self._answer_stalled(now):
            # Not refused but lost (state.py): the server is alive, ask it again.
            assert self.current is not None
            self.counters.retries += 1
            self.counters.stalled_syncs += 1
            log.info(
                "the snapshot from %s stopped for %.3g s (%d HUGZ) before its end; asking again",
                self.servers[self.current],
                now - self._data_at,
                self._hugz_without_data,
            )
            return self._request(now)
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
        last_msg: KVMsg | None = None
        for msg in self._buffer:
            self._mark_published(msg.uuid, msg.sequence)
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
            last_msg = msg
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
        self.last_sequence = last
        # The last update we know the frames of, for a later catch-up: the
        # last one replayed (it is at ``last``), or none.
        self._last_update = None if last_msg is None else self._buffer_frames.get(last, last_msg)
        self._buffer_frames = {}
        self.counters.snapshots += 1
        self.counters.syncs_full += 1
        # A 1M-key diff costs seconds: only for watchers.
        return self._synced(now, _diff(old, side) if self.emit_changes else [])

    def _synced(self, now: float, changes: list[Action]) -> list[Action]:
        """A sync (snapshot or catch-up) completed: ACTIVE, ``changes`` told,
        pending writes confirmed if the map holds them, else sent again."""
        self._reask_at = None
        self._unanswered_rounds = 0
        self._full_next = False
        self._delta = False
        if self._left_at is not None:
            self.counters.last_failover_gap_ms = round(1000 * (now - self._left_at))
            self._left_at = None
        actions = self._set_state(State.ACTIVE)
        actions.extend(changes)
        current = self._map
        for uuid, p in self._pending.items():
            # A write is in the new map if its key holds its uuid (uuids are unique).
            entry = current.get(p.msg.key)
            if entry is not None and entry[1] == uuid:
                p.published = True
                p.sequence = entry[0]
        if self._held:
            probe = self._held[0]
            entry = current.get(probe.key)
            if entry is not None and entry[1] == probe.uuid:
                self._note_republished(probe.uuid)  # our probe is in the new map
        if self._collector_unproven():
            # Not yet known to reach this server's collector: the first held
            # write goes alone, as a probe, the rest when it is seen (writes.py).
            flushed = []
            still = {msg.uuid for msg in self._held}
        else:
            flushed, self._held = self._held, []
            still = set()
        actions.extend(SendUpdate(msg) for msg in flushed)
        held_uuids = {msg.uuid for msg in flushed}
        for uuid, p in list(self._pending.items()):
            if p.published:
                del self._pending[uuid]
                self._remember_confirmed(uuid, p.msg.key)  # its conflict notice may follow
                actions.append(Confirmed(uuid, p.sequence))
            elif uuid in still:
                p.next_send = _NEVER  # sent once the collector is proven
            elif uuid in held_uuids or p.by_call:
                # (A write sent as a call is resent by the calls' own rules.)
                p.next_send = _NEVER if p.by_call else now + self.config.resend_interval
            else:
                # The new server may never have seen it: send again, same uuid.
                p.next_send = now + self.config.resend_interval
                self.counters.resent += 1
                actions.append(SendUpdate(p.msg))
        if self._held:
            # A new sync, maybe a new server: probe at once, its own wait.
            self._probe_at, self._probing_since = 0.0, None
            actions.extend(self._probe(now))
        if self._replies_behind:
            actions.extend(self._replies_caught_up())
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
    """The changes that turn ``old`` into ``new``, by key, each marked as a
    resync's: the updates between are not known."""
    out: list[Action] = [Changed(k, None, resync=True) for k in old if k not in new]
    out.extend(
        Changed(k, _message(k, v), resync=True) for k, v in new.items() if _differs(old.get(k), v)
    )
    return out
