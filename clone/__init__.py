"""Clone: a clustered key-value state replication service over ZeroMQ.

The client API lives here; the server is started with ``clone-server`` and is not
imported by ``import clone``.
"""

from typing import TYPE_CHECKING, Any

# Imported when first used (PEP 562), not here: the `clone` command imports
# clone.client.cli, and `clone --help` should not pay for zmq and the agent.
if TYPE_CHECKING:
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
        WriteRefused,
    )

_FROM_FRONTEND = frozenset({"Clone", "Entry", "Lease", "Status", "clone_get", "clone_set"})


def __getattr__(name: str) -> Any:
    if name in _FROM_FRONTEND:
        from clone.client import frontend

        return getattr(frontend, name)
    if name == "errors" or name in __all__:
        from clone import errors

        return errors if name == "errors" else getattr(errors, name)
    raise AttributeError(f"module 'clone' has no attribute {name!r}")


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
    "Status",
    "WriteRefused",
    "clone_get",
    "clone_set",
    "errors",
]
