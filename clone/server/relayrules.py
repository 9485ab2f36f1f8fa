"""A relay's decisions, pure: when an upstream counts as lost, whether the
relay is stale, why a client's write is refused instead of forwarded.

Why a module of its own: these are the rules of docs/operations.md's relay
section, and they are easier to read, and to test with explicit times
(tests/server/test_relay.py), away from the sockets of :mod:`.relaying`
that act on them.
"""

from __future__ import annotations

__all__ = ["forward_refusal", "relay_stale", "upstream_lost"]


def upstream_lost(
    *,
    now: float,
    syncing: bool,
    sync_started: float,
    sync_timeout: float,
    heard: float,
    heartbeat: float,
    missed: int,
) -> bool:
    """Whether a relay should give up its current upstream for the next one.

    While a sync is outstanding the sync timeout decides (a server that will
    not answer is passive, or gone); once synced, silence for ``missed``
    heartbeats of the upstream's own rhythm does (the active sends HUGZ).
    """
    if syncing:
        return now - sync_started >= sync_timeout
    return now - heard >= heartbeat * missed


def relay_stale(
    *,
    now: float,
    synced_once: bool,
    heard: float,
    heartbeat: float,
    missed: int,
    upstream_stale: bool,
) -> bool:
    """Whether a relay's HUGZ should say ``stale=1``.

    Stale: it has never synced, its upstream is silent beyond the missed
    heartbeats, or its upstream is a relay that says it is stale itself.
    """
    return not synced_once or upstream_stale or now - heard >= heartbeat * missed


def forward_refusal(*, stale: bool, queued: bool) -> str | None:
    """Why a client's KVSET is refused instead of forwarded, or None (it was).

    ``stale``: the relay has lost the pair, so nothing is sent at all (the
    pair would apply it whenever it came back, after its writer gave up).
    ``queued``: the forwarding PUB took it (False: its queue was full).
    """
    if stale:
        return "stale"
    if not queued:
        return "overloaded"
    return None
