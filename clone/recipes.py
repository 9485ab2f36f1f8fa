"""Locks and leader election on top of leases and compare-and-set.

How this works (the recipe etcd, Consul and ZooKeeper users know): every
contender writes its own key under the recipe's name, bound to a lease, with
``if_sequence=0`` (create only).  The server gives each write the next
sequence, so the keys line up in arrival order; the contender whose key has the
lowest sequence holds the lock (or leads).  A contender that dies stops its
keepalives, its lease runs out and the server deletes its key, which lets the
next one in: nobody has to notice the death but the server.

Why the order is safe to read from a replica: a client's replica is always a
prefix of the server's history.  Once it holds our own key (sequence S), it
holds every update up to S, so every contender ahead of us that still exists is
in it; and nobody can get ahead of us later, since new keys get sequences above
S.  So "no key under the name with a sequence below S" read locally means we
are first on the server too.

A client that may write under the name but not read it (a write-only ACL
prefix) never sees the queue: once its key has been missing from its replica
for :data:`_ASK_AFTER`, a :class:`Lock` asks the active server instead, every
:data:`_ASK_EVERY`, how many contenders are ahead of it (an ``ahead`` call:
the same rule, counted by the server, which shows it no key or value).  A
reader whose replica has its key never asks.  :class:`Election` still needs
to read the name: a leader is a value.

The client must see the keys under the name (its subtrees must cover it), and
the name is a key prefix: writing under it needs write access there (under an
ACL, a name outside the caller's write prefixes fails with
:class:`~clone.errors.WriteRefused`, reason ``acl``).  A holder whose lease is
lost (a network cut longer than the ttl) no longer holds the lock even if it
has not been told yet: :attr:`Lock.held` turns false as soon as no keepalive
sent within the last ttl was answered (:attr:`~clone.client.leases.Lease.valid`),
:meth:`Lock.check` raises, and long critical sections should look at it.

Fencing tokens: no lease-based lock can stop a holder that was frozen (a
pause, a SIGSTOP, a cut) from running on after its lease ran out and another
took the lock.  What a resource can do is refuse the stale one, given a number
that only grows from holder to holder: :attr:`Lock.token` (and
:attr:`Election.token`) is the sequence the servers gave the holder's key.  A
new holder's key is written after the keys ahead of it were gone, so its
sequence is higher, and sequences only grow, across failovers (a promoted
server continues from the highest sequence it saw, and re-sequences the writes
it holds for the old active after that) and restarts (a durable server keeps
its sequence).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING

from clone.errors import ClosedError, LeaseLost
from clone.wire.codec import new_uuid

if TYPE_CHECKING:
    from clone.client.frontend import Clone
    from clone.client.leases import Lease
    from clone.client.results import Entry

__all__ = ["Election", "Lock"]

log = logging.getLogger(__name__)

#: How often a waiter looks at its replica again.  The replica is local, so
#: this costs a command-pipe round trip, not network traffic.
_POLL = 0.02
#: A contender whose key is not in its replica this long after it was written
#: asks the server (it may be unable to read its lock's prefix), this often.
_ASK_AFTER = 0.1
_ASK_EVERY = 0.1


def _prefix(name: str) -> str:
    if not isinstance(name, str) or not name.strip("/"):
        raise ValueError(f"a lock or election name is a key path such as '/locks/db', not {name!r}")
    return name.rstrip("/") + "/"


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{threading.current_thread().name}"


def _queue(client: Clone, prefix: str) -> tuple[list[Entry], dict[str, Entry]]:
    entries = client.entries(prefix)
    entries.sort(key=lambda e: e.sequence)
    return entries, {e.key: e for e in entries}


class _Contender:
    """One key under a name, bound to a lease: the shared part of both recipes."""

    def __init__(self, client: Clone, name: str, ttl: float, lease: Lease | None) -> None:
        self.client = client
        self.name = name
        self.prefix = _prefix(name)
        self.ttl = ttl
        self._given_lease = lease
        self.lease: Lease | None = None
        self.key: str | None = None
        self.sequence = 0
        self._entered_at = 0.0
        self._asked_at = 0.0

    def enter(self, value: bytes) -> None:
        """Write our key at the back of the queue.

        The key is named before our own lease is asked for, and the grant
        names it: a name outside our write ACL is then refused before the
        server makes a lease, so a refused lock changes nothing there.
        """
        key = f"{self.prefix}{new_uuid().hex()}"
        lease = self._given_lease or self.client.lease(self.ttl, for_key=key)
        try:
            sequence = self.client.set(key, value, lease=lease, if_sequence=0)
        except BaseException:
            if self._given_lease is None:
                self._revoke_quietly(lease)
            raise
        assert sequence is not None
        self.lease, self.key, self.sequence = lease, key, sequence
        self._entered_at = self._asked_at = time.monotonic()

    def ahead(self) -> list[Entry] | None:
        """The contenders before us, or None while our replica lacks our key."""
        entries, by_key = _queue(self.client, self.prefix)
        if self.key not in by_key:
            return None
        return [e for e in entries if e.sequence < self.sequence]

    def first(self) -> bool:
        """Whether no contender is ahead of us: from our replica, or, when it
        has lacked our key for a while (we may not read the name), from the
        server; False while we do not know yet."""
        ahead = self.ahead()
        if ahead is not None:
            return ahead == []
        now = time.monotonic()
        if self.key is None or now - self._entered_at < _ASK_AFTER:
            return False
        if now - self._asked_at < _ASK_EVERY:
            return False
        self._asked_at = now
        return self.client._ahead(self.key) == 0

    def alive(self) -> bool:
        """Not lost or revoked (as far as the servers have said)."""
        return self.lease is not None and self.lease.alive

    def valid(self) -> bool:
        """Known to be held by the servers now (:attr:`Lease.valid`)."""
        return self.lease is not None and self.lease.valid

    def leave(self) -> None:
        """Take our key away (revoking our own lease deletes it too)."""
        lease, key = self.lease, self.key
        self.lease = self.key = None
        self.sequence = 0
        if lease is None or key is None:
            return
        if self._given_lease is None:
            self._revoke_quietly(lease)
        elif lease.alive:
            try:
                self.client.delete(key, wait=True)
            except ClosedError:
                pass

    @staticmethod
    def _revoke_quietly(lease: Lease) -> None:
        try:
            lease.revoke()
        except ClosedError:
            pass
        except Exception as exc:  # the lease runs out by itself anyway
            log.warning("could not revoke lease %s (it expires after its ttl): %s", lease.id, exc)


class Lock:
    """A mutual-exclusion lock, fair in arrival order, freed when its holder dies.

    ::

        with Lock(client, "/locks/db-migration", ttl=5):
            migrate()

    ``ttl``: the lease's time to live when the lock takes its own lease (the
    default): a holder that dies frees the lock at most ``ttl`` (plus a
    housekeeping turn) later.  ``lease``: hold it under this lease instead (it
    is not revoked on release; the key is deleted).
    """

    def __init__(
        self, client: Clone, name: str, *, ttl: float = 5.0, lease: Lease | None = None
    ) -> None:
        self._me = _Contender(client, name, ttl, lease)
        self._acquired = False

    @property
    def name(self) -> str:
        return self._me.name

    @property
    def token(self) -> int | None:
        """Our fencing token while we hold the lock (acquired, not yet released),
        else None: the sequence of our key, higher than any earlier holder's.
        Hand it to the resource with each request; the resource keeps the
        highest token it has seen and refuses a lower one (docs/client.md)."""
        return self._me.sequence if self._acquired and self._me.key is not None else None

    @property
    def held(self) -> bool:
        """Whether we hold it now: false once our lease is lost, or once no
        keepalive sent within its ttl was answered (cut off from the servers,
        we may have lost it there already)."""
        return self._me.key is not None and self._acquired and self._me.valid()

    def check(self) -> None:
        """Raise :class:`~clone.errors.LeaseLost` if we no longer hold the lock."""
        me = self._me
        if self._acquired and not me.valid():
            raise LeaseLost(me.lease.id if me.lease else "?", f"the lock {self.name!r} is lost")

    def acquire(self, timeout: float | None = None) -> bool:
        """Wait for the lock (at most ``timeout`` s; None: as long as it takes).

        False if the time ran out (we left the queue).  Raises LeaseLost if our
        lease was lost while we waited, WriteRefused if we may not write under
        the name, and whatever the client raises when no server answers.
        """
        if self._me.key is not None:
            raise RuntimeError(f"lock {self.name!r} is already held or being acquired here")
        deadline = None if timeout is None else time.monotonic() + timeout
        me = self._me
        # The value says who waits or holds: shown by `clone dump NAME/`.
        me.enter(_holder().encode())
        try:
            while True:
                if not me.alive():
                    lost = me.lease.id if me.lease else "?"
                    raise LeaseLost(lost, f"while waiting for the lock {self.name!r}")
                if me.first() and me.valid():
                    self._acquired = True
                    return True
                if deadline is not None and time.monotonic() >= deadline:
                    me.leave()
                    return False
                time.sleep(_POLL)
        except BaseException:
            if not self._acquired:
                me.leave()
            raise

    def release(self) -> None:
        """Let the next waiter in."""
        self._acquired = False
        self._me.leave()

    def __enter__(self) -> Lock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class Election:
    """Leader election: the candidate whose key came first leads.

    ::

        election = Election(client, "/elections/scheduler", "node-7",
                            on_change=lambda leader: print("leader:", leader))
        election.campaign()
        if election.wait_leader(timeout=30):
            run_scheduler()

    ``leader`` is the current leader's candidate name (None: nobody stands),
    ``is_leader`` whether it is us.  ``on_change(leader)`` runs in a watcher
    thread each time the leader changes (from our replica: every participant
    sees the same order).  A leader that dies is replaced at most ``ttl``
    later; one that wants to step down calls :meth:`resign`.
    """

    def __init__(
        self,
        client: Clone,
        name: str,
        candidate: str,
        *,
        ttl: float = 5.0,
        on_change: Callable[[str | None], None] | None = None,
        lease: Lease | None = None,
    ) -> None:
        if not isinstance(candidate, str) or not candidate:
            raise ValueError("a candidate is a non-empty name (what others see as the leader)")
        self._me = _Contender(client, name, ttl, lease)
        self.candidate = candidate
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: str | None = None

    @property
    def name(self) -> str:
        return self._me.name

    def _head(self) -> Entry | None:
        entries, _ = _queue(self._me.client, self._me.prefix)
        return entries[0] if entries else None

    @property
    def leader(self) -> str | None:
        head = self._head()
        if head is None or head.value is None:
            return None
        return head.value.decode("utf-8", "replace")

    @property
    def token(self) -> int | None:
        """Our fencing token while we campaign (None otherwise): the sequence of
        our key, fixed when we stood.  Keys lead in sequence order, so once we
        lead it is higher than every earlier leader's; use it as
        :attr:`Lock.token` is used, and only while :attr:`is_leader`."""
        return self._me.sequence if self._me.key is not None else None

    @property
    def is_leader(self) -> bool:
        me = self._me
        if me.key is None or not me.valid():
            return False
        return me.ahead() == []

    def campaign(self) -> None:
        """Stand: write our key at the back of the queue and start watching."""
        if self._me.key is not None:
            raise RuntimeError(f"already campaigning in {self.name!r}")
        self._me.enter(self.candidate.encode("utf-8"))
        self._start_watching()

    def watch(self) -> None:
        """Follow the leader (``on_change``) without standing."""
        self._start_watching()

    def wait_leader(self, timeout: float | None = None) -> bool:
        """Wait until we lead; False after ``timeout`` s (None: as long as it takes)."""
        if self._me.key is None:
            raise RuntimeError("campaign() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.is_leader:
                return True
            if not self._me.alive():
                lost = self._me.lease.id if self._me.lease else "?"
                raise LeaseLost(lost, f"while campaigning in {self.name!r}")
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(_POLL)

    def resign(self) -> None:
        """Step down (or leave the queue); the next candidate leads."""
        self._me.leave()

    def close(self) -> None:
        """Resign and stop watching."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        self.resign()

    def __enter__(self) -> Election:
        self.campaign()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start_watching(self) -> None:
        if self._thread is not None or self._on_change is None:
            return
        self._thread = threading.Thread(
            target=self._watch, name=f"clone-election-{self.name}", daemon=True
        )
        self._thread.start()

    def _watch(self) -> None:
        callback = self._on_change
        assert callback is not None
        first = True
        while not self._stop.wait(0 if first else _POLL * 2.5):
            first = False
            try:
                leader = self.leader
            except ClosedError:
                return
            except Exception as exc:
                log.warning("election %r: cannot read the candidates: %s", self.name, exc)
                continue
            if leader != self._last:
                self._last = leader
                try:
                    callback(leader)
                except Exception:
                    log.exception("election %r: on_change callback failed", self.name)
