"""Every exception Clone raises on purpose.

One root, :class:`CloneError`, so an application can catch everything Clone
means to raise with a single ``except``.  API misuse still raises the built-in
``ValueError``/``TypeError``.
"""

from __future__ import annotations

__all__ = [
    "CloneError",
    "ConfirmTimeout",
    "LimitExceeded",
    "NotSynced",
    "ProtocolError",
    "ClosedError",
    "IllegalSyncTransition",
    "ServerStartError",
    "IllegalTransition",
    "StorageError",
    "DataDirLocked",
    "DataDirCorrupt",
    "DataDirIncompatible",
    "SecurityError",
]


class CloneError(Exception):
    """Root of every Clone exception."""


class ProtocolError(CloneError):
    """A message on the wire does not follow CHP as we implement it.

    The message says what was wrong so that the log line is actionable; the
    caller adds who sent it.
    """


class LimitExceeded(ProtocolError):
    """A key, value or properties frame is larger than the documented limit."""


class ConfirmTimeout(CloneError, TimeoutError):
    """A confirmed write was not republished by the active server in time."""


class NotSynced(CloneError, TimeoutError):
    """The client could not complete a snapshot from any server in time."""


class ClosedError(CloneError):
    """The client or server was used after ``close()``."""


class ServerStartError(CloneError):
    """The server could not start (a port in use, a bad endpoint)."""


class IllegalSyncTransition(CloneError, RuntimeError):
    """A sync event that the server core's table has no rule for: a bug in the caller.

    Also a ``RuntimeError``, as it was before it joined the ``CloneError`` family,
    so that code catching that keeps working.
    """


class IllegalTransition(CloneError):
    """The client agent's table has no rule for a (state, event) pair: a bug in
    the agent, never caused by what a server sends."""


class StorageError(CloneError):
    """The data directory cannot be used: the message says which and what to do.

    A server that meets one at start exits non-zero with the message; it never
    starts empty in place of a state it could not read.
    """


class DataDirLocked(StorageError):
    """Another server process holds this data directory (its lock file is taken)."""


class DataDirCorrupt(StorageError):
    """The database in the data directory is unreadable, truncated or not a database."""


class DataDirIncompatible(StorageError):
    """The data directory was written by another format version, or is not Clone's."""


class SecurityError(CloneError):
    """A certificate, the clients directory or the ACL cannot be used as given.

    The message names the file (and the table and key for the ACL) and says what
    to do.  Security fails closed: a server that meets one at start refuses to
    start, and on a reload it keeps what it had; it never falls back to
    admitting everyone.
    """
