"""The replicated hashmap: entries, the sequence counter and ephemeral keys.

How this works: a :class:`Store` maps each key to the frames of the last
message that set it, exactly as it was (or will be) published: a snapshot entry
is then those frames sent again (KVSYNC and KVPUB are the same five frames), with
no lookup of a message object and no re-encoding.  The map is keyed by the raw
key frame and each value is an :data:`Entry`, a tuple of four ``bytes``
(sequence, uuid, properties, body).  Tuples of bytes are untracked by Python's
garbage collector, so a million keys add nothing to a full GC pass (a million
``KVMsg`` objects made one take 0.16 s, long enough to delay a heartbeat).

Held packed (the memory per key at fleet scale): the map keeps the common entry, no
properties and a 16-byte uuid, as *one* ``bytes`` of sequence, uuid and body
(a 100-byte value: 157 bytes, against 72 for the tuple plus 41, 49 and 133 for
its three objects), and any other entry as its tuple.  Reads hand out the
:data:`Entry` tuple as before, sliced from the packed bytes (a batch of them in
C); what callers see did not change.
Two ways in:

* :meth:`Store.apply` -- the active server's path.  A client's KVSET gets the
  next sequence; its ``ttl`` is kept as sent and counted from ``now``, and an
  ``expires`` property (the wall clock plus the ttl, for display) is added; the
  result is the frames of the KVPUB to publish (the stored ones).
* :meth:`Store.apply_published` -- the passive server's path.  A KVPUB from the
  active server is stored as is, its sequence included; its ``ttl`` (or the
  ``ttl-left`` a snapshot or catch-up entry came with) is the time left when it
  was sent, counted here from when it was received.

Expiry deadlines live in an :class:`~clone.server.ttl.ExpiryHeap` on this
server's monotonic clock (:mod:`clone.server.ttl` says why and how the time
left travels); only the active server calls :meth:`Store.expire`, which deletes
due keys and returns the delete KVPUBs to publish.  :meth:`Store.served` is an
entry as a snapshot or catch-up sends it to a peer server, with the time it has
left.  Sans-IO: every ``now`` is monotonic seconds and every ``wall`` Unix
seconds, passed in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from operator import itemgetter
from typing import TypeAlias, cast

from clone.errors import LimitExceeded, ProtocolError, StoreFull
from clone.server.ttl import ExpiryHeap, format_expires, parse_ttl, with_ttl_left
from clone.wire.codec import KVMsg, Properties, decode_properties, encode_properties
from clone.wire.protocol import EXPIRES_PROPERTY, MAX_PROPERTIES_BYTES, TTL_PROPERTY

__all__ = ["Entry", "Served", "Store", "entry_of"]

#: One stored key's frames after the key frame: sequence (8 bytes, big-endian),
#: uuid, properties, body -- as on the wire.
Entry = tuple[bytes, bytes, bytes, bytes]

#: An entry as it goes out in a snapshot or catch-up to a peer server, given
#: its raw key (:meth:`Store.served` with the clock read at the time).
Served = Callable[[bytes, Entry], Entry]


#: What the map holds for a key: an :data:`Entry` packed into one ``bytes``
#: (sequence, uuid, body: no properties, a 16-byte uuid) or, otherwise, as is.
_Held: TypeAlias = bytes | Entry

# The columns of packed entries, sliced in C (itemgetter of a slice).
_SEQ = itemgetter(slice(0, 8))
_UUID = itemgetter(slice(8, 24))
_BODY = itemgetter(slice(24, None))
_PACKED_UUID = 16


def _pack(entry: Entry) -> _Held:
    """The form the map holds ``entry`` in (see the module docstring)."""
    seq, uuid, props, body = entry
    if props or len(uuid) != _PACKED_UUID or len(seq) != 8:
        return entry
    return b"".join((seq, uuid, body))


def _packed_or_empty(held: _Held | None) -> bytes:
    """What :meth:`Store.held_sizes` measures: a packed entry, else nothing."""
    return held if type(held) is bytes else b""


def _unpack(held: _Held) -> Entry:
    if isinstance(held, bytes):
        return (held[:8], held[8:24], b"", held[24:])
    return held


def _held_seq(held: _Held) -> bytes:
    """The sequence frame of a held entry."""
    return held[:8] if isinstance(held, bytes) else held[0]


def _held_size(held: _Held) -> int:
    """Bytes of a held entry's frames (sequence, uuid, properties, body)."""
    if isinstance(held, bytes):
        return len(held)
    return len(held[0]) + len(held[1]) + len(held[2]) + len(held[3])


def _has_prop(props: Properties, name: str) -> str | None:
    for pname, value in props:
        if pname == name:
            return value
    return None


def entry_of(msg: KVMsg) -> Entry:
    """The stored form of ``msg`` (a valid message: it was built or decoded)."""
    return (
        msg.sequence.to_bytes(8, "big"),
        msg.uuid,
        encode_properties(msg.properties),
        msg.body,
    )


def _msg_of(key: str, entry: Entry) -> KVMsg:
    seq, uuid, props, body = entry
    return KVMsg(key, int.from_bytes(seq, "big"), uuid, decode_properties(props), body)


# Cheap byte tests before decoding a stored entry's properties.
_TTL_TOKEN = f"{TTL_PROPERTY}=".encode()
_EXPIRES_TOKEN = f"{EXPIRES_PROPERTY}=".encode()


def _ttl_of(props: Properties) -> float | None:
    """The ``ttl`` a stored or published entry carries (None: none, or not a valid one)."""
    try:
        ttl = parse_ttl(_has_prop(props, TTL_PROPERTY))
    except ProtocolError:
        return None
    return ttl if ttl > 0 else None


class Store:
    """A hashmap of key -> latest message, plus the highest sequence applied."""

    __slots__ = (
        "_expiry",
        "_key_list",
        "_last_key",
        "_map",
        "bad_expires",
        "max_bytes",
        "max_keys",
        "nbytes",
        "sequence",
        "version",
    )

    def __init__(self, sequence: int = 0, *, max_keys: int = 0, max_bytes: int = 0) -> None:
        self._map: dict[bytes, _Held] = {}
        self._expiry: ExpiryHeap[bytes] = ExpiryHeap()
        self.sequence = sequence
        # The key of the newest write (see last_update); checked against its
        # entry's sequence before use, so a sequence moved by hand is safe.
        self._last_key: bytes | None = None
        # The key list the last snapshot copied, while no key was added since
        # (see raw_keys); None: copy again.
        self._key_list: list[bytes] | None = None
        #: KVPUBs from the peer with an ``expires`` but no valid ``ttl``: kept
        #: without an expiry (``ttl`` says how long is left; see clone.server.ttl).
        self.bad_expires = 0
        #: The limits :meth:`apply` enforces (0: none).  Only the active
        #: server's writes are refused: a follower stores what it is sent.
        self.max_keys = max_keys
        self.max_bytes = max_bytes
        #: Bytes held: key, sequence, uuid, properties and value of every entry.
        self.nbytes = 0
        #: Counts every change to the map (a write, a delete, an expiry, a
        #: swap): a shared snapshot is joined only at the version it started
        #: at (clone.server.sharedsnap), and a swap may keep the sequence.
        self.version = 0

    # -- reading -------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            key = key.encode("utf-8")
        return key in self._map

    def get(self, key: str) -> KVMsg | None:
        """The stored message for ``key``, decoded (not for hot paths), or None."""
        held = self._map.get(key.encode("utf-8"))
        return None if held is None else _msg_of(key, _unpack(held))

    def entry(self, raw_key: bytes) -> Entry | None:
        """The stored frames for a raw key frame: what a snapshot sends."""
        held = self._map.get(raw_key)
        return None if held is None else _unpack(held)

    def packed(self, raw_key: bytes) -> bytes | None:
        """The packed bytes held for ``raw_key``, if it is held packed: for the
        history to share rather than copy (:mod:`clone.server.history`)."""
        held = self._map.get(raw_key)
        return held if type(held) is bytes else None

    def entries(self, raw_keys: Sequence[bytes]) -> list[Entry | None]:
        """:meth:`entry` for many keys at once, in C (a batched snapshot's lookup)."""
        found = list(map(self._map.get, raw_keys))
        if set(map(type, found)) == {bytes}:
            # All packed (the usual batch): the columns sliced and zipped in C.
            packed = cast(list[bytes], found)
            return list(zip(map(_SEQ, packed), map(_UUID, packed), repeat(b""), map(_BODY, packed)))
        return [None if held is None else _unpack(held) for held in found]

    def held_sizes(self, raw_keys: Sequence[bytes]) -> list[int]:
        """For each key, the bytes held packed (0 if absent or not packed), in
        C and without copying a value: a batched snapshot sizes its batch by
        them before :meth:`entries` slices the values out."""
        return list(map(len, map(_packed_or_empty, map(self._map.get, raw_keys))))

    def keys(self) -> list[str]:
        """The keys as text, in insertion order (for tests and tools)."""
        return [key.decode("utf-8") for key in self._map]

    def raw_keys(self) -> list[bytes]:
        """A copy of the raw key list, safe to iterate while the map changes,
        which is what a fuzzy snapshot needs; callers must not modify it.

        One C-level copy, but it touches every key object: about 5 ms for a
        million keys made in a row, 0.4 to 0.6 s of the loop for 10M keys spread
        over a server's heap (py-spy, a busy 2-core machine).  So the copy is
        kept and handed to the next snapshots as long as no key has been added
        since: a key deleted since is skipped by the snapshot as it is anyway, a
        value changed since is read when it is sent (:meth:`_key_gone` bounds
        the deleted keys it keeps alive).  At 10M keys a client that asks again
        every quarter heartbeat before the first data (and each of the clients
        after a failover) otherwise had the key list copied once per request:
        5.1 s of copies in one 25 s profile, the loop held for seconds, the peer
        took over, and no request was answered.  The copy is freed when a key is
        added (or the state is swapped).
        """
        keys = self._key_list
        if keys is None:
            keys = self._key_list = list(self._map)
        return keys

    def last_update(self) -> list[bytes] | None:
        """The frames of the update at :attr:`sequence`, if a key still holds it.

        An entry is stored as the KVPUB that wrote it, so the key whose entry
        carries our sequence holds, byte for byte, the update numbered so;
        None when that update was a delete (or the sequence moved without
        one).  O(1): every write notes its key, and :meth:`replace` finds it in
        the pass it makes anyway (a scan here cost 32 ms of the reactor per
        resync request at 1M keys).
        """
        key = self._last_key
        if key is None:
            return None
        held = self._map.get(key)
        if held is None or int.from_bytes(_held_seq(held), "big") != self.sequence:
            return None
        return [key, *_unpack(held)]

    def entries_with_properties_or_prefix(self, prefix: bytes) -> list[tuple[bytes, Entry]]:
        """The entries with properties, or whose key starts with ``prefix``: a
        promotion's scan for leases and the keys bound to them (one pass in C
        over the map; most entries have no properties)."""
        # Packed entries have no properties: only tuples can have them.
        return [
            (key, _unpack(held))
            for key, held in self._map.items()
            if (not isinstance(held, bytes) and held[2]) or key.startswith(prefix)
        ]

    def deadline(self, key: str) -> float | None:
        """When ``key`` expires (on the monotonic clock), if it is ephemeral."""
        return self._expiry.deadline(key.encode("utf-8"))

    def time_left(self, raw_key: bytes, now: float) -> float | None:
        """Seconds until ``raw_key`` expires, as of monotonic ``now`` (None: it does not)."""
        deadline = self._expiry.deadline(raw_key)
        return None if deadline is None else deadline - now

    def served(self, raw_key: bytes, entry: Entry, now: float) -> Entry:
        """``entry`` (stored under ``raw_key``) as a snapshot or catch-up sends
        it to a peer server.

        An ephemeral key gets ``ttl-left``, the time it has left at monotonic
        ``now``, so that the receiver can count from when it gets it.  Every
        other entry, and an older update of a key since rewritten (``entry`` is
        not the stored one), is sent as it is.
        """
        if not entry[2]:
            return entry
        deadline = self._expiry.deadline(raw_key)
        if deadline is None:
            return entry
        stored = self._map.get(raw_key)
        if stored is None or _held_seq(stored) != entry[0]:
            return entry
        props = with_ttl_left(entry[2], deadline - now)
        return entry if props is None else (entry[0], entry[1], props, entry[3])

    @property
    def ephemeral_count(self) -> int:
        return len(self._expiry)

    def next_deadline(self) -> float | None:
        return self._expiry.next_deadline()

    # -- writing -------------------------------------------------------------

    def apply(
        self,
        msg: KVMsg,
        now: float,
        frames: Sequence[bytes] | None = None,
        *,
        wall: float | None = None,
    ) -> list[bytes]:
        """Apply a client's KVSET as the active server; return the KVPUB frames.

        An ephemeral key expires ``ttl`` after monotonic ``now``; ``expires``
        shows the wall clock ``wall`` plus the ttl (``now`` if not given: a
        caller with one clock).  ``frames`` are the KVSET's own frames when ``msg`` was decoded from
        them: their key, uuid, properties and body are reused as they are.
        Raises :class:`~clone.errors.ProtocolError` (nothing changed) for an
        invalid ``ttl`` or when adding ``expires`` would overflow the properties
        limit.
        """
        props = msg.properties
        deadline: float | None = None
        props_raw: bytes | None = None  # set when the properties change
        if props:
            ttl_text = _has_prop(props, TTL_PROPERTY)
            ttl = parse_ttl(ttl_text)
            if msg.body and ttl > 0:
                deadline = now + ttl
                shown = (now if wall is None else wall) + ttl
                props_raw = encode_properties(
                    msg.with_props(**{EXPIRES_PROPERTY: format_expires(shown)})
                )
                if len(props_raw) > MAX_PROPERTIES_BYTES:
                    raise LimitExceeded(
                        f"properties of key {msg.key[:80]!r} would be over the "
                        f"{MAX_PROPERTIES_BYTES}-byte limit once '{EXPIRES_PROPERTY}' is added"
                    )
            elif _has_prop(props, EXPIRES_PROPERTY) is not None:
                # Only the server sets expires; a client's copy means nothing.
                props_raw = encode_properties(msg.with_props(**{EXPIRES_PROPERTY: None}))
        if frames is not None:
            key_raw, uuid, body = frames[0], frames[2], frames[4]
            if props_raw is None:
                props_raw = frames[3]
        else:
            key_raw, uuid, body = msg.key.encode("utf-8"), msg.uuid, msg.body
            if props_raw is None:
                props_raw = encode_properties(props)
        if body and (self.max_keys or self.max_bytes):
            self._check_room(key_raw, 8 + len(key_raw) + len(uuid) + len(props_raw) + len(body))
        self.sequence += 1
        seq = self.sequence.to_bytes(8, "big")
        self._put(key_raw, (seq, uuid, props_raw, body), deadline)
        self._last_key = key_raw
        return [key_raw, seq, uuid, props_raw, body]

    def apply_published(
        self,
        msg: KVMsg,
        frames: Sequence[bytes] | None = None,
        *,
        now: float,
        left: float | None = None,
    ) -> None:
        """Store a KVPUB (or a KVSYNC) from the active server as it is.

        An ephemeral key expires ``left`` (the ``ttl-left`` it came with, cut
        off by the caller) or else its ``ttl`` after ``now``, when it was
        received (monotonic).  ``frames`` are its own frames when ``msg`` was
        decoded from them.  The caller has checked the sequence; this moves
        :attr:`sequence` up to the message's.
        """
        deadline: float | None = None
        if msg.body and msg.properties:
            deadline = self._deadline_of(msg.properties, now)
            if deadline is not None and left is not None:
                deadline = now + left
        if frames is not None:
            key = frames[0]
            self._put(key, (frames[1], frames[2], frames[3], frames[4]), deadline)
        else:
            key = msg.key.encode("utf-8")
            self._put(key, entry_of(msg), deadline)
        if msg.sequence >= self.sequence:
            self.sequence = msg.sequence
            self._last_key = key

    def _check_room(self, key: bytes, size: int) -> None:
        """Raise StoreFull if storing ``size`` bytes under ``key`` breaks a limit."""
        old = self._map.get(key)
        if old is None:
            if self.max_keys and len(self._map) >= self.max_keys:
                raise StoreFull(
                    f"the store holds {len(self._map)} keys, its --max-keys limit;"
                    f" key {key[:80]!r} not added"
                )
            grows = size
        else:
            grows = size - (len(key) + _held_size(old))
        if self.max_bytes and grows > 0 and self.nbytes + grows > self.max_bytes:
            raise StoreFull(
                f"the store holds {self.nbytes} bytes; {grows} more for key {key[:80]!r}"
                f" would pass its --max-bytes limit of {self.max_bytes}"
            )

    def expire(self, now: float, limit: int | None = None) -> list[KVMsg]:
        """Delete keys due at monotonic ``now``; return the delete KVPUBs to publish.

        The delete carries a fresh sequence, an empty uuid and no properties
        (``docs/protocol.md``).  ``limit`` bounds one call's work.
        """
        out: list[KVMsg] = []
        for key in self._expiry.due(now, limit):
            old = self._map.pop(key, None)
            if old is None:
                continue
            self._key_gone()
            self.nbytes -= len(key) + _held_size(old)
            self.version += 1
            self.sequence += 1
            out.append(KVMsg(key.decode("utf-8"), self.sequence))
        return out

    def _deadline_of(self, props: Properties, now: float) -> float | None:
        """``now`` plus the ``ttl`` in ``props``; None if it has none (counted
        in :attr:`bad_expires` when an ``expires`` shows it should have)."""
        ttl = _ttl_of(props)
        if ttl is not None:
            return now + ttl
        if _has_prop(props, EXPIRES_PROPERTY) is not None:
            self.bad_expires += 1
        return None

    def replace(
        self,
        entries: dict[bytes, Entry],
        sequence: int,
        now: float = 0.0,
        deadlines: dict[bytes, float] | None = None,
    ) -> None:
        """Swap in a whole new state (a completed resync, or a data directory), in O(n).

        ``entries`` maps raw key frames to :data:`Entry` tuples of valid
        (decoded once) frames; the store takes ownership of the dict.  An
        ephemeral entry expires at its deadline in ``deadlines`` (monotonic, by
        key: when it was received plus the time it had left) or else its
        ``ttl`` after ``now``: a state loaded from disk gives every such key its
        stored ``ttl`` again from the start.  The entries are packed in place.
        """
        due: dict[bytes, float] = {}
        last = sequence.to_bytes(8, "big")
        self._last_key = None
        nbytes = sum(map(len, entries))
        held_map = cast(dict[bytes, _Held], entries)
        for key, entry in entries.items():
            nbytes += len(entry[0]) + len(entry[1]) + len(entry[2]) + len(entry[3])
            # Replacing a value while iterating is safe: the dict's size does not change.
            held_map[key] = _pack(entry)
            if entry[0] == last:
                self._last_key = key
            props = entry[2]
            if props and (_TTL_TOKEN in props or _EXPIRES_TOKEN in props):
                deadline = self._deadline_of(decode_properties(props), now)
                if deadline is not None:
                    if deadlines is not None:
                        deadline = deadlines.get(key, deadline)
                    due[key] = deadline
        self._map = held_map
        self._key_list = None
        self.sequence = sequence
        self.nbytes = nbytes
        self.version += 1
        self._expiry.rebuild(due)

    def _put(self, key: bytes, entry: Entry, deadline: float | None) -> None:
        self.version += 1
        old = self._map.get(key)
        if old is not None:
            self.nbytes -= len(key) + _held_size(old)
        if entry[3]:
            self.nbytes += len(key) + len(entry[0]) + len(entry[1]) + len(entry[2]) + len(entry[3])
            if old is None:
                self._key_list = None  # a new key: the next snapshot copies again
            self._map[key] = _pack(entry)
            if deadline is not None:
                self._expiry.schedule(key, deadline)
            elif self._expiry:
                self._expiry.cancel(key)
        else:
            if self._map.pop(key, None) is not None:
                self._key_gone()
            if self._expiry:
                self._expiry.cancel(key)

    def _key_gone(self) -> None:
        """A key was deleted: the kept key list (raw_keys) still names it,
        which the snapshots skip; it is dropped once it holds more dead keys
        than live ones, so that deletes cannot keep memory alive without bound."""
        keys = self._key_list
        if keys is not None and 2 * len(self._map) < len(keys):
            self._key_list = None
