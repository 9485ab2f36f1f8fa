"""A server's status: one JSON-ready dict, for ``clone status`` and the HTTP page.

How this works: :func:`server_status` is a pure function of plain inputs (no
zmq, no clock reads: times come in as arguments), so it is tested with
explicit values; the server gathers those inputs in one thin method
(``Monitor.status``) and answers a ``STATUS?`` on the snapshot port with
the result (docs/protocol.md, **[extension: status]**).  The HTTP status page
and ``/metrics`` reuse it.  It never holds keys or values: any client admitted
under CURVE may read it.

Fields (every one always present; ``null`` where it does not apply):

``format``
    int, the version of this layout (1).  Fields may be added, never renamed.
``role``
    ``"active"``, ``"passive"`` or ``"starting"`` (Binary Star has not decided).
``mode``
    ``"primary"``, ``"backup"`` or ``"standalone"``: how the server was started.
``sequence``
    int, the highest sequence number applied.
``keys``
    int, keys in the store.
``store_bytes``
    int, bytes of keys, properties and values held.
``pending``
    int, client updates parked (passive or starting) until promotion or confirmation.
``sync_state``
    ``"idle"`` (active/starting), ``"syncing"`` (passive, snapshot under way) or
    ``"synced"`` (passive, following the active server's updates in order).
``in_step``
    bool on a passive server: synced and nothing pending, so a failover now
    loses nothing; ``null`` otherwise.
``peer``
    str, the peer's ``host:port`` (its snapshot port); ``null`` when standalone.
``peer_state``
    Binary Star's view of the peer, ``null`` when standalone: an object with
    ``state`` (the peer's last reported state, ``"primary"``, ``"backup"``,
    ``"active"``, ``"passive"``, or ``null`` if never heard), ``alive`` (bool:
    heard within the missed-heartbeat window) and ``last_contact`` (seconds
    since its last state message, or ``null`` if never heard).
``ha_state``
    str, our own Binary Star state (``"primary"``, ``"backup"``, ``"active"``,
    ``"passive"``); ``null`` when standalone.
``epoch``
    int, our Binary Star election epoch; ``null`` when standalone.
``term``
    int, the term the data was written under (the epoch of the active server
    whose updates we hold).
``uptime``
    float, seconds since the server started (monotonic clock).
``version``
    str, this server's release (:data:`clone.release.RELEASE`, setup.cfg's version).
``data_format``
    int, the data-directory format version this release writes (and migrates
    older ones to at start; :mod:`clone.storage.migrations`).  Absent from
    release 0.1.0's status, whose format is 1.
``data_dir``
    str, the data directory (durable servers), else ``null``.
``data_dir_bytes``
    int, bytes the data directory's files take on disk (database, WAL, kept
    copies); ``null`` in memory.
``durable``
    bool, whether updates are written to a data directory before publishing.
``curve``
    bool, whether CURVE (and the ACL) is on.
``last_failover``
    float, Unix time this process last took over from its peer (passive to
    active), or ``null``.
``failovers``
    int, how often this process took over from its peer: the same count as
    the ``clone_failovers_total`` metric (the first promotion at start is not
    one).
``subscribers``
    int, connected update subscribers when the server knows it, else ``null``.
``conflicts``
    int, split-brain conflicts this server keeps unresolved (``clone conflicts``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from clone.release import RELEASE
from clone.storage.schema import FORMAT_VERSION

__all__ = ["STATUS_FORMAT", "PeerView", "StatusLimiter", "clone_version", "server_status"]

#: The layout version in every status (``format``).
STATUS_FORMAT = 1



@dataclass(frozen=True, slots=True)
class PeerView:
    """Binary Star's view of the peer and of ourselves, as plain values."""

    endpoint: str | None  # the peer's snapshot port, host:port
    ha_state: str  # ours, lower case
    epoch: int
    peer_state: str | None  # the peer's last reported state, lower case, or None
    peer_alive: bool
    last_contact_age: float | None  # seconds, or None if never heard


def clone_version() -> str:
    """This code's release: the code's own constant, not the installed metadata,
    which names whatever distribution is installed rather than the code that runs."""
    return RELEASE


def server_status(
    *,
    role: str,
    mode: str,
    sequence: int,
    keys: int,
    store_bytes: int,
    pending: int,
    sync_state: str,
    term: int,
    uptime: float,
    version: str,
    data_dir: str | None,
    curve: bool,
    failovers: int,
    last_failover: float | None,
    peer: PeerView | None = None,
    subscribers: int | None = None,
    conflicts: int = 0,
    data_format: int = FORMAT_VERSION,
    data_dir_bytes: int | None = None,
) -> dict[str, Any]:
    """The status object (see the module docstring for every field)."""
    in_step = (sync_state == "synced" and pending == 0) if role == "passive" else None
    peer_state: dict[str, Any] | None = None
    if peer is not None:
        age = peer.last_contact_age
        peer_state = {
            "state": peer.peer_state,
            "alive": peer.peer_alive,
            "last_contact": None if age is None else round(max(0.0, age), 3),
        }
    return {
        "format": STATUS_FORMAT,
        "role": role,
        "mode": mode,
        "sequence": sequence,
        "keys": keys,
        "store_bytes": store_bytes,
        "pending": pending,
        "sync_state": sync_state,
        "in_step": in_step,
        "peer": None if peer is None else peer.endpoint,
        "peer_state": peer_state,
        "ha_state": None if peer is None else peer.ha_state,
        "epoch": None if peer is None else peer.epoch,
        "term": term,
        "uptime": round(max(0.0, uptime), 3),
        "version": version,
        "data_format": data_format,
        "data_dir": data_dir,
        "data_dir_bytes": data_dir_bytes,
        "durable": data_dir is not None,
        "curve": curve,
        "last_failover": last_failover,
        "failovers": failovers,
        "subscribers": subscribers,
        "conflicts": conflicts,
    }


class StatusLimiter:
    """A token bucket: at most ``rate`` STATUS? answers a second, ``burst`` at once.

    Pure: the caller passes ``now`` (monotonic seconds).  A status is cheap, but
    a flood of requests must not take the loop from clients and the peer.
    """

    __slots__ = ("_at", "_tokens", "burst", "rate")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"need rate > 0 and burst >= 1, got {rate} and {burst}")
        self.rate = float(rate)
        self.burst = burst
        self._tokens = float(burst)
        self._at = now

    def allow(self, now: float) -> bool:
        """Take a token if one is left at ``now``; False means drop the request."""
        if now > self._at:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
            self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False
