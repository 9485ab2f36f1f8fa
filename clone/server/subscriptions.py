"""What one subscriber connection may ask of the publisher, in count and bytes.

How this works: the publisher is an XPUB in manual mode (clone.server.subscribers),
so no subscription takes effect until the server applies it.  Each subscription
message names its connection (its descriptor); the ledger keeps, per
connection, the topics it was granted and their bytes, and answers each new
one with a :class:`Verdict`: accept it, refuse it (over ``max_count`` topics or
``max_bytes`` of them), or, once a connection has been refused
``drop_after`` times, drop the connection.  A dropped connection's later
messages (those libzmq had already read) are ignored until the descriptor is
seen connecting again.

Why per connection and in bytes: libzmq stores every topic a connection sent
in a trie of one node per byte (about 40 bytes of memory per topic byte, so
160 MB of random 1000-byte topics took 7 GB), until the connection closes.
Refusing a topic keeps it out of the trie that matches publications; dropping
the connection is what frees libzmq's own copy.

Pure: no zmq, no clock; tests/server/test_subscriptions.py drives it with
literal descriptors and topics.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "MAX_TOPIC_BYTES",
    "DEFAULT_MAX_SUBSCRIPTION_BYTES",
    "DEFAULT_MAX_SUBSCRIPTIONS",
    "DEFAULT_MAX_SUBSCRIBER_BYTES",
    "DROP_AFTER_REFUSALS",
    "InboundAllowance",
    "SubscriptionLedger",
    "SubscriptionLimits",
    "Verdict",
]

#: The longest topic one subscription message may carry: a longer one makes
#: libzmq close the connection at the frame's header (``MAXMSGSIZE``), before
#: it is read.  Why so short: libzmq's trie takes about 50 bytes of memory
#: per topic byte, and stores every topic it reads before we see it.  Why not
#: shorter: the limit holds for the handshake's frames too, and CURVE's
#: INITIATE is about 300 bytes.
MAX_TOPIC_BYTES = 511
#: Topics one connection may hold (our clients hold one: the empty topic).
DEFAULT_MAX_SUBSCRIPTIONS = 16
#: Bytes of topics one connection may hold.
DEFAULT_MAX_SUBSCRIPTION_BYTES = 1024
#: Refusals after which a connection that keeps asking is dropped.
DROP_AFTER_REFUSALS = 8
#: Bytes published while a subscriber reads nothing before it is cut off.
DEFAULT_MAX_SUBSCRIBER_BYTES = 64 * 1024 * 1024

class Verdict(Enum):
    """What the publisher does with one subscription message."""

    ACCEPT = "accept"  # apply it (a new topic, or one this connection already holds)
    REFUSE = "refuse"  # over the connection's count or bytes: not applied, counted
    DROP = "drop"  # refused, and the connection kept asking: close it
    IGNORE = "ignore"  # from a connection already dropped: nothing to do


@dataclass(frozen=True, slots=True)
class SubscriptionLimits:
    """The caps of one connection; 0 for ``max_count`` or ``max_bytes``: none."""

    max_count: int = DEFAULT_MAX_SUBSCRIPTIONS
    max_bytes: int = DEFAULT_MAX_SUBSCRIPTION_BYTES
    drop_after: int = DROP_AFTER_REFUSALS

    def __post_init__(self) -> None:
        if self.max_count < 0 or self.max_bytes < 0 or self.drop_after < 1:
            raise ValueError("subscription limits must be >= 0, drop_after >= 1")


@dataclass(slots=True)
class _Account:
    topics: set[bytes] = field(default_factory=set)
    nbytes: int = 0
    refusals: int = 0
    dropped: bool = False


class SubscriptionLedger:
    """Per-connection topics and bytes, and the verdict on each new subscription."""

    def __init__(self, limits: SubscriptionLimits) -> None:
        self.limits = limits
        self._accounts: dict[int, _Account] = {}

    def __len__(self) -> int:
        """Connections with an account."""
        return len(self._accounts)

    def connected(self, conn: int) -> None:
        """A new connection on ``conn``: whatever was known of that descriptor is gone."""
        self._accounts[conn] = _Account()

    def disconnected(self, conn: int) -> None:
        """The connection on ``conn`` closed (libzmq dropped its topics itself)."""
        self._accounts.pop(conn, None)

    def held(self, conn: int) -> tuple[int, int]:
        """(topics, bytes) ``conn`` holds, for tests and the log."""
        acct = self._accounts.get(conn)
        return (0, 0) if acct is None else (len(acct.topics), acct.nbytes)

    def subscribe(self, conn: int, topic: bytes) -> Verdict:
        """``conn`` asks for ``topic``."""
        acct = self._accounts.get(conn)
        if acct is None:
            acct = self._accounts[conn] = _Account()
        if acct.dropped:
            return Verdict.IGNORE
        if topic in acct.topics:
            return Verdict.ACCEPT
        lim = self.limits
        over_count = lim.max_count and len(acct.topics) + 1 > lim.max_count
        over_bytes = lim.max_bytes and acct.nbytes + len(topic) > lim.max_bytes
        if not over_count and not over_bytes:
            acct.topics.add(topic)
            acct.nbytes += len(topic)
            return Verdict.ACCEPT
        acct.refusals += 1
        if acct.refusals >= lim.drop_after:
            acct.dropped = True
            # What libzmq held of it goes with the connection: so does ours.
            acct.topics.clear()
            acct.nbytes = 0
            return Verdict.DROP
        return Verdict.REFUSE

    def unsubscribe(self, conn: int, topic: bytes) -> bool:
        """``conn`` cancels ``topic``: True if it held it (the server cancels it too)."""
        acct = self._accounts.get(conn)
        if acct is None or acct.dropped or topic not in acct.topics:
            return False
        acct.topics.discard(topic)
        acct.nbytes -= len(topic)
        return True


@dataclass(frozen=True, slots=True)
class InboundAllowance:
    """The bytes a publisher connection may have sent us, by its age.

    All a subscriber ever sends the publisher is its handshake and its
    (un)subscriptions, so a connection that has sent more than its caps allow
    is flooding, whatever it sent.  Counted from the kernel's byte count, this
    check does not depend on our loop having read anything: it is what stops
    a flood that keeps libzmq busy inside one call (clone.server.subscribers).
    ``rate`` lets a long-lived connection send ZMTP heartbeats.
    """

    burst: int
    rate: float = 1024.0

    @classmethod
    def for_limits(cls, limits: SubscriptionLimits) -> InboundAllowance | None:
        """Twice the caps' bytes (with 64 bytes of framing per topic, enough
        for CURVE's) plus 2 KiB of handshake (a CURVE handshake is about 700
        bytes); None when either cap is off (nothing to hold to)."""
        if not limits.max_count or not limits.max_bytes:
            return None
        return cls(2 * (limits.max_bytes + 64 * limits.max_count) + 2048)

    def allows(self, received: int, age: float) -> bool:
        """Whether ``received`` bytes in ``age`` seconds are within the allowance."""
        return received <= self.burst + self.rate * max(0.0, age)
