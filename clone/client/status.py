"""``clone status``: ask every server of a pair for its status, in parallel.

How this works: one fresh DEALER per server (CURVE as for any client socket)
sends ``STATUS?`` to its snapshot port (docs/protocol.md, **[extension:
status]**); one poller waits for every answer until a single deadline.  A
server that does not answer in time (down, unreachable, a CURVE handshake that
never completes, a Guide server that ignores the request, or a reply dropped by
its rate limit) is reported unreachable.  Read-only: it is no snapshot
request, so it never makes a passive server active.
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
from clone.wire.frames import Offers, cap_message_size
from clone.wire.protocol import MAX_STATUS_BYTES, SNAPSHOT_OFFSET
from clone.wire.status import decode_status, encode_status_request

__all__ = ["STATUS_COLUMNS", "query_status", "status_table"]

log = logging.getLogger(__name__)

#: The fields every result carries, ``None`` when the server did not answer.
STATUS_COLUMNS = (
    "role", "sequence", "keys", "peer_state", "uptime", "version", "data_format",
)


def query_status(
    endpoints: Sequence[str],
    timeout: float = 2.0,
    *,
    curve: tuple[KeyPair, bytes] | None = None,
    ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> list[dict[str, Any]]:
    """One status per endpoint, in the order given.

    Each is the server's status object (:mod:`clone.server.status`) plus
    ``endpoint`` and ``reachable: true``; for a server that did not answer
    within ``timeout`` seconds, ``reachable: false``, an ``error`` and ``None``
    for the :data:`STATUS_COLUMNS`.  Raises ValueError for a bad endpoint.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    targets = [(endpoint, *split_endpoint(endpoint)) for endpoint in endpoints]
    own_ctx = ctx is None
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context() if ctx is None else ctx
    results: dict[str, dict[str, Any]] = {}
    socks: dict[zmq.Socket[bytes], str] = {}
    offers = Offers(encode_status_request())
    try:
        poller = zmq.Poller()
        for endpoint, host, base in targets:
            sock = context.socket(zmq.DEALER)
            socks[sock] = endpoint
            sock.setsockopt(zmq.LINGER, 0)
            cap_message_size(sock, MAX_STATUS_BYTES + 64)
            if curve is not None:
                configure_client_socket(sock, *curve)
            sock.connect(f"{host}:{base + SNAPSHOT_OFFSET}")
            # Queued until connected: the DEALER sends once the handshake is done.
            offers.offer(sock)
            poller.register(sock, zmq.POLLIN)
        deadline = clock() + timeout
        waiting = set(socks)
        while waiting:
            left = deadline - clock()
            if left <= 0:
                break
            for sock, _ in poller.poll(offers.poll_ms(left)):
                endpoint = socks[sock]
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    status = decode_status(frames)
                except ProtocolError as exc:
                    log.warning("bad STATUS reply from %s: %s", endpoint, exc)
                    results[endpoint] = _unreachable(endpoint, f"bad reply: {exc}")
                else:
                    status.pop("endpoint", None)  # ours, not the server's say
                    status.pop("reachable", None)
                    results[endpoint] = {"endpoint": endpoint, "reachable": True, **status}
                poller.unregister(sock)
                waiting.discard(sock)
    finally:
        for sock in socks:
            sock.close(linger=0)
        if own_ctx:
            context.term()
    never_sent = {socks[sock] for sock in offers.unsent}
    return [
        results.get(endpoint)
        or _unreachable(
            endpoint,
            f"no connection took the request within {timeout:g} s "
            "(the server refused the handshake?)"
            if endpoint in never_sent
            else f"no answer within {timeout:g} s",
        )
        for endpoint, _, _ in targets
    ]


def _unreachable(endpoint: str, error: str) -> dict[str, Any]:
    out: dict[str, Any] = {"endpoint": endpoint, "reachable": False, "error": error}
    out.update(dict.fromkeys(STATUS_COLUMNS))
    return out


def _peer_text(status: dict[str, Any]) -> str:
    peer = status.get("peer_state")
    if not isinstance(peer, dict):
        return "-"
    state = peer.get("state") or "unknown"
    return f"{state} ({'alive' if peer.get('alive') else 'dead'})"


def _uptime_text(value: object) -> str:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return "-"
    seconds = int(value)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h{minutes:02d}m"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _version_text(status: dict[str, Any]) -> str:
    """``0.2.0 (format 2)``; a release before 0.2.0 reports no format (it is 1)."""
    version, fmt = status.get("version"), status.get("data_format")
    if version is None:
        return "-"
    return f"{version} (format {fmt})" if fmt is not None else str(version)


def _disk_text(nbytes: object) -> str:
    """The data directory's size, ``785.2M``; ``-`` in memory or from an older release."""
    if not isinstance(nbytes, int):
        return "-"
    size = float(nbytes)
    for unit in ("B", "K", "M", "G"):
        if size < 1024 or unit == "G":
            return f"{size:.0f}{unit}" if unit == "B" else f"{size:.1f}{unit}"
        size /= 1024
    return "-"  # unreachable


def _cell(value: object) -> str:
    return "-" if value is None else str(value)


def status_table(statuses: Sequence[dict[str, Any]]) -> list[str]:
    """Aligned lines, a header first: one line per server."""
    header = (
        "ENDPOINT", "REACHABLE", "ROLE", "SEQUENCE", "KEYS", "DISK", "PEER", "UPTIME", "VERSION",
    )
    rows = [header]
    for s in statuses:
        reachable = bool(s.get("reachable"))
        rows.append(
            (
                _cell(s.get("endpoint")),
                "yes" if reachable else "NO",
                _cell(s.get("role")),
                _cell(s.get("sequence")),
                _cell(s.get("keys")),
                _disk_text(s.get("data_dir_bytes")),
                _peer_text(s) if reachable else "-",
                _uptime_text(s.get("uptime")),
                _version_text(s),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    # Split-brain writes a server kept instead of applying: an operator must
    # decide each (docs/operations.md, "Split-brain conflicts").
    for s in statuses:
        unresolved = s.get("conflicts")
        if isinstance(unresolved, int) and unresolved > 0:
            lines.append(
                f"{_cell(s.get('endpoint'))}: {unresolved} unresolved split-brain"
                " conflict(s): see `clone conflicts`"
            )
    return lines
