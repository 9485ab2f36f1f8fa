"""Clone: a clustered key-value state replication service over ZeroMQ.

The client API lives here; the server is started with ``clone-server`` and is not
imported by ``import clone``.
"""

import importlib
import logging
from typing import TYPE_CHECKING, Any

# Imported when first used (PEP 562), not here: the `clone` command imports
# clone.client.cli, and `clone --help` should not pay for zmq and the agent.
if TYPE_CHECKING:
    from clone import errors
    from clone.client.frontend import (
        Clone,
        CloseReport,
        Entry,
        Freshness,
        Lease,
        Status,
        Subscription,
        clone_get,
        clone_set,
    )
    from clone.errors import (
        AgentTimeout,
        CloneError,
        ClosedError,
        ConfirmTimeout,
        Conflict,
        HistoryCompacted,
        LeaseLost,
        LeaseQuotaExceeded,
        NotActive,
        NotJSON,
        NotOwner,
        NotSynced,
        SplitConflict,
        WriteRefused,
    )

# A library does not choose where its log goes: without this, Python's
# last-resort handler would print our warnings on the application's stderr.
logging.getLogger("clone").addHandler(logging.NullHandler())

__all__ = [
    "AgentTimeout",
    "Clone",
    "CloseReport",
    "CloneError",
    "ClosedError",
    "ConfirmTimeout",
    "Conflict",
    "Entry",
    "Freshness",
    "HistoryCompacted",
    "Lease",
    "LeaseLost",
    "LeaseQuotaExceeded",
    "NotActive",
    "NotJSON",
    "NotOwner",
    "NotSynced",
    "SplitConflict",
    "Status",
    "Subscription",
    "WriteRefused",
    "clone_get",
    "clone_set",
    "errors",
]

_FROM_FRONTEND = frozenset(
    {
        "Clone",
        "CloseReport",
        "Entry",
        "Freshness",
        "Lease",
        "Status",
        "Subscription",
        "clone_get",
        "clone_set",
    }
)


def __getattr__(name: str) -> Any:
    if name in _FROM_FRONTEND:
        from clone.client import frontend

        return getattr(frontend, name)
    if name == "errors" or name in __all__:
        # import_module, not "from clone import errors": that form asks this
        # module for the attribute first and, before the submodule is loaded,
        # lands back here (a RecursionError on "from clone import NotJSON").
        errors = importlib.import_module("clone.errors")
        return errors if name == "errors" else getattr(errors, name)
    raise AttributeError(f"module 'clone' has no attribute {name!r}")
