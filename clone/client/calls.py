"""How the agent makes calls (CALL?/REPLY) and keeps leases alive.

How this works: a call (a compare-and-set, a write bound to a lease, a lease
operation: docs/protocol.md, "CALL? / REPLY") waits in a table keyed by its
uuid until a reply ends it or the caller's deadline passes.  It is sent to the
*current* server only (:class:`~clone.client.state.SendCall`, on that server's
call DEALER), and sent again, same uuid, every ``resend_interval`` and at once
when the current server changes (a failover) or a sync completes: the servers
deduplicate ``set`` and ``lease-grant`` by uuid, and a keepalive or a revoke
done twice changes nothing, so a retry is always safe.  A reply ``refused``
with reason ``not-active`` (a passive or starting server) keeps the call
waiting, to be sent again later, maybe to another server; any other reply,
from any server, ends it (:class:`~clone.client.state.CallReplied`).  At the
deadline the call is dropped without a word: the frontend, which holds the
same deadline, raises :class:`~clone.errors.NotActive`.

Leases: the frontend registers a granted lease (:meth:`Calls.keep_lease`); every
``ttl / 3`` we send a ``lease-keepalive`` with a fresh uuid and no waiter.
Holding more than one, we send one ``lease-keepalives`` call for every lease
due and every lease due within half an interval more (so that a client's
leases fall into step and travel together: one message per client, as etcd
keeps one keepalive stream per client); its reply names the leases not kept.
A server or relay that refuses the batched call (an older one answers
``malformed``) gets one call per lease from then on.  An
unanswered keepalive is resent like any call, and replaced by the next one when
that is due.  A keepalive refused for any reason but ``not-active``
(``unknown-lease``: it expired, or someone revoked it) means the lease cannot
be kept: we stop and say so (:class:`~clone.client.state.LeaseGone`).  Calling
``lease-revoke`` stops the keepalives of that lease at once.  We never decide
on our own that a lease is gone: a server that becomes active gives every lease
a full ttl (docs/protocol.md), so a lease outlives a failover longer than its
ttl, and only a server can say it ended.

Not table rows: like writes, calls are commands from the application and
resends are a timer, the same in every state.  A mixin over
:class:`~clone.client.state.AgentState`; sans-IO (``now`` is an argument; the
keepalives' uuids come from :attr:`Calls.new_call_id`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from clone.client.actions import (
    Action,
    CallReplied,
    LeaseGone,
    LeaseKept,
    SendCall,
)
from clone.client.state import (
    _NEVER,
    AgentState,
    _KeptLease,
    _PendingCall,
)
from clone.wire.calls import (
    LEASE_PROPERTY,
    MAX_KEEPALIVES_PER_CALL,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_KEEPALIVES,
    OP_LEASE_REVOKE,
    SECRET_PROPERTY,
    Call,
    Reply,
    encode_call,
    encode_keepalives,
    valid_lease_id,
    valid_secret,
)
from clone.wire.codec import new_uuid
from clone.wire.protocol import MAX_TTL_SECONDS

__all__ = ["Calls", "KEEPALIVES_PER_TTL"]

log = logging.getLogger(__name__)

#: Keepalives per ttl: a third of it apart, so two may be lost (or a failover
#: may take most of a third) before the lease is in danger.
KEEPALIVES_PER_TTL = 3

_NOT_ACTIVE = "not-active"


class Calls(AgentState):
    """Pending calls, their resends and replies; the keepalives of kept leases."""

    #: Where keepalives get their uuids (16 bytes, unique); tests may replace it.
    new_call_id: Callable[[], bytes] = staticmethod(new_uuid)

    # ----------------------------------------------------------------------
    # Inputs

    def call(self, call: Call, now: float, *, within: float) -> list[Action]:
        """Send ``call`` to the current server and wait ``within`` seconds for
        its reply, resending it meanwhile."""
        if not within > 0:
            raise ValueError(f"a call's deadline must be > 0 s, not {within}")
        if call.uuid in self._calls:
            raise ValueError("a call with this uuid is already waiting")
        if call.op == OP_LEASE_REVOKE and call.lease is not None:
            self._stop_keeping(call.lease)  # revoked or not, we let it go
        self.counters.calls += 1
        pending = _PendingCall(
            tuple(encode_call(call.op, call.uuid, call.key, call.properties, call.body)),
            now + within,
            _NEVER,
        )
        self._calls[call.uuid] = pending
        self._call_route = self._route()
        return self._send_call(pending, now)

    def replied(self, server: int, reply: Reply, now: float) -> list[Action]:
        """A REPLY from ``server`` (any server: an answer is an answer)."""
        pending = self._calls.get(reply.uuid)
        if pending is None:
            # A reply to a retry, or after the caller gave up: its first answer
            # was taken, or nobody is left to tell.
            self.counters.late_replies += 1
            return []
        if reply.status == "refused" and reply.reason == _NOT_ACTIVE:
            # A passive or starting server: ask again later, perhaps another.
            self.counters.calls_not_active += 1
            pending.next_send = now + self.config.resend_interval
            log.debug("%s answered a call not-active; will ask again", self.servers[server])
            return []
        del self._calls[reply.uuid]
        if pending.leases:
            return self._batch_reply(pending, reply, now)
        if pending.lease is None:
            if reply.ok and pending.frames[1] == b"set":
                key = pending.frames[3].decode("utf-8", "replace")
                self._remember_confirmed(reply.uuid, key)
                if self._behind(key, reply.sequence):
                    # Read your writes: a get() after the call returns must
                    # see it, as after set(wait=True).  The REPLY comes on its
                    # own socket, often before the KVPUB on the subscriber's.
                    release_at = now + max(0.0, pending.expires_at - now) / 2
                    self._replies_behind.append((reply.sequence, release_at, reply))
                    return []
            return [CallReplied(reply)]
        return self._kept_reply(pending.lease, reply)

    def keep_lease(self, lease_id: str, ttl: float, now: float, secret: str = "") -> list[Action]:
        """Keep ``lease_id`` alive: a keepalive every ``ttl / 3`` from now on,
        each with ``secret``, the lease's proof of ownership (if any)."""
        if not valid_lease_id(lease_id):
            raise ValueError(f"lease id {lease_id[:40]!r} is not 32 lowercase hex digits")
        if not 0 < ttl <= MAX_TTL_SECONDS:
            raise ValueError(f"lease ttl {ttl} is out of range")
        if secret and not valid_secret(secret):
            raise ValueError("a lease secret is 32 lowercase hex digits")
        self._leases[lease_id] = _KeptLease(ttl, now + ttl / KEEPALIVES_PER_TTL, secret=secret)
        return []

    @property
    def pending_calls(self) -> int:
        return len(self._calls)

    @property
    def kept_leases(self) -> tuple[str, ...]:
        return tuple(self._leases)

    # ----------------------------------------------------------------------
    # The timer (from tick)

    def _calls_due(self, now: float) -> list[Action]:
        """Keepalives due, calls past their deadline, resends due or owed to a
        new server or a completed sync."""
        due = [lid for lid, kept in self._leases.items() if now >= kept.next_keepalive]
        if due and self._batch_keepalives and len(self._leases) > 1:
            self._keepalive_batches(now)  # sent below, with the rest
        else:
            for lease_id in due:
                self._keepalive(lease_id, self._leases[lease_id], now)
        route = self._route()
        rerouted = route != self._call_route
        self._call_route = route
        actions: list[Action] = self._replies_caught_up(now) if self._replies_behind else []
        for uuid, pending in list(self._calls.items()):
            if now >= pending.expires_at:
                del self._calls[uuid]
                self.counters.calls_expired += 1
                log.debug("gave up on a call: no active server answered it in time")
            elif self.current is None:
                pending.next_send = _NEVER  # sent when a server is added
            elif rerouted or now >= pending.next_send:
                if pending.sends:
                    self.counters.calls_resent += 1
                actions.extend(self._send_call(pending, now))
        return actions

    # ----------------------------------------------------------------------
    # Helpers

    def _behind(self, key: str, sequence: int) -> bool:
        """Whether our replica will show the update at ``sequence`` of
        ``key`` but has not applied it yet.  A restricted client is confirmed
        by view heartbeats and a key outside our subtrees never reaches us."""
        return (
            self.view is None
            and sequence > self.last_sequence
            and self._subtree_of(key) is not None
        )

    def _route(self) -> tuple[int | None, int]:
        """Where calls go, and how many syncs completed there: a change of
        either sends every waiting call again at once."""
        return self.current, self.counters.syncs_full + self.counters.syncs_catchup

    def _send_call(self, pending: _PendingCall, now: float) -> list[Action]:
        if self.current is None:
            pending.next_send = _NEVER  # sent when a server is added
            return []
        pending.next_send = now + self.config.resend_interval
        pending.sends += 1
        return [SendCall(pending.frames, self.current)]

    def _keepalive(self, lease_id: str, kept: _KeptLease, now: float) -> None:
        """A fresh keepalive, due now, replacing one still unanswered."""
        if kept.inflight is not None:
            self._calls.pop(kept.inflight, None)
        uuid = self.new_call_id()
        kept.inflight = uuid
        kept.inflight_at = now
        kept.next_keepalive = now + kept.ttl / KEEPALIVES_PER_TTL
        self.counters.keepalives += 1
        props: tuple[tuple[str, str], ...] = ((LEASE_PROPERTY, lease_id),)
        if kept.secret:
            props += ((SECRET_PROPERTY, kept.secret),)
        frames = encode_call(OP_LEASE_KEEPALIVE, uuid, properties=props)
        self._calls[uuid] = _PendingCall(tuple(frames), _NEVER, now, lease=lease_id)

    def _keepalive_batches(self, now: float) -> None:
        """``lease-keepalives`` calls for the leases due and those due within
        half an interval more, replacing their unanswered keepalives."""
        group = [
            (lease_id, kept)
            for lease_id, kept in self._leases.items()
            if now >= kept.next_keepalive - kept.ttl / (2 * KEEPALIVES_PER_TTL)
        ]
        if len(group) == 1:
            self._keepalive(*group[0], now)
            return
        replaced = {kept.inflight for _, kept in group if kept.inflight is not None}
        for at in range(0, len(group), MAX_KEEPALIVES_PER_CALL):
            chunk = group[at:at + MAX_KEEPALIVES_PER_CALL]
            uuid = self.new_call_id()
            for _, kept in chunk:
                kept.inflight = uuid
                kept.inflight_at = now
                kept.next_keepalive = now + kept.ttl / KEEPALIVES_PER_TTL
            self.counters.keepalives += len(chunk)
            self.counters.keepalive_batches += 1
            body = encode_keepalives([(lease_id, kept.secret) for lease_id, kept in chunk])
            frames = encode_call(OP_LEASE_KEEPALIVES, uuid, body=body)
            self._calls[uuid] = _PendingCall(
                tuple(frames), _NEVER, now, leases=tuple(lid for lid, _ in chunk), made=now
            )
        # An older keepalive all of whose leases are in a new call is moot.
        still = {k.inflight for k in self._leases.values() if k.inflight is not None}
        for old in replaced - still:
            self._calls.pop(old, None)

    def _batch_reply(self, pending: _PendingCall, reply: Reply, now: float) -> list[Action]:
        """The answer to a ``lease-keepalives``: each lease kept, or gone with
        its reason; a refusal of the call itself means the server does not
        take batches (or judged the call as a whole): one call per lease."""
        actions: list[Action] = []
        if not reply.ok or reply.kept is None:
            self._batch_keepalives = False
            log.warning("a server refused a batched keepalive (%s); keeping each lease alive"
                        " with its own call from now on", reply.reason or reply.status)
            for lease_id in pending.leases:
                kept = self._leases.get(lease_id)
                if kept is not None and kept.inflight == reply.uuid:
                    kept.inflight = None
                    kept.next_keepalive = now  # at the next tick, one by one
            return actions
        gone = dict(reply.gone)
        for lease_id in pending.leases:
            kept = self._leases.get(lease_id)
            if kept is None:
                continue  # revoked meanwhile
            if kept.inflight == reply.uuid:
                kept.inflight = None
            why = gone.get(lease_id)
            if why is None:
                actions.append(LeaseKept(lease_id, pending.made + kept.ttl))
                continue
            log.warning("lease %s is gone: a keepalive was refused, %s", lease_id, why)
            self._stop_keeping(lease_id)
            self.counters.leases_lost += 1
            actions.append(LeaseGone(lease_id, why))
        return actions

    def _kept_reply(self, lease_id: str, reply: Reply) -> list[Action]:
        """The answer to a keepalive: kept (ok), or gone (any refusal)."""
        kept = self._leases.get(lease_id)
        if kept is None:
            return []  # revoked meanwhile
        made = kept.inflight_at
        if kept.inflight == reply.uuid:
            kept.inflight = None
        if reply.ok:
            if reply.ttl is not None and reply.ttl != kept.ttl:
                kept.ttl = reply.ttl  # the server's word on the cadence
            return [LeaseKept(lease_id, made + kept.ttl)]
        why = (reply.reason or reply.status) + (f" ({reply.detail})" if reply.detail else "")
        log.warning("lease %s is gone: a keepalive was refused, %s", lease_id, why)
        self._stop_keeping(lease_id)
        self.counters.leases_lost += 1
        return [LeaseGone(lease_id, why)]

    def _stop_keeping(self, lease_id: str) -> None:
        kept = self._leases.pop(lease_id, None)
        if kept is None or kept.inflight is None:
            return
        pending = self._calls.get(kept.inflight)
        # A batched keepalive stays while it keeps another lease alive.
        if pending is not None and not any(
            lid in self._leases and self._leases[lid].inflight == kept.inflight
            for lid in pending.leases
        ):
            self._calls.pop(kept.inflight, None)
