"""Every exception Clone raises on purpose.

One root, :class:`CloneError`, so an application can catch everything Clone
means to raise with a single ``except``.  API misuse still raises the built-in
``ValueError``/``TypeError``.
"""

from __future__ import annotations

__all__ = [
    "CloneError",
    "ConfigError",
    "ConfirmTimeout",
    "LimitExceeded",
    "NotSynced",
    "ProtocolError",
    "ClosedError",
    "ServerStartError",
    "IllegalTransitionError",
    "StoreFull",
    "StorageError",
    "DataDirLocked",
    "DataDirBehind",
    "DataDirCorrupt",
    "DataDirIncompatible",
    "DataDirTooBig",
    "SecurityError",
    "WriteRefused",
    "NotOwner",
    "LeaseQuotaExceeded",
    "refusal",
    "SplitConflict",
    "HistoryCompacted",
    "Conflict",
    "LeaseLost",
    "NotActive",
    "AgentTimeout",
    "NotJSON",
]


class CloneError(Exception):
    """Root of every Clone exception."""


class ConfigError(CloneError, ValueError):
    """A setting from a config file or the environment is unknown or invalid.

    The message names the file and key, or the variable, as a flag's error names
    the flag; the commands turn it into a usage error (exit 2).
    """


class ProtocolError(CloneError):
    """A message on the wire does not follow CHP as we implement it.

    The message says what was wrong so that the log line is actionable; the
    caller adds who sent it.
    """


class LimitExceeded(ProtocolError):
    """A key, value or properties frame is larger than the documented limit."""


class StoreFull(LimitExceeded):
    """The store is at its ``--max-keys`` or ``--max-bytes`` limit: the write is refused."""


class ConfirmTimeout(CloneError, TimeoutError):
    """A confirmed write was not republished by the active server in time."""


class NotSynced(CloneError, TimeoutError):
    """The client could not complete a snapshot from any server in time."""


class AgentTimeout(CloneError, TimeoutError):
    """The client's own agent thread did not take or answer a command in time
    (it is stuck, or the process is starved): a wait like every other, so a
    ``TimeoutError`` too."""


class NotJSON(CloneError, ValueError):
    """A value given to ``set_json`` is not JSON-serialisable, or one read by
    ``get_json`` is not a JSON document."""


class ClosedError(CloneError):
    """The client or server was used after ``close()``."""


class ServerStartError(CloneError):
    """The server could not start (a port in use, a bad endpoint)."""


class IllegalTransitionError(CloneError, RuntimeError):
    """A state machine's table has no rule for a (state, event) pair: a bug in
    its caller, never caused by what a peer sends.

    One spelling for every table of ours (the server core's sync, the client
    agent's; ``bstar`` has its own of the same name, as it imports nothing of
    clone).  Also a ``RuntimeError``, as the server's was before it joined the
    ``CloneError`` family, so that code catching that keeps working.
    """


class StorageError(CloneError):
    """The data directory cannot be used: the message says which and what to do.

    A server that meets one at start exits non-zero with the message; it never
    starts empty in place of a state it could not read.
    """


class StorageBusy(StorageError):
    """A write found the database locked by another connection (SQLITE_BUSY)
    for longer than its busy timeout; nothing was written, and it may be tried
    again."""


class DataDirLocked(StorageError):
    """Another server process holds this data directory (its lock file is taken)."""


class DataDirCorrupt(StorageError):
    """The database in the data directory is unreadable, truncated or not a database."""


class DataDirTooBig(StorageError):
    """The data directory holds more than the store's ``--max-bytes`` budget: loading it
    would break the budget (and, in a memory-limited container, be killed)."""


class DataDirBehind(StorageError):
    """The database holds an older position than the data directory had committed
    (clone.storage.mark): committed updates are missing, so it is not served."""


class DataDirIncompatible(StorageError):
    """The data directory was written by another format version, or is not Clone's."""


class SecurityError(CloneError):
    """A certificate, the clients directory or the ACL cannot be used as given.

    The message names the file (and the table and key for the ACL) and says what
    to do.  Security fails closed: a server that meets one at start refuses to
    start, and on a reload it keeps what it had; it never falls back to
    admitting everyone.
    """


_REFUSAL_ADVICE = {
    "acl": "the server's ACL does not let this client write {key}; ask the operator "
    "for write access to a prefix of it",
    "full": "the server's store is full (its --max-keys or --max-bytes limit); delete "
    "keys you no longer need, or ask the operator to raise the limit",
    "size": "the write to {key} is larger than the server accepts; write a smaller value",
    # A relay's own refusals (docs/operations.md, "Relays"): nothing was forwarded.
    "stale": "the relay has lost the pair it relays (it is stale): the write to {key} was "
    "not forwarded and never will be; write again once the relay has the pair back, or "
    "write to the pair",
    "overloaded": "the relay's queue to the pair was full: the write to {key} was not "
    "forwarded and never will be; write again, more slowly",
    # Refusals of calls (compare-and-set, leases: docs/protocol.md, "CALL? / REPLY").
    "reserved": "{key} is under /_clone/lease/, where the servers keep their leases; "
    "clients may read those keys but never write them: write elsewhere",
    "busy": "the server holds as many leases as it allows (its --max-leases); revoke "
    "leases you no longer need, or ask the operator to raise the limit",
    "unknown-lease": "the lease bound to the write to {key} is gone from the servers "
    "(expired or revoked); take a new lease and write again",
    "bad-if-sequence": "the server did not accept the if_sequence of the write to {key}; "
    "pass a sequence read from an entry (0: only if the key is absent)",
    "bad-lease": "the server did not accept the lease of the write to {key}; pass a Lease "
    "or the 32-hex-digit id of one",
    "bad-ttl": "the server did not accept the lease's ttl ({key}); use 0.3 s to one year",
    "not-owner": "the lease of {key} is another client's, or predates lease ownership:"
    " only the client that took a lease may keep it alive, revoke it or bind keys to it;"
    " take a lease of your own",
    "lease-quota": "this client holds as many leases as the server allows one client (its"
    " --max-leases-per-client); revoke leases you no longer need ({key})",
    "bad-secret": "the server did not accept the lease secret sent for {key}: this client"
    " and the server may be of incompatible versions",
    "malformed": "the server could not decode the call for {key}: this client and the "
    "server may be of incompatible versions; upgrade the older one",
}


class WriteRefused(CloneError):
    """The server refused a confirmed write or a call and said so.

    ``reason`` is the server's (``acl``, ``full`` or ``size`` in a refusal
    notice, and from a relay ``stale`` or ``overloaded``; a call's reply may
    also say ``reserved``, ``busy``, ``bad-lease`` and the like:
    docs/protocol.md; another from a newer server) and ``key`` the key written
    (for a lease grant that names the key it is for, that key; for another
    lease operation, the lease's own key under ``/_clone/lease/``).
    Raised at once instead of a timeout: this write will never be applied.
    Resending it as it is is useless, but for a relay's ``stale`` and
    ``overloaded``, which say only that it could not be forwarded *now*.
    """

    def __init__(self, reason: str, key: str) -> None:
        self.reason = reason
        self.key = key
        advice = _REFUSAL_ADVICE.get(reason)
        if advice is None:
            text = f"the server refused the write to {key!r} (reason {reason!r})"
        else:
            text = advice.format(key=repr(key))
        super().__init__(text)

    def __reduce__(self) -> tuple[type[WriteRefused], tuple[str, str]]:
        return (type(self), (self.reason, self.key))


class NotOwner(WriteRefused):
    """A lease call refused ``not-owner``: the lease is another client's (or
    was granted before the servers recorded owners), so this client may not
    keep it alive, revoke it or bind keys to it (docs/client.md, "Leases")."""


class LeaseQuotaExceeded(WriteRefused):
    """A lease grant refused ``lease-quota``: this client already holds the
    server's ``--max-leases-per-client`` leases."""


def refusal(reason: str, key: str) -> WriteRefused:
    """The :class:`WriteRefused` (or its typed subclass) for a server's ``reason``."""
    cls = _REFUSAL_TYPES.get(reason, WriteRefused)
    return cls(reason, key)


_REFUSAL_TYPES: dict[str, type[WriteRefused]] = {
    "not-owner": NotOwner,
    "lease-quota": LeaseQuotaExceeded,
}


class SplitConflict(WriteRefused):
    """A write this client was told was applied became a split-brain conflict.

    During a split brain the server this client wrote to (on its side of a
    partition) confirmed it; when the pair healed, that server stepped down and
    the winner did not apply it, because it had changed ``key`` since (or the
    write's condition or lease no longer held): docs/failover.md, "Writes of a
    split brain".  The winner keeps it (``clone conflicts`` lists it, an
    operator may apply it); the application may retry or alert.  Raised for a
    write still waited on, and handed to every ``Clone.on_conflict`` callback.
    ``uuid`` is the write's id (bytes).
    """

    def __init__(self, key: str, uuid: bytes = b"") -> None:
        self.reason = "conflict"
        self.key = key
        self.uuid = uuid
        CloneError.__init__(
            self,
            f"the write to {key!r} was confirmed during a split brain but the pair kept"
            " the other side's value; it is listed by `clone conflicts`",
        )

    def __reduce__(self) -> tuple[type[WriteRefused], tuple[str, str]]:
        return (type(self), (self.key, self.uuid))  # type: ignore[return-value]


class HistoryCompacted(CloneError):
    """The server's update history no longer reaches back to the sequence asked for.

    Raised by ``changes(since=N)`` and ``clone watch --since N``: ``requested``
    is N, ``oldest`` the oldest sequence the history still holds (the changes
    from ``oldest`` on can be replayed; those from N+1 to ``oldest - 1`` cannot).
    """

    def __init__(self, requested: int, oldest: int) -> None:
        self.requested = requested
        self.oldest = oldest
        super().__init__(
            f"cannot replay the changes after sequence {requested}: the server's history "
            f"starts at sequence {oldest}; ask for a later sequence (since={oldest - 1} or "
            f"more) or take a snapshot (clone dump)"
        )

    def __reduce__(self) -> tuple[type[HistoryCompacted], tuple[int, int]]:
        return (type(self), (self.requested, self.oldest))


class Conflict(CloneError):
    """A compare-and-set found the key changed: nothing was written.

    ``key`` is the key, ``expected`` the ``if_sequence`` asked for and
    ``current`` the key's sequence on the active server when it refused (0: the
    key is absent).  Read the key again and decide anew.
    """

    def __init__(self, key: str, expected: int, current: int) -> None:
        self.key = key
        self.expected = expected
        self.current = current
        now = "absent" if current == 0 else f"at sequence {current}"
        wanted = "absent" if expected == 0 else f"at sequence {expected}"
        super().__init__(
            f"{key!r} is {now}, not {wanted}: someone else wrote it since you read it;"
            " read it again and retry"
        )

    def __reduce__(self) -> tuple[type[Conflict], tuple[str, int, int]]:
        return (type(self), (self.key, self.expected, self.current))


class LeaseLost(CloneError):
    """A lease no longer exists on the servers: it expired (its keepalives did
    not arrive within its ttl), was revoked, or was never granted.  Its keys are
    gone; take a new lease and register again."""

    def __init__(self, lease_id: str, why: str = "") -> None:
        self.lease_id = lease_id
        self.why = why
        super().__init__(
            f"lease {lease_id} is gone from the servers{': ' + why if why else ''};"
            " its keys were deleted; take a new lease and write them again"
        )

    def __reduce__(self) -> tuple[type[LeaseLost], tuple[str, str]]:
        return (type(self), (self.lease_id, self.why))


class NotActive(CloneError, TimeoutError):
    """No active server answered a call (a compare-and-set or lease operation)
    in time: both servers are down, passive, or unreachable.

    Like any timeout, the outcome is unknown: a call whose reply was lost may
    have been applied.  Read the key (a compare-and-set retried with the same
    ``if_sequence`` then gets a :class:`Conflict` if the first one won)."""
