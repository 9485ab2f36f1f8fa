"""``clone conflicts``: list a pair's split-brain conflicts, apply or discard one.

How this works: a conflict is kept by the server that judged it, the active
of a healed split brain (docs/failover.md, "Writes of a split brain").  The
listing asks every server at once (``CONFLICTS?``, :mod:`clone.wire.conflicts`,
one fresh DEALER each, as ``clone status`` does) and merges the answers, each
conflict marked with the server that holds it.  Applying or discarding one is
a call (``conflict-apply``/``conflict-discard``) with the conflict's key,
sent to the server that holds it: under CURVE with an ACL only a client that
may write the key may resolve it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from clone.client.agent import split_endpoint
from clone.errors import ProtocolError
from clone.security import KeyPair, configure_client_socket
from clone.wire.calls import (
    CONFLICT_PROPERTY,
    OP_CONFLICT_APPLY,
    OP_CONFLICT_DISCARD,
    Reply,
    decode_reply,
    encode_call,
)
from clone.wire.codec import new_uuid
from clone.wire.conflicts import (
    MAX_CONFLICTS_BYTES,
    decode_conflicts,
    encode_conflicts_request,
)
from clone.wire.frames import Offers, cap_message_size, offer_frames
from clone.wire.protocol import SNAPSHOT_OFFSET

__all__ = ["conflicts_table", "query_conflicts", "resolve_conflict"]

log = logging.getLogger(__name__)

_Curve = tuple[KeyPair, bytes] | None


def _dealer(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, curve: _Curve) -> zmq.Socket[bytes]:
    host, base = split_endpoint(endpoint)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    cap_message_size(sock, MAX_CONFLICTS_BYTES + 64)
    if curve is not None:
        configure_client_socket(sock, *curve)
    sock.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
    return sock


def query_conflicts(
    endpoints: Sequence[str],
    timeout: float = 2.0,
    *,
    everything: bool = False,
    curve: _Curve = None,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Every server's conflicts (unresolved ones, or all with ``everything``),
    each with ``server``: its endpoint; and the endpoints that did not answer
    within ``timeout`` (or answered nonsense)."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: dict[zmq.Socket[bytes], str] = {}
    found: list[dict[str, Any]] = []
    bad: list[str] = []
    try:
        poller = zmq.Poller()
        offers = Offers(encode_conflicts_request(everything=everything))
        for endpoint in endpoints:
            sock = _dealer(ctx, endpoint, curve)
            socks[sock] = endpoint
            offers.offer(sock)
            poller.register(sock, zmq.POLLIN)
        deadline = clock() + timeout
        waiting = set(socks)
        while waiting and (left := deadline - clock()) > 0:
            for sock, _ in poller.poll(offers.poll_ms(left)):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                poller.unregister(sock)
                waiting.discard(sock)
                try:
                    listing = decode_conflicts(frames)
                except ProtocolError as exc:
                    log.warning("bad CONFLICTS reply from %s: %s", socks[sock], exc)
                    bad.append(socks[sock])
                    continue
                for rec in listing["conflicts"]:
                    found.append({"server": socks[sock], **rec})
        silent = [socks[s] for s in socks if s in waiting]
    finally:
        for sock in socks:
            sock.close(linger=0)
        ctx.term()
    return found, silent + bad


def resolve_conflict(
    endpoint: str,
    conflict_id: int,
    key: str,
    *,
    apply: bool,
    timeout: float = 5.0,
    curve: _Curve = None,
) -> Reply:
    """Apply (write the loser's value now) or discard conflict ``conflict_id``
    of ``key`` on the server at ``endpoint``; its REPLY.  TimeoutError when
    it does not answer in time."""
    op = OP_CONFLICT_APPLY if apply else OP_CONFLICT_DISCARD
    uuid = new_uuid()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = _dealer(ctx, endpoint, curve)
    try:
        # Writable once a connection can take the call (frames.offer_frames).
        if not sock.poll(max(1, round(timeout * 1000)), zmq.POLLOUT) or not offer_frames(
            sock, encode_call(op, uuid, key, ((CONFLICT_PROPERTY, str(conflict_id)),))
        ):
            raise TimeoutError(f"no connection to {endpoint} took the call within {timeout:g} s")
        if not sock.poll(max(1, round(timeout * 1000))):
            raise TimeoutError(f"{endpoint} did not answer within {timeout:g} s")
        reply = decode_reply(sock.recv_multipart())
        if reply.uuid != uuid:
            raise ProtocolError(f"{endpoint} answered another call")
        return reply
    finally:
        sock.close(linger=0)
        ctx.term()


def conflicts_table(found: Sequence[dict[str, Any]]) -> list[str]:
    """Aligned lines for people: a header, then one line per conflict."""
    header = ("SERVER", "ID", "KEY", "REASON", "LOSER (term)", "WINNER", "RESOLUTION")
    rows = [header]
    for rec in found:
        loser, winner = rec.get("loser") or {}, rec.get("winner") or {}
        rows.append(
            (
                str(rec.get("server", "-")),
                str(rec.get("id", "-")),
                str(rec.get("key", "-")),
                str(rec.get("reason", "-")),
                f"{_short(loser.get('value'))} ({loser.get('term', '-')})",
                _short(winner.get("value")),
                str(rec.get("resolution") or "unresolved"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _short(value: object) -> str:
    if value is None:
        return "(absent)"
    text = repr(value)[1:-1] if isinstance(value, str) else str(value)
    return text if len(text) <= 30 else text[:27] + "..."
