"""``clone backup``: a consistent copy of the active server's state, taken online.

How this works: a CHP client's view is consistent at one sequence only once it
has replayed the updates that follow its snapshot, because a snapshot is fuzzy
(docs/protocol.md): the server records its sequence S0 when the stream starts
(KTHXBAI carries it) and sends each key's value *as it is when that key's chunk
goes out*.  An entry may therefore be newer than S0, and a key deleted while the
stream runs is simply missing, with nothing in the snapshot saying how new that
absence is.  The Guide's rule (replay until the sequence reaches the newest entry
seen) cannot see such a delete, so we also ask for a *fence*: a second ICANHAZ?,
sent only after the first KTHXBAI arrived, for a subtree that holds no keys.  Its
KTHXBAI carries the server's sequence at a moment after the first stream ended,
so it is at least the sequence of everything the snapshot showed, deletes
included.  Replaying the KVPUBs S0+1 .. that fence, in order and without a hole,
gives exactly the state at the fence's sequence.

:class:`StateCopy` holds those rules (sans-IO: frames in, no sockets, no clock);
:func:`take_backup` does the I/O with its own SUB and DEALER per server, as the
client agent does, and fails over to the next server of the list when one does
not answer.  Entries are kept as the raw frames the server sent (sequence, uuid,
properties, body), never re-encoded, so a server restored from the file serves
them byte for byte: :data:`clone.storage.Entry`.

The SUB is connected, and has received something, before the snapshot is asked
for, so that the updates after S0 are all delivered; a hole in them (a slow
joiner, a high-water mark) is detected and the copy starts over.
"""

from __future__ import annotations

import logging
import os
import time
import uuid as uuidlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import zmq

from clone.client.agent import split_endpoint
from clone.client.direct import server_sockets
from clone.errors import NotSynced, ProtocolError, SecurityError, StorageError
from clone.security import KeyPair
from clone.storage import Entry, write_state_file
from clone.wire.batch import decode_kvbatch, is_kvbatch
from clone.wire.codec import (
    Hugz,
    SnapshotEnd,
    decode_snapshot_reply,
    decode_update,
    encode_icanhaz,
    fast_kvsync_entry,
)
from clone.wire.control import is_control
from clone.wire.frames import (
    recv_frames,
)
from clone.wire.protocol import (
    BATCH_METADATA,
)

__all__ = [
    "Backup",
    "CopyRestart",
    "StateCopy",
    "check_writable",
    "take_backup",
    "write_backup",
]

log = logging.getLogger(__name__)

_MAX_POLL = 0.1  # seconds; the loop re-checks its deadlines at least this often


class CopyRestart(Exception):
    """The copy cannot become consistent (a hole in the updates): start over."""


@dataclass(frozen=True, slots=True)
class Backup:
    """A consistent copy: every update up to ``sequence`` applied, none after."""

    entries: dict[bytes, Entry]
    sequence: int
    server: str


class StateCopy:
    """Snapshot, fence and replayed updates -> one consistent state (sans-IO).

    Phases: ``snapshot`` (KVSYNC/KVBATCH into ``entries``, KVPUBs buffered) ->
    ``fence`` (waiting for the fence's KTHXBAI) -> ``catch_up`` (KVPUBs applied
    in order up to the target) -> ``done``.
    """

    def __init__(self, fence_subtree: str) -> None:
        self.entries: dict[bytes, Entry] = {}
        self.phase = "snapshot"
        self.fence_subtree = fence_subtree
        self.sequence = 0  # the last update applied (S0 once the snapshot ended)
        self.target = 0
        self._newest_entry = 0
        self._buffer: list[tuple[int, bytes, Entry]] = []

    @property
    def done(self) -> bool:
        return self.phase == "done"

    # -- snapshot port ------------------------------------------------------

    def snapshot_reply(self, frames: list[bytes]) -> bool:
        """A message on the DEALER; True when the caller should send the fence."""
        if self.phase == "snapshot":
            if fast_kvsync_entry(frames) is not None:
                self._store(frames[0], frames[1], frames[2], frames[3], frames[4])
                return False
            if is_kvbatch(frames):
                batch = decode_kvbatch(frames)  # ProtocolError: the caller starts over
                for row in zip(
                    batch.raw_keys,
                    batch.sequence_frames(),
                    batch.uuids,
                    batch.raw_properties,
                    batch.bodies,
                    strict=True,
                ):
                    self._store(*row)
                return False
        elif self.phase != "fence" or is_kvbatch(frames) or fast_kvsync_entry(frames):
            return False  # entries under the fence subtree, or late replies: not ours
        msg = decode_snapshot_reply(frames)
        if not isinstance(msg, SnapshotEnd):
            return False
        if msg.view is not None:
            # A filtered snapshot and stream: not the server's state, and its
            # holes would look like lost updates for ever.
            raise SecurityError(
                f"the server restricts what this client may read (view {msg.view}): a "
                f'backup needs every key; give its certificate read = [""] in the ACL'
            )
        if self.phase == "snapshot" and msg.subtree == "":
            self.sequence = msg.sequence
            self.phase = "fence"
            return True
        if self.phase == "fence" and msg.subtree == self.fence_subtree:
            self.target = max(msg.sequence, self._newest_entry, self.sequence)
            self.phase = "catch_up"
            buffered, self._buffer = self._buffer, []
            for sequence, key, entry in buffered:
                self._apply(sequence, key, entry)
        return False

    def _store(self, key: bytes, seq: bytes, uuid: bytes, props: bytes, body: bytes) -> None:
        sequence = int.from_bytes(seq, "big")
        if sequence > self._newest_entry:
            self._newest_entry = sequence
        if body:  # an empty body is a delete: not part of the state
            self.entries[bytes(key)] = (bytes(seq), bytes(uuid), bytes(props), bytes(body))

    # -- publisher ----------------------------------------------------------

    def update(self, frames: list[bytes]) -> None:
        """A message on the SUB: a KVPUB buffered or applied, or a HUGZ.

        Raises :class:`CopyRestart` on a hole, ProtocolError on a malformed KVPUB.
        Control messages (our own refusal notices: a backup writes nothing) are
        not the state's.
        """
        if is_control(frames):
            return
        msg = decode_update(frames)
        if isinstance(msg, Hugz):
            # Our servers put their sequence in HUGZ, after every KVPUB up to
            # it on the same socket: one still missing then was lost, not late.
            if self.phase == "catch_up" and msg.sequence > self.sequence:
                raise CopyRestart(
                    f"HUGZ announces sequence {msg.sequence} but updates after "
                    f"{self.sequence} never arrived on the subscription"
                )
            return
        entry: Entry = (frames[1], frames[2], frames[3], frames[4])
        if self.phase == "snapshot" or self.phase == "fence":
            self._buffer.append((msg.sequence, frames[0], entry))
        elif self.phase == "catch_up":
            self._apply(msg.sequence, frames[0], entry)

    def _apply(self, sequence: int, key: bytes, entry: Entry) -> None:
        if self.done or sequence <= self.sequence:
            return  # in the snapshot already, or after the target
        if sequence != self.sequence + 1:
            raise CopyRestart(
                f"updates {self.sequence + 1}..{sequence - 1} never arrived on the subscription"
            )
        if entry[3]:
            self.entries[key] = entry
        else:
            self.entries.pop(key, None)
        self.sequence = sequence
        if sequence >= self.target:
            self.phase = "done"

    def check_done(self) -> None:
        """Catch-up with nothing to replay (no writes since S0) is complete at once."""
        if self.phase == "catch_up" and self.sequence >= self.target:
            self.phase = "done"


def take_backup(
    servers: Sequence[str],
    *,
    timeout: float,
    silence: float,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    curve: tuple[KeyPair, bytes] | None = None,
) -> Backup:
    """A consistent copy of the active server's state, from the first of
    ``servers`` that gives one.

    A server that stays silent for ``silence`` seconds (no HUGZ, no snapshot
    reply, no update while one is due) is given up for the next one, round
    robin, until ``timeout`` seconds have passed: then :class:`NotSynced`.
    ``curve`` (our key pair, the server's public key) makes every socket a
    CURVE client, as :class:`~clone.client.frontend.Clone` does.
    """
    if not servers:
        raise ValueError("no servers to back up from")
    for endpoint in servers:
        split_endpoint(endpoint)  # ValueError now, not after a timeout
    own_ctx = ctx is None
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
    deadline = clock() + timeout
    reasons: dict[str, str] = {}
    try:
        attempt = 0
        while clock() < deadline:
            endpoint = servers[attempt % len(servers)]
            try:
                return _copy_from(context, endpoint, deadline, silence, clock, curve)
            except CopyRestart as exc:  # the server answers: try it again
                reasons[endpoint] = str(exc)
                log.warning("backup from %s starts over: %s", endpoint, exc)
            except (_Silent, ProtocolError) as exc:
                reasons[endpoint] = str(exc)
                log.warning("backup from %s failed: %s", endpoint, exc)
                attempt += 1
        tried = "; ".join(f"{e}: {r}" for e, r in reasons.items()) or "no attempt finished"
        raise NotSynced(
            f"no consistent copy from {', '.join(servers)} within {timeout:g} s ({tried}); "
            "check that a server of the pair is up and active, or raise --timeout"
        )
    finally:
        if own_ctx:
            context.destroy(linger=0)


class _Silent(Exception):
    """A server did not answer in time."""


def _copy_from(
    ctx: zmq.Context[zmq.Socket[bytes]],
    endpoint: str,
    deadline: float,
    silence: float,
    clock: Callable[[], float],
    curve: tuple[KeyPair, bytes] | None = None,
) -> Backup:
    with server_sockets(
        ctx, endpoint, curve=curve, optional_metadata=(BATCH_METADATA,)
    ) as (sub, dealer, poller):
        copy = StateCopy(f"/clone-backup-fence-{uuidlib.uuid4().hex}/")
        subscribed = False
        heard = clock()
        while not copy.done:
            now = clock()
            if now >= deadline:
                raise _Silent(f"out of time in phase {copy.phase}")
            if now - heard >= silence:
                what = "HUGZ" if not subscribed else f"reply in phase {copy.phase}"
                raise _Silent(f"no {what} for {silence:g} s")
            wait = min(deadline - now, heard + silence - now, _MAX_POLL)
            events = dict(poller.poll(max(1, int(wait * 1000))))
            if sub in events:
                for _ in range(10_000):
                    try:
                        frames = recv_frames(sub)
                    except zmq.Again:
                        break
                    copy.update(frames)
                    if not subscribed:
                        # The subscription is live: updates after the snapshot's
                        # start will reach us.  Now ask.
                        subscribed = True
                        heard = clock()
                        dealer.send_multipart(encode_icanhaz(""))
                        log.info("asked %s for a snapshot", endpoint)
                    elif copy.phase == "catch_up":
                        heard = clock()  # a passive server's HUGZ only count from here
                    if copy.done:
                        break
            if dealer in events and not copy.done:
                for _ in range(10_000):
                    try:
                        frames = recv_frames(dealer)
                    except zmq.Again:
                        break
                    heard = clock()
                    if copy.snapshot_reply(frames):
                        log.info(
                            "snapshot from %s ends at %d with %d keys; fencing",
                            endpoint,
                            copy.sequence,
                            len(copy.entries),
                        )
                        dealer.send_multipart(encode_icanhaz(copy.fence_subtree))
                copy.check_done()
        log.info(
            "copy from %s consistent at %d: %d keys", endpoint, copy.sequence, len(copy.entries)
        )
        return Backup(copy.entries, copy.sequence, endpoint)


def check_writable(path: str | os.PathLike[str]) -> None:
    """Refuse early a target we could not write, before copying a whole state."""
    target = Path(path)
    parent = target.parent
    if target.is_dir():
        raise StorageError(f"cannot write {target}: it is a directory; give a file name")
    if not parent.is_dir():
        raise StorageError(f"cannot write {target}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise StorageError(f"cannot write {target}: directory {parent} is not writable by us")


def write_backup(path: str | os.PathLike[str], backup: Backup) -> None:
    """The copy as a state file ``clone-server --restore`` reads.

    Term 0: a backup is not a server's history, so it claims no Binary Star term.
    """
    write_state_file(path, backup.entries, sequence=backup.sequence, term=0)
