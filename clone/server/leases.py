"""Leases: which exist, when each runs out, and which keys each holds.

How this works: a lease is granted by a client's ``lease-grant`` call and
stored as an ordinary key, ``/_clone/lease/<id>`` (:mod:`clone.wire.calls`),
so the passive server, the data directory and every snapshot hold it without a
mechanism of their own.  What is *not* replicated is when a lease runs out:
keepalives arrive only at the active server and are not updates (publishing
one would send every node a change per keepalive).  So this table lives on the
active server only, and is rebuilt from the store whenever a server becomes
active (or starts active from its data directory), giving every lease a full
ttl from that moment: a holder that is alive keeps it across the failover, a
dead one loses it one ttl later.  "That moment" is when the server can first
be reached: its clocks restart (:meth:`LeaseTable.restart`) once the
promotion's writes are done, and a grant's once its reply is sent after its
commit, so a slow disk never ends a lease its holder could not keep alive.

A key bound to a lease carries ``lease=<id>`` in its properties.  The table
remembers the keys written under each lease (a superset: a key rewritten
without the lease, or deleted, stays listed), and the core checks each one's
stored properties before deleting it.  Deadlines sit in a heap, one entry
per lease, pushed when it is granted: a keepalive only moves the lease's own
deadline, and an entry that surfaces before its lease's deadline is pushed
again at that deadline (10,000 leases kept alive every ttl/3 pushed 10,000
entries a second onto a heap of 40,000, in the keepalive's path; now an entry
per lease per ttl, when the expiry timer looks).  Revoked and expired leases'
entries are skipped when they surface; the heap is compacted when stale
entries outnumber live ones.

Ownership (docs/protocol.md, "Lease ownership"): the lease key carries
``owner=<owner>`` in its properties (``name:<certificate name>`` under CURVE,
``secret:<sha256 of the grant's secret>`` without), so a new active server
knows it too; a lease whose key has none (written before ownership existed)
has no owner, and nobody may keep it alive, revoke it or bind to it: it runs
out one ttl after the server became active.  The per-client count behind
``--max-leases-per-client`` is the active's own (not replicated): leases it
rebuilt count for their owner when it is a certificate name, for nobody else.

Sans-IO: every ``now`` is passed in, on the monotonic clock (as key expiry):
a step of the wall clock ends no lease early and keeps none alive.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from clone.wire.calls import LEASE_PROPERTY, parse_lease_ttl

__all__ = [
    "OWNER_PROPERTY",
    "Lease",
    "LeaseTable",
    "bound_lease",
    "format_lease_value",
    "lease_owner",
    "parse_lease_value",
]

_TOKEN = f"{LEASE_PROPERTY}=".encode()
#: The lease key's property naming who may use the lease.
OWNER_PROPERTY = "owner"
_OWNER_TOKEN = f"{OWNER_PROPERTY}=".encode()


@dataclass(slots=True)
class Lease:
    """One live lease on the active server."""

    id: str
    ttl: float
    deadline: float
    #: Keys written under this lease (possibly since rewritten or deleted).
    keys: set[bytes] = field(default_factory=set)
    #: Who may use it (``name:...`` or ``secret:<sha256>``); None: nobody.
    owner: str | None = None
    #: Whose quota it counts against ("" for none).
    client: str = ""


def format_lease_value(ttl: float) -> bytes:
    """The value of a lease's key: its ttl, so a new active server knows it."""
    return f"ttl={ttl!r}".encode()


def parse_lease_value(body: bytes) -> float | None:
    """The ttl a lease key's value holds, or None if it is not one of ours."""
    try:
        text = body.decode("ascii")
    except UnicodeDecodeError:
        return None
    name, eq, value = text.partition("=")
    if name != "ttl" or not eq:
        return None
    try:
        return parse_lease_ttl(value)
    except ValueError:
        return None


def bound_lease(props: bytes) -> str | None:
    """The lease a stored entry's raw properties bind it to, if any."""
    return _raw_prop(props, _TOKEN)


def lease_owner(props: bytes) -> str | None:
    """The owner a lease key's raw properties record, if any."""
    return _raw_prop(props, _OWNER_TOKEN)


def _raw_prop(props: bytes, token: bytes) -> str | None:
    if not props or token not in props:
        return None
    for line in props.split(b"\n"):
        if line.startswith(token):
            try:
                return line[len(token) :].decode("ascii")
            except UnicodeDecodeError:
                return None
    return None


class LeaseTable:
    """The live leases, their deadlines and their keys.  Not thread-safe."""

    __slots__ = ("_heap", "_leases", "_per_client", "max_leases")

    def __init__(self, max_leases: int) -> None:
        if max_leases < 1:
            raise ValueError(f"max_leases must be at least 1, not {max_leases}")
        self.max_leases = max_leases
        self._leases: dict[str, Lease] = {}
        self._heap: list[tuple[float, str]] = []
        self._per_client: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def live(self) -> Iterable[Lease]:
        """Every live lease (for a scan of their keys)."""
        return self._leases.values()

    @property
    def full(self) -> bool:
        return len(self._leases) >= self.max_leases

    def grant(self, lease_id: str, ttl: float, now: float) -> Lease:
        """A new lease running out at ``now + ttl`` (the caller checked :attr:`full`)."""
        lease = Lease(lease_id, ttl, now + ttl)
        self._leases[lease_id] = lease
        self._push(lease)
        return lease

    def adopt(self, lease_id: str, owner: str | None, client: str = "") -> None:
        """Record who owns a lease (after :meth:`grant` or :meth:`rebuild`)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        self._uncount(lease)
        lease.owner, lease.client = owner, client
        if client:
            self._per_client[client] = self._per_client.get(client, 0) + 1

    def held_by(self, client: str) -> int:
        """How many live leases count against ``client``'s quota."""
        return self._per_client.get(client, 0)

    def _uncount(self, lease: Lease) -> None:
        if lease.client:
            left = self._per_client.get(lease.client, 0) - 1
            if left > 0:
                self._per_client[lease.client] = left
            else:
                self._per_client.pop(lease.client, None)

    def keepalive(self, lease_id: str, now: float) -> Lease | None:
        """Restart the lease's clock; None if there is no such lease.

        The heap is not touched: the lease's entry, due earlier, is pushed
        again at the new deadline when it surfaces (:meth:`due`)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        deadline = now + lease.ttl
        if deadline > lease.deadline:
            lease.deadline = deadline
        return lease

    def restart(self, lease_ids: Iterable[str] | None, now: float) -> int:
        """Restart the clocks of ``lease_ids`` (None: every lease) at ``now``,
        as a keepalive would; returns how many were restarted.

        For the moments a lease exists in the table before its holder can
        use it: a grant whose commit took longer than its ttl, a promotion
        whose writes held the loop (clone.server.roles).  Only ever later."""
        ids = list(self._leases) if lease_ids is None else lease_ids
        restarted = 0
        for lease_id in ids:
            if self.keepalive(lease_id, now) is not None:
                restarted += 1
        return restarted

    def bind(self, lease_id: str, key: bytes) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.keys.add(key)

    def pop(self, lease_id: str) -> Lease | None:
        """Forget the lease (revoked or expired); its stale heap entries are skipped later."""
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._uncount(lease)
        return lease

    def due(self, now: float, limit: int) -> list[str]:
        """Ids of leases whose deadline is at or before ``now`` (at most ``limit``)."""
        heap, leases = self._heap, self._leases
        out: list[str] = []
        while heap and heap[0][0] <= now and len(out) < limit:
            deadline, lease_id = heapq.heappop(heap)
            lease = leases.get(lease_id)
            if lease is None:
                continue  # revoked or expired since
            if lease.deadline > deadline:
                # Kept alive since it was pushed: due at its new deadline.
                heapq.heappush(heap, (lease.deadline, lease_id))
            elif lease_id not in out:
                out.append(lease_id)
        return out

    def next_deadline(self) -> float | None:
        """The earliest heap entry (may be before its lease's deadline, or a
        gone lease's: an early wake-up only pushes it again)."""
        return self._heap[0][0] if self._heap else None

    def rebuild(
        self, leases: Iterable[tuple[str, float]], bindings: Iterable[tuple[str, bytes]], now: float
    ) -> list[bytes]:
        """Start over from the store: every lease gets a full ttl from ``now``.

        Returns the keys bound to a lease that does not exist (to delete).
        """
        self._leases = {}
        self._heap = []
        self._per_client = {}
        for lease_id, ttl in leases:
            self.grant(lease_id, ttl, now)
        orphans: list[bytes] = []
        for lease_id, key in bindings:
            lease = self._leases.get(lease_id)
            if lease is None:
                orphans.append(key)
            else:
                lease.keys.add(key)
        return orphans

    def clear(self) -> None:
        self._leases = {}
        self._heap = []
        self._per_client = {}

    def _push(self, lease: Lease) -> None:
        heapq.heappush(self._heap, (lease.deadline, lease.id))
        if len(self._heap) > 4 * len(self._leases) + 64:
            # Gone leases' and replaced grants' entries: drop them all at once.
            self._heap = [(le.deadline, le.id) for le in self._leases.values()]
            heapq.heapify(self._heap)
