"""Clone: a clustered key-value state replication service over ZeroMQ.

The client API lives here; the server is started with ``clone-server`` and is not
imported by ``import clone``.
"""

from clone import errors
from clone.client.frontend import Clone, Entry, Lease, Status, clone_get, clone_set
from clone.errors import (
    CloneError,
    ClosedError,
    ConfirmTimeout,
    Conflict,
    HistoryCompacted,
    LeaseLost,
    LeaseQuotaExceeded,
    NotActive,
    NotOwner,
    NotSynced,
    SplitConflict,
    WriteRefused,
)

__all__ = [
    "Clone",
    "CloneError",
    "ClosedError",
    "ConfirmTimeout",
    "Conflict",
    "Entry",
    "HistoryCompacted",
    "Lease",
    "LeaseLost",
    "LeaseQuotaExceeded",
    "NotActive",
    "NotOwner",
    "NotSynced",
    "SplitConflict",
    "Status",
    "WriteRefused",
    "clone_get",
    "clone_set",
    "errors",
]
