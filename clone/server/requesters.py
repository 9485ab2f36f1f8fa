"""Which snapshot requests a new one replaces: one stream per requester (pure).

How this works: a request is known by its routing id (one per DEALER) and,
when the client says it (``X-CHP-Requester``, :mod:`clone.wire.requester`),
by the client's own id, the same on every fresh DEALER it asks on.  A new
request replaces every older one -- a stream in flight, a request waiting for
a slot, one held through a split brain's heal -- from the same routing id, or
from the same requester id *and* the same CURVE user (so that one client
cannot cancel another's snapshot by naming its id).  Its older socket is
closed or about to be: what the old stream sent has no reader, and its slot
is the new request's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Requester", "from_options", "replaced", "replaced_waiting", "stale", "stale_waiting"]

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Requester:
    """Who asked: the ROUTER's routing id, the client's requester id (None: it
    did not say) and its CURVE user (None in a plain server)."""

    identity: bytes
    name: str | None = None
    user: str | None = None
    #: The subtree asked for (None: not known, matches any): a client with
    #: several subtrees asks for each on one socket, at once.
    subtree: str | None = None
    #: The host it connects from (``Peer-Address``; None: not known): the
    #: unit of fairness between requesters (:mod:`.fairshare`).
    host: str | None = None

    def replaces(self, older: Requester) -> bool:
        """Whether a request from us makes ``older``'s request moot: the same
        subtree, asked again by the same socket or the same named client."""
        if self.subtree is not None and older.subtree is not None:
            if self.subtree != older.subtree:
                return False
        if self.identity == older.identity:
            return True
        if self.name is None or self.name != older.name or self.user != older.user:
            return False
        # A late copy of an earlier re-ask replaces nothing newer: see stale().
        return not _connected_before(self.identity, older.identity)


def _generated_number(identity: bytes) -> int | None:
    """The number in a routing id libzmq made up (a zero byte, then a 32-bit
    counter the ROUTER counts up per connection), or None for one the peer
    chose."""
    if len(identity) == 5 and identity[0] == 0:
        return int.from_bytes(identity[1:], "big")
    return None


def _connected_before(identity: bytes, other: bytes) -> bool:
    """Whether the connection of ``identity`` came to the ROUTER before that of
    ``other``, as far as their generated routing ids tell (else False)."""
    mine, theirs = _generated_number(identity), _generated_number(other)
    return mine is not None and theirs is not None and mine < theirs


def stale(requests: Iterable[Requester], new: Requester) -> bool:
    """Whether ``new`` is a late copy: the same named requester (same user,
    same subtree) already asked on a socket that connected after ``new``'s.

    Why: a client re-asks on a fresh DEALER each time, closing the old one;
    its requests travel on separate connections, and a loaded server read the
    ninth of ten re-asks after the tenth.  Replacing the tenth's stream with
    the ninth's left the client with no stream at all (the ninth's socket was
    closed), waiting for its answer.  The routing ids libzmq makes up count
    the connections in order, which says which socket is the newer."""
    if new.name is None:
        return False
    for older in requests:
        if older.identity == new.identity or older.name != new.name or older.user != new.user:
            continue
        if new.subtree is not None and older.subtree is not None and new.subtree != older.subtree:
            continue
        if _connected_before(new.identity, older.identity):
            return True
    return False


def replaced(requests: Mapping[K, Requester] | Iterable[tuple[K, Requester]],
             new: Requester) -> list[K]:  # fmt: skip
    """The keys of ``requests`` (stream, waiting or held request -> who asked)
    that ``new`` replaces, in their order."""
    items = requests.items() if isinstance(requests, Mapping) else requests
    return [key for key, who in items if new.replaces(who)]


def from_options(
    identity: bytes, options: Mapping[str, Any], subtree: str | None = None
) -> Requester:
    """Who asked, for a request kept with its serve options (``requester``,
    ``user``): one waiting for a slot, or held through a heal."""
    asked = options.get("subtree", subtree)
    return Requester(identity, options.get("requester"), options.get("user"), asked,
                     options.get("host"))


def replaced_waiting(waiting: Mapping[bytes, tuple[float, Mapping[str, Any]]],
                     new: Requester) -> list[bytes]:  # fmt: skip
    """The routing ids of the requests waiting for a slot (routing id ->
    (when, serve options)) that ``new`` replaces.  A request that does not
    name its requester can only replace its own socket's: looked up, not
    scanned (200 such requesters re-asking scanned a thousand waiting
    requests each)."""
    if new.name is None:
        held = waiting.get(new.identity)
        if held is None or not new.replaces(from_options(new.identity, held[1])):
            return []
        return [new.identity]
    return replaced(((i, from_options(i, how)) for i, (_, how) in waiting.items()), new)


def stale_waiting(waiting: Mapping[bytes, tuple[float, Mapping[str, Any]]],
                  new: Requester) -> bool:  # fmt: skip
    """:func:`stale` against the requests waiting for a slot (routing id ->
    (when, serve options))."""
    if new.name is None:
        return False
    return stale((from_options(i, how) for i, (_, how) in waiting.items()), new)
