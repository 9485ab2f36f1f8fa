"""The replicated hashmap: entries, the sequence counter and ephemeral keys.

How this works: a :class:`Store` maps each key to the last :class:`KVMsg` that
set it, exactly as it was (or will be) published, so a snapshot entry is that
message re-encoded.  Two ways in:

* :meth:`Store.apply` -- the active server's path.  A client's KVSET gets the
  next sequence; its ``ttl`` becomes an absolute ``expires`` property; the
  result is the KVPUB to publish.
* :meth:`Store.apply_published` -- the passive server's path.  A KVPUB from the
  active server is stored as is, its sequence and ``expires`` included, so both
  servers expire a key at the same moment.

Expiry deadlines live in an :class:`~clone.ttl.ExpiryHeap`; only the active
server calls :meth:`Store.expire`, which deletes due keys and returns the delete
KVPUBs to publish.  Sans-IO: every ``now`` is wall-clock Unix seconds, passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from clone.codec import KVMsg, Properties, encode_properties
from clone.errors import LimitExceeded
from clone.protocol import EXPIRES_PROPERTY, MAX_PROPERTIES_BYTES, TTL_PROPERTY
from clone.ttl import ExpiryHeap, format_expires, parse_expires, parse_ttl

__all__ = ["Store"]


def _has_prop(props: Properties, name: str) -> str | None:
    for pname, value in props:
        if pname == name:
            return value
    return None


class Store:
    """A hashmap of key -> latest message, plus the highest sequence applied."""

    __slots__ = ("_expiry", "_map", "bad_expires", "sequence")

    def __init__(self, sequence: int = 0) -> None:
        self._map: dict[str, KVMsg] = {}
        self._expiry = ExpiryHeap()
        self.sequence = sequence
        #: KVPUBs from the peer whose ``expires`` could not be parsed.
        self.bad_expires = 0

    # -- reading -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def get(self, key: str) -> KVMsg | None:
        """The stored message for ``key`` (a KVSYNC in waiting), or None."""
        return self._map.get(key)

    def keys(self) -> list[str]:
        """A copy of the key list: cheap (one C-level copy) and safe to iterate
        while the map changes, which is what a fuzzy snapshot needs."""
        return list(self._map)

    def items(self) -> Iterable[tuple[str, KVMsg]]:
        return self._map.items()

    def deadline(self, key: str) -> float | None:
        """When ``key`` expires (Unix seconds), if it is ephemeral."""
        return self._expiry.deadline(key)

    @property
    def ephemeral_count(self) -> int:
        return len(self._expiry)

    def next_deadline(self) -> float | None:
        return self._expiry.next_deadline()

    # -- writing -------------------------------------------------------------

    def apply(self, msg: KVMsg, now: float) -> KVMsg:
        """Apply a client's KVSET as the active server; return the KVPUB.

        Raises :class:`~clone.errors.ProtocolError` (nothing changed) for an
        invalid ``ttl`` or when adding ``expires`` would overflow the properties
        limit.  The returned message shares ``msg.properties`` (same object)
        when they did not change, so the caller may reuse the raw frame.
        """
        props = msg.properties
        deadline: float | None = None
        if props:
            ttl_text = _has_prop(props, TTL_PROPERTY)
            ttl = parse_ttl(ttl_text)
            if msg.body and ttl > 0:
                deadline = now + ttl
                props = msg.with_props(**{EXPIRES_PROPERTY: format_expires(deadline)})
                if len(encode_properties(props)) > MAX_PROPERTIES_BYTES:
                    raise LimitExceeded(
                        f"properties of key {msg.key[:80]!r} would be over the "
                        f"{MAX_PROPERTIES_BYTES}-byte limit once '{EXPIRES_PROPERTY}' is added"
                    )
            elif _has_prop(props, EXPIRES_PROPERTY) is not None:
                # Only the server sets expires; a client's copy means nothing.
                props = msg.with_props(**{EXPIRES_PROPERTY: None})
        self.sequence += 1
        pub = KVMsg(msg.key, self.sequence, msg.uuid, props, msg.body)
        self._put(pub, deadline)
        return pub

    def apply_published(self, msg: KVMsg) -> None:
        """Store a KVPUB (or a KVSYNC) from the active server as it is.

        The caller has checked the sequence; this moves :attr:`sequence` up to
        the message's.
        """
        deadline: float | None = None
        if msg.body and msg.properties:
            text = _has_prop(msg.properties, EXPIRES_PROPERTY)
            if text is not None:
                deadline = parse_expires(text)
                if deadline is None:
                    self.bad_expires += 1
        self._put(msg, deadline)
        if msg.sequence > self.sequence:
            self.sequence = msg.sequence

    def expire(self, now: float, limit: int | None = None) -> list[KVMsg]:
        """Delete keys due at ``now``; return the delete KVPUBs to publish.

        The delete carries a fresh sequence, an empty uuid and no properties
        (``docs/protocol.md``).  ``limit`` bounds one call's work.
        """
        out: list[KVMsg] = []
        for key in self._expiry.due(now, limit):
            if self._map.pop(key, None) is None:
                continue
            self.sequence += 1
            out.append(KVMsg(key, self.sequence))
        return out

    def replace(self, entries: dict[str, KVMsg], sequence: int) -> None:
        """Swap in a whole new state (a completed resync), in O(n)."""
        self._map = entries
        self.sequence = sequence
        deadlines: dict[str, float] = {}
        for key, msg in entries.items():
            if msg.properties:
                text = _has_prop(msg.properties, EXPIRES_PROPERTY)
                if text is not None:
                    deadline = parse_expires(text)
                    if deadline is None:
                        self.bad_expires += 1
                    else:
                        deadlines[key] = deadline
        self._expiry.rebuild(deadlines)

    def _put(self, msg: KVMsg, deadline: float | None) -> None:
        if msg.body:
            self._map[msg.key] = msg
            if deadline is not None:
                self._expiry.schedule(msg.key, deadline)
            else:
                self._expiry.cancel(msg.key)
        else:
            self._map.pop(msg.key, None)
            self._expiry.cancel(msg.key)
