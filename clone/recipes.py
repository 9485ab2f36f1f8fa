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

__all__ = ["Election", "Lock", "Registration"]

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


#: How long a recipe that lost its lease waits between tries to rejoin, at first
#: and at most (doubling): the servers may be unreachable for a while.
_REJOIN_FIRST = 0.1
_REJOIN_MAX = 2.0


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
        #: Called with the reason when the lease of our current key is lost.
        self.on_lost: Callable[[str], None] | None = None

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
        lease.on_lost(self._lease_lost)

    def _lease_lost(self, lease: Lease) -> None:
        if lease is self.lease and self.on_lost is not None:
            self.on_lost(lease.why or "lost")

    def rejoin(self, value: bytes, stop: threading.Event, what: str) -> bool:
        """After a lost lease: leave, then enter again with a fresh lease (a
        fresh key, so a fresh fencing token), trying until it works or
        ``stop`` is set; True if we are back in the queue."""
        wait = _REJOIN_FIRST
        while not stop.is_set():
            self.leave()
            try:
                self.enter(value)
            except ClosedError:
                return False
            except Exception as exc:  # servers unreachable for now: try again
                log.info("%s: could not rejoin yet (%s); trying again in %.1f s", what, exc, wait)
                stop.wait(wait)
                wait = min(2 * wait, _REJOIN_MAX)
                continue
            if stop.is_set():  # released or resigned while we rejoined
                self.leave()
                return False
            log.info("%s: rejoined after a lost lease, token %d", what, self.sequence)
            return True
        return False

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

    ``on_lost(reason)`` runs (in the client's callback thread) when the servers
    say the lease of a held lock is gone (a freeze or a cut longer than the
    ttl).  With ``reacquire`` (the default, unless a ``lease`` was given) the
    lock then queues again in the background, with a fresh lease and so a
    fresh :attr:`token`; :attr:`held` turns true again when it is ours.
    """

    def __init__(
        self,
        client: Clone,
        name: str,
        *,
        ttl: float = 5.0,
        lease: Lease | None = None,
        on_lost: Callable[[str], None] | None = None,
        reacquire: bool = True,
    ) -> None:
        self._me = _Contender(client, name, ttl, lease)
        self._acquired = False
        self._on_lost = on_lost
        self._reacquire = reacquire and lease is None
        self._stop = threading.Event()
        self._me.on_lost = self._lost

    def _lost(self, why: str) -> None:
        if not self._acquired:
            return  # lost while waiting: acquire() raises LeaseLost
        log.warning("lock %r lost: %s", self.name, why)
        if self._on_lost is not None:
            try:
                self._on_lost(why)
            except Exception:
                log.exception("lock %r: on_lost callback failed", self.name)
        if self._reacquire and not self._stop.is_set():
            threading.Thread(
                target=self._again, name=f"clone-lock-{self.name}", daemon=True
            ).start()

    def _again(self) -> None:
        self._acquired = False
        if self._me.rejoin(_holder().encode(), self._stop, f"lock {self.name!r}"):
            try:
                self._wait_first(None)
            except Exception as exc:
                log.warning("lock %r: could not take it again: %s", self.name, exc)

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
        self._stop.clear()
        # The value says who waits or holds: shown by `clone dump NAME/`.
        self._me.enter(_holder().encode())
        return self._wait_first(timeout)

    def _wait_first(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        me = self._me
        try:
            while not self._stop.is_set():
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
            return False
        except BaseException:
            if not self._acquired:
                me.leave()
            raise

    def release(self) -> None:
        """Let the next waiter in (and stop taking the lock again)."""
        self._stop.set()
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

    ``on_lost(reason)`` runs (in the client's callback thread) when the servers
    say our campaign's lease is gone (a freeze or a cut longer than the ttl):
    we no longer lead.  With ``rejoin`` (the default, unless a ``lease`` was
    given) the candidate then stands again, at the back of the queue, with a
    fresh lease and so a fresh :attr:`token`.
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
        on_lost: Callable[[str], None] | None = None,
        rejoin: bool = True,
    ) -> None:
        if not isinstance(candidate, str) or not candidate:
            raise ValueError("a candidate is a non-empty name (what others see as the leader)")
        self._me = _Contender(client, name, ttl, lease)
        self.candidate = candidate
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last: str | None = None
        self._on_lost = on_lost
        self._rejoin = rejoin and lease is None
        self._resigned = threading.Event()
        self._me.on_lost = self._lost

    def _lost(self, why: str) -> None:
        log.warning("election %r: our campaign's lease is lost: %s", self.name, why)
        if self._on_lost is not None:
            try:
                self._on_lost(why)
            except Exception:
                log.exception("election %r: on_lost callback failed", self.name)
        if self._rejoin and not self._resigned.is_set():
            threading.Thread(
                target=self._me.rejoin,
                args=(self.candidate.encode("utf-8"), self._resigned, f"election {self.name!r}"),
                name=f"clone-election-rejoin-{self.name}",
                daemon=True,
            ).start()

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
        if self._me.key is not None and self._me.alive():
            raise RuntimeError(f"already campaigning in {self.name!r}")
        self._resigned.clear()
        self._me.leave()  # a campaign whose lease was lost: start afresh
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
        """Step down (or leave the queue, and stop rejoining); the next candidate leads."""
        self._resigned.set()
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


class Registration:
    """A service's key, bound to a lease, that comes back after a lost lease.

    ::

        with Registration(client, "/services/api/node-7", b"10.0.0.7:8080", ttl=5):
            serve()

    The key is written (confirmed) when it is created; it is deleted when the
    process dies (its lease runs out), when :meth:`close` revokes it, or when
    the servers say the lease is lost (a freeze or a cut longer than the ttl).
    Then ``on_lost(reason)`` runs (in the client's callback thread) and, with
    ``reregister`` (the default), the key is written again under a fresh
    lease, trying until the servers answer.
    """

    def __init__(
        self,
        client: Clone,
        key: str,
        value: bytes | str,
        ttl: float = 5.0,
        *,
        on_lost: Callable[[str], None] | None = None,
        reregister: bool = True,
    ) -> None:
        self.client = client
        self.key = key
        self.value = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        self.ttl = ttl
        self._on_lost = on_lost
        self._reregister = reregister
        self._closed = threading.Event()
        self.lease: Lease | None = None
        self.sequence = 0
        self._register()

    @property
    def alive(self) -> bool:
        """Registered now (as far as the servers have said)."""
        return self.lease is not None and self.lease.alive

    def _register(self) -> None:
        lease = self.client.lease(self.ttl, for_key=self.key)
        try:
            self.sequence = self.client.set(self.key, self.value, lease=lease)
        except BaseException:
            _Contender._revoke_quietly(lease)
            raise
        self.lease = lease
        lease.on_lost(self._lost)

    def _lost(self, lease: Lease) -> None:
        if lease is not self.lease or self._closed.is_set():
            return
        why = lease.why or "lost"
        log.warning("registration %r lost: %s", self.key, why)
        if self._on_lost is not None:
            try:
                self._on_lost(why)
            except Exception:
                log.exception("registration %r: on_lost callback failed", self.key)
        if self._reregister:
            threading.Thread(
                target=self._again, name=f"clone-registration-{self.key}", daemon=True
            ).start()

    def _again(self) -> None:
        wait = _REJOIN_FIRST
        while not self._closed.is_set():
            try:
                self._register()
            except ClosedError:
                return
            except Exception as exc:
                log.info("registration %r: not yet (%s); again in %.1f s", self.key, exc, wait)
                self._closed.wait(wait)
                wait = min(2 * wait, _REJOIN_MAX)
                continue
            log.info("registration %r: registered again", self.key)
            return

    def close(self) -> None:
        """Revoke the lease (the key goes with it) and stop re-registering."""
        self._closed.set()
        lease, self.lease = self.lease, None
        if lease is not None:
            _Contender._revoke_quietly(lease)

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
