"""A lease as the application holds it: :class:`Lease`, from :meth:`clone.Clone.lease`.

How this works: a lease lives on the servers (docs/protocol.md, "CALL? /
REPLY"): keys written with ``lease=`` are deleted when it ends, by a revoke or
because nobody kept it alive for its ttl.  The client's agent thread keeps it
alive (a keepalive every ttl / 3, to whichever server is active, across
failovers: :mod:`clone.client.calls`); this object only holds what the
application sees: the id, whether the lease is still ours, and who to tell
when it is not.  Only a server says a lease is gone (a keepalive refused);
the client never guesses it from silence, since a server that becomes active
gives every lease a full ttl.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

__all__ = ["Lease", "LeaseOwner"]

log = logging.getLogger(__name__)


class LeaseOwner(Protocol):
    """The side of a client a :class:`Lease` needs (:class:`clone.Clone`)."""

    def _revoke_lease(self, lease: Lease, timeout: float | None) -> None: ...

    def _run_soon(self, fn: Callable[[], None]) -> None: ...


class Lease:
    """A lease granted by the active server and kept alive by its client.

    ``id`` names it (32 hex digits: write keys with ``client.set(key, value,
    lease=lease)``), ``ttl`` is how long the servers keep it without a
    keepalive.  ``alive`` is True until it is revoked or lost.  Leaving a
    ``with`` block revokes it, so its keys are deleted at once.  Thread-safe.
    """

    def __init__(self, owner: LeaseOwner, lease_id: str, ttl: float, secret: str = "") -> None:
        self._owner = owner
        self.id = lease_id
        self.ttl = ttl
        # The proof of ownership the servers asked for without CURVE
        # (docs/client.md, "Leases"): sent with every call on the lease,
        # never shown (the id is public, this is not).
        self._secret = secret
        self._lock = threading.Lock()
        self._ended = threading.Event()  # revoked or lost
        self._lost = False
        self._why = ""
        self._callbacks: list[Callable[[Lease], None]] = []
        # time.monotonic() until which the servers are known to hold it.
        self._valid_until = 0.0

    def __repr__(self) -> str:
        state = "alive" if self.alive else ("lost" if self._lost else "revoked")
        return f"<Lease {self.id} ttl={self.ttl:g} {state}>"

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.revoke()

    @property
    def alive(self) -> bool:
        """Neither revoked nor lost (as far as the servers have told us)."""
        return not self._ended.is_set()

    @property
    def valid_until(self) -> float:
        """Until when (``time.monotonic()``) the servers are known to hold the
        lease: when the last answered keepalive (or the grant) was sent, plus
        the ttl.  A server counts the ttl from when it received it, later."""
        return self._valid_until

    @property
    def valid(self) -> bool:
        """Alive, and known to be held by the servers now.

        False once no keepalive sent within the last ttl was answered (a client
        cut off from every server), even before a server says the lease is
        gone: by then it may have expired there, and another client may have
        the lock it stood for.  What a lock holder should check before acting.
        """
        return self.alive and time.monotonic() < self._valid_until

    @property
    def lost(self) -> bool:
        """A server said the lease is gone (expired, or revoked by someone else)."""
        return self._lost

    @property
    def why(self) -> str:
        """Why it was lost, as the server said (empty while alive or if revoked)."""
        return self._why

    def revoke(self, timeout: float | None = None) -> None:
        """End the lease now: the servers delete its keys, then the lease.

        Stops the keepalives first, so even if no active server answers in
        ``timeout`` (:class:`~clone.errors.NotActive`) the lease ends by itself
        within its ttl.  A lease the servers no longer know counts as revoked.
        Revoking a lease that is not alive does nothing.
        """
        with self._lock:
            if self._ended.is_set():
                return
            self._ended.set()
        self._owner._revoke_lease(self, timeout)

    def on_lost(self, callback: Callable[[Lease], None]) -> None:
        """Call ``callback(lease)`` once if the servers say the lease is gone.

        It runs in the client's callback thread (as ``on_change`` callbacks do),
        never in the agent; at once (in that thread) if the lease is lost
        already.  Not called for a revoke by this client.  Exceptions are
        logged and swallowed.
        """
        if not callable(callback):
            raise TypeError("callback must be callable")
        with self._lock:
            if not self._lost:
                self._callbacks.append(callback)
                return
        self._owner._run_soon(functools.partial(_call, callback, self))

    def wait_lost(self, timeout: float | None = None) -> bool:
        """Block until the lease is no longer alive (lost, or revoked), at most
        ``timeout`` seconds (None: no limit); True if it ended."""
        return self._ended.wait(timeout)

    # ------------------------------------------------------------------
    # From the client

    def _mark_lost(self, why: str) -> None:
        """The servers say it is gone: end it and run the callbacks (once)."""
        with self._lock:
            if self._lost or self._ended.is_set():
                return
            self._lost = True
            self._why = why
            self._ended.set()
            callbacks, self._callbacks = self._callbacks, []
        log.info("lease %s lost: %s", self.id, why)
        for callback in callbacks:
            self._owner._run_soon(functools.partial(_call, callback, self))

    def _kept_until(self, valid_until: float) -> None:
        """A keepalive was answered (the agent's bound, in time.monotonic())."""
        with self._lock:
            if valid_until > self._valid_until:
                self._valid_until = valid_until

    def _mark_ended(self) -> None:
        """The client let it go (closing): no callbacks."""
        with self._lock:
            self._ended.set()


def _call(callback: Callable[[Lease], None], lease: Lease) -> None:
    try:
        callback(lease)
    except Exception:
        log.exception("on_lost callback %r failed for lease %s", callback, lease.id)
