"""A consistent snapshot of the store, taken in the driver over raw CHP.

How this works: CHP snapshots are fuzzy (docs/protocol.md): KTHXBAI carries
the server's sequence *when the snapshot started*, and a KVSYNC may already
hold a newer value.  To get the store exactly as it was after one sequence we
do what a client does, and then stop at a known point:

1. subscribe to every server's PUBLISHER (the subtree and HUGZ) and wait for
   the first HUGZ: it names the active server (only the active one sends
   HUGZ) and proves our subscription is live;
2. ask that server for the snapshot (ICANHAZ?) and read KVSYNC... KTHXBAI,
   buffering every KVPUB that arrives meanwhile;
3. replay the buffered stream: KVPUBs with a sequence above the KTHXBAI's
   (never over a newer value), until a HUGZ whose sequence ``H`` is at least
   every sequence seen.  PUB delivers in order, so every update up to ``H``
   was in the stream before that HUGZ: the result is the store (or subtree)
   exactly as of sequence ``H``.  That is the sequence we record.

A server that does not answer in ``timeout`` seconds is skipped and the next
one is tried, so an export survives a failover (it starts over).  The whole
snapshot is held in the driver's memory: Clone is a configuration store.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq

from clone.argtypes import normalize_endpoints
from clone.errors import ProtocolError
from clone.pipeline.errors import InputError, ServersUnreachable
from clone.security import KeyPair, configure_client_socket
from clone.wire.batch import decode_kvbatch, is_kvbatch
from clone.wire.codec import (
    Hugz,
    KVMsg,
    SnapshotEnd,
    decode_snapshot_reply,
    decode_update,
    encode_icanhaz,
    validate_subtree,
)
from clone.wire.protocol import BATCH_METADATA, HUGZ, PUBLISHER_OFFSET, SNAPSHOT_OFFSET

__all__ = [
    "Snapshot",
    "SilenceClock",
    "parse_servers",
    "endpoint_at",
    "find_active",
    "take_snapshot",
]

log = logging.getLogger(__name__)

Clock = Callable[[], float]
#: Our key pair and the server's public key (``load_curve_keys``), or None.
Curve = tuple[KeyPair, bytes] | None

# Messages read from one socket per poll: a snapshot arrives far faster than
# one poll per message could take it.
_DRAIN = 1024


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The store (or a subtree) exactly as of update ``sequence``."""

    entries: dict[str, KVMsg]
    sequence: int
    snapshot_sequence: int
    server: str
    subtree: str


#: Snapshot messages libzmq may queue for the reader (see _snapshot_from).
_SNAPSHOT_RCVHWM = 16


class SilenceClock:
    """How long a server has been silent: the time since it was last *heard*.

    The rule (from loads of a million rows): handling what arrived (a thousand KVBATCHes of a large
    store) takes our time, not the server's, so it never counts as silence.
    The reader gives up only when :meth:`expired` and a poll that waited
    nothing found nothing waiting; every message read calls :meth:`heard`.
    Pure: the caller passes ``now``.
    """

    __slots__ = ("_last", "timeout")

    def __init__(self, timeout: float, now: float) -> None:
        if not timeout > 0:
            raise ValueError("timeout must be > 0")
        self.timeout = timeout
        self._last = now

    def heard(self, now: float) -> None:
        self._last = max(self._last, now)

    def left(self, now: float) -> float:
        """Seconds the reader may still wait (<= 0: only a check, no wait)."""
        return self._last + self.timeout - now

    def expired(self, now: float, waiting: bool) -> bool:
        """Give up: silent for ``timeout`` and nothing ``waiting`` to be read."""
        return not waiting and self.left(now) <= 0


def parse_servers(servers: str | Sequence[str]) -> list[str]:
    """``"h:p,tcp://h2:p2"`` or a list of them -> ``["tcp://h:p", "tcp://h2:p2"]``.

    The same spelling rules as ``clone --servers`` (:func:`normalize_endpoints`).
    """
    try:
        out = normalize_endpoints(servers)
    except (ValueError, TypeError) as exc:
        raise InputError(str(exc)) from None
    if not out:
        raise InputError("no servers given (--servers host:port[,host:port])")
    return out


def endpoint_at(endpoint: str, offset: int) -> str:
    """The endpoint ``offset`` ports above a server's base port."""
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + offset}"


class _Subscriptions:
    """One SUB per server, subscribed to HUGZ and the subtree."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        servers: Sequence[str],
        subtree: str,
        curve: Curve = None,
    ):
        self.sockets: list[zmq.Socket[bytes]] = []
        self.poller = zmq.Poller()
        for server in servers:
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            if curve is not None:
                configure_client_socket(sub, *curve)
            sub.rcvhwm = 0  # never drop an update while we read the snapshot
            sub.setsockopt(zmq.SUBSCRIBE, subtree.encode("utf-8"))
            if subtree:
                sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
            sub.connect(endpoint_at(server, PUBLISHER_OFFSET))
            self.sockets.append(sub)
            self.poller.register(sub, zmq.POLLIN)

    def close(self) -> None:
        for sub in self.sockets:
            sub.close(linger=0)


def _wait_for_hugz(subs: _Subscriptions, deadline: float, clock: Clock) -> int | None:
    """Index of the first server that sends a HUGZ before ``deadline``."""
    while (left := deadline - clock()) > 0:
        for sock, _ in subs.poller.poll(timeout=max(1, int(left * 1000))):
            frames = sock.recv_multipart()
            if frames and frames[0] == HUGZ:
                return subs.sockets.index(sock)
    return None


def find_active(
    servers: Sequence[str],
    *,
    timeout: float = 5.0,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    clock: Clock = time.monotonic,
    curve: Curve = None,
) -> str:
    """The endpoint of the server that is active now (it sends HUGZ).

    Raises :class:`ServersUnreachable` when none does within ``timeout``.
    """
    ctx = context or zmq.Context()
    subs = _Subscriptions(ctx, servers, "", curve)
    try:
        index = _wait_for_hugz(subs, clock() + timeout, clock)
    finally:
        subs.close()
        if context is None:
            ctx.term()
    if index is None:
        raise ServersUnreachable(
            f"no active Clone server at {', '.join(servers)} (no heartbeat in {timeout:g}s)"
        )
    return servers[index]


def _apply(entries: dict[str, KVMsg], msg: KVMsg) -> None:
    """Apply a KVPUB unless the entry is already as new or newer."""
    current = entries.get(msg.key)
    if current is not None and current.sequence >= msg.sequence:
        return
    if msg.is_delete:
        entries.pop(msg.key, None)
    else:
        entries[msg.key] = msg


def _snapshot_from(
    ctx: zmq.Context[zmq.Socket[bytes]],
    subs: _Subscriptions,
    index: int,
    server: str,
    subtree: str,
    timeout: float,
    clock: Clock,
    progress: Callable[[int], None] | None,
    curve: Curve = None,
) -> Snapshot:
    sub = subs.sockets[index]
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    # Few batches queued on our side: libzmq then reads the connection as we
    # handle them, and the server sees its stream move.  At the default (1,000
    # messages, 4M entries) the queue took ~47 s to handle, the server's send
    # window stood still for its --snapshot-stall-timeout (10 s), and it
    # aborted the 10M export's stream as stalled.
    dealer.rcvhwm = _SNAPSHOT_RCVHWM
    if curve is not None:
        configure_client_socket(dealer, *curve)
    try:
        # Our servers then pack the snapshot into KVBATCHes (protocol.md); the
        # Guide's ignore the property and send KVSYNCs, which we take as well.
        dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
    except zmq.ZMQError:  # a libzmq older than 4.3
        log.debug("this libzmq cannot send ZMTP metadata; asking without KVBATCH")
    dealer.connect(endpoint_at(server, SNAPSHOT_OFFSET))
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    poller.register(sub, zmq.POLLIN)
    stream: deque[KVMsg | Hugz] = deque()
    entries: dict[str, KVMsg] = {}
    end: SnapshotEnd | None = None
    highest = 0
    try:
        dealer.send_multipart(encode_icanhaz(subtree))
        silence = SilenceClock(timeout, clock())
        while True:
            if end is not None:
                result = _replay(entries, stream, end.sequence, highest)
                if result is not None:
                    return Snapshot(entries, result, end.sequence, server, subtree)
            # After long handling ``left`` is <= 0: poll(0) still sees what waits.
            ready = poller.poll(timeout=max(0, int(silence.left(clock()) * 1000)))
            if silence.expired(clock(), waiting=bool(ready)):
                what = "the snapshot" if end is None else "a heartbeat after the snapshot"
                raise TimeoutError(f"{server} sent no more of {what} for {timeout:g}s")
            for sock, _ in ready:
                for _ in range(_DRAIN):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sock is sub:
                        stream.append(decode_update(frames))
                        # Until the snapshot ends only its own messages say it
                        # is still coming: a server that aborted it (a stalled
                        # requester) goes on sending HUGZ, and counting them
                        # left the 10M export waiting forever.
                        if end is not None:
                            silence.heard(clock())
                        continue
                    silence.heard(clock())
                    if is_kvbatch(frames):
                        batch = decode_kvbatch(frames)
                        entries.update(zip(batch.keys, batch.messages(), strict=True))
                        highest = max(highest, max(batch.sequences))
                        continue
                    reply = decode_snapshot_reply(frames)
                    if isinstance(reply, SnapshotEnd):
                        end = reply
                        highest = max(highest, reply.sequence)
                    else:
                        entries[reply.key] = reply
                        highest = max(highest, reply.sequence)
            if progress is not None:
                progress(len(entries))
    finally:
        dealer.close(linger=0)


def _replay(
    entries: dict[str, KVMsg], stream: deque[KVMsg | Hugz], start: int, highest: int
) -> int | None:
    """Apply buffered updates above ``start`` up to the first HUGZ that covers
    ``highest``; return that HUGZ's sequence, or None (and keep the rest) if
    the stream has not reached one yet."""
    while stream:
        item = stream.popleft()
        if isinstance(item, Hugz):
            if item.sequence >= highest:
                return item.sequence
            continue
        if item.sequence > start:
            _apply(entries, item)
    return None


def take_snapshot(
    servers: Sequence[str],
    subtree: str = "",
    *,
    timeout: float = 5.0,
    context: zmq.Context[zmq.Socket[bytes]] | None = None,
    clock: Clock = time.monotonic,
    progress: Callable[[int], None] | None = None,
    curve: Curve = None,
) -> Snapshot:
    """The store (or ``subtree``) exactly as of one sequence, from the active
    server of ``servers``; tries each server in turn within ``len(servers) + 1``
    rounds of ``timeout``.  ``progress(keys)`` is told the keys received so far;
    ``curve`` (our key pair and the server's public key) for a secured pair."""
    try:
        validate_subtree(subtree.encode("utf-8"))
    except ProtocolError as exc:
        raise InputError(f"bad subtree: {exc}") from None
    ctx = context or zmq.Context()
    try:
        for attempt in range(len(servers) + 1):
            subs = _Subscriptions(ctx, servers, subtree, curve)
            try:
                index = _wait_for_hugz(subs, clock() + timeout, clock)
                if index is None:
                    break
                server = servers[index]
                log.info("taking a snapshot of %r from %s", subtree or "/", server)
                try:
                    return _snapshot_from(
                        ctx, subs, index, server, subtree, timeout, clock, progress, curve
                    )
                except (TimeoutError, ProtocolError) as exc:
                    log.warning("snapshot attempt %d failed: %s", attempt + 1, exc)
            finally:
                subs.close()
    finally:
        if context is None:
            ctx.term()
    raise ServersUnreachable(
        f"no Clone server at {', '.join(servers)} delivered a snapshot (timeout {timeout:g}s)"
    )
