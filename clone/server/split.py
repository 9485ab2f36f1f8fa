"""The writes a demoted active confirmed during a split brain, as calls to the winner.

How this works: Binary Star cannot stop two servers from being active while
they cannot hear each other (docs/failover.md, "Split brain").  When they hear
each other again the one elected earlier steps down and resyncs from the other,
and the resync replaces its state: a write it confirmed during the split, and
that the winner never received, would be gone although a client was told it
was applied.  So the loser keeps, when it steps down, the updates it recorded
under its own term (what it wrote while active), and learns from the winner's
KVAPPLIED (``fork=N``, :mod:`clone.wire.applied`) the sequence the winner had
applied when it was elected.  Up to N the two histories are the same (the winner
followed the loser until then); every client write the loser recorded after N
is one the winner cannot hold, unless the client also sent it there directly.
Those go to the winner as ``set`` calls with their original uuids
(:mod:`clone.wire.calls`): a copy the winner already applied is answered from
its uuid window and applied once, whatever the order.

What is not forwarded: server-made updates (no uuid: expiry and lease deletes,
which the winner makes itself), the loser's own lease keys (its leases end with
its term; their holders are told by their next keepalive), and writes whose
ttl ran out meanwhile.  A forwarded write keeps what is left of its ttl, and
carries, as peer-only properties (:mod:`clone.wire.split`), what the winner's
rule (:mod:`clone.server.splitrule`) needs: the loser's term, the write's time,
what the loser's key held before it (when the loser itself had changed the key
since the fork) and its original ``if_sequence``.  The winner applies it only
where that does not undo what the winner confirmed; the rest are conflicts,
kept on the winner and reported to their writers.

Sans-IO: frames, a fork and ``now`` in; call frames and counts out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from clone.server.ttl import parse_expires
from clone.wire.calls import LEASE_PREFIX, OP_SET, encode_call
from clone.wire.codec import decode_properties
from clone.wire.protocol import EXPIRES_PROPERTY, TTL_PROPERTY
from clone.wire.split import GONE, SplitOrigin, split_properties, uuid_time

__all__ = ["SplitWrites", "split_writes"]

_LEASE_PREFIX_RAW = LEASE_PREFIX.encode()


@dataclass(frozen=True, slots=True)
class SplitWrites:
    """What a demoted active sends the winner, and what it leaves out, by why."""

    calls: tuple[list[bytes], ...]
    #: Written at or below the fork: the winner followed them.
    shared: int = 0
    #: Server-made updates and lease keys: the winner makes its own.
    server_made: int = 0
    #: Their ttl ran out before the split healed.
    expired: int = 0


def split_writes(
    written: Sequence[Sequence[bytes]],
    fork: int,
    now: float,
    *,
    term: int = 0,
    conditions: Mapping[bytes, int] | None = None,
    last: dict[bytes, bytes] | None = None,
) -> SplitWrites:
    """The ``set`` calls for the updates in ``written`` (KVPUB frames, oldest
    first, recorded under the loser's ``term``) after sequence ``fork``.

    ``conditions``: the ``if_sequence`` each conditional write had, by uuid
    (the stored update no longer says it).  ``last``: each key's last update
    after the fork in the writes before ``written`` (its uuid, or GONE for a
    delete), for a list converted a slice at a time; updated in place.
    """
    calls: list[list[bytes]] = []
    shared = server_made = expired = 0
    conditions = conditions or {}
    # The loser's last update of each key after the fork: what a later write
    # of the key replaced (GONE: a delete).
    if last is None:
        last = {}
    for key, seq, uuid, raw_props, body in written:
        if int.from_bytes(seq, "big") <= fork:
            shared += 1
            continue
        prev = last.get(key)
        last[key] = bytes(uuid) if body else GONE
        if not uuid or key.startswith(_LEASE_PREFIX_RAW):
            server_made += 1
            continue
        stored = decode_properties(raw_props)
        expires = parse_expires(_prop(stored, EXPIRES_PROPERTY))
        props = [(n, v) for n, v in stored if n not in (EXPIRES_PROPERTY, TTL_PROPERTY)]
        if body and expires is not None:
            left = expires - now
            if left <= 0:
                expired += 1
                continue
            props.append((TTL_PROPERTY, f"{left:.3f}"))
        at = uuid_time(bytes(uuid))
        origin = SplitOrigin(
            term, fork, now if at is None else at, prev, conditions.get(bytes(uuid))
        )
        props += split_properties(origin)
        calls.append(encode_call(OP_SET, bytes(uuid), key.decode("utf-8"), tuple(props), body))
    return SplitWrites(tuple(calls), shared, server_made, expired)


def _prop(props: Sequence[tuple[str, str]], name: str) -> str | None:
    for pname, value in props:
        if pname == name:
            return value
    return None
