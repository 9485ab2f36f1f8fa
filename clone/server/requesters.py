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

__all__ = ["Requester", "from_options", "replaced", "replaced_waiting"]

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
        return self.name is not None and self.name == older.name and self.user == older.user


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
