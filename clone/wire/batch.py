"""KVBATCH, our extension of CHP: many KVSYNCs in one ten-frame message.

How this works: a standard snapshot costs six frames per key on the server and
five on the client, and at a million keys the per-frame cost in pyzmq and
libzmq is most of a sync.  A KVBATCH carries up to ``MAX_BATCH_ENTRIES`` entries
as columns::

    [b"KVBATCH", key_lens, keys, seqs, uuid_lens, uuids,
     props_lens, props, body_lens, bodies]

Each ``*_lens`` frame holds one unsigned 32-bit big-endian length per entry, and
the frame after it is the concatenation of the values, so the lengths must add
up to exactly its size.  ``seqs`` is the 8-byte big-endian sequences joined.
Entry *i* is the KVSYNC ``[key_i, seq_i, uuid_i, props_i, body_i]``, with every
rule of a KVSYNC (``docs/protocol.md``).

Both ends work a column at a time so the per-entry work runs in C: ``itemgetter`` to
transpose, ``array`` for the lengths, ``bytes.join`` to encode; ``accumulate``
for offsets, ``map`` over slices to split, ``min``/``max`` over the lengths and a
set test for the reserved keys to validate.  The decoder is strict and total
like :mod:`clone.wire.codec`: a batch is accepted whole or rejected whole with a
:class:`~clone.errors.ProtocolError` that says what was wrong.  The encoder
trusts its entries (they are a store's, validated when they came in).
"""

from __future__ import annotations

import sys
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from operator import add, itemgetter
from struct import Struct

from clone.errors import LimitExceeded, ProtocolError
from clone.wire.codec import RESERVED_KEYS, KVMsg, Properties, decode_properties
from clone.wire.protocol import (
    BATCH_TARGET_BYTES,
    KVBATCH,
    MAX_BATCH_BYTES,
    MAX_BATCH_ENTRIES,
    MAX_KEY_BYTES,
    MAX_PROPERTIES_BYTES,
    MAX_VALUE_BYTES,
)

__all__ = [
    "BATCH_FRAMES",
    "BatchEntry",
    "KVBatch",
    "announced_entries",
    "batch_size",
    "decode_kvbatch",
    "encode_kvbatch",
    "is_kvbatch",
]

#: Frames in a KVBATCH as its receiver sees it (no ROUTER identity).
BATCH_FRAMES = 10

#: One entry as a store holds it after the key: sequence (8 bytes, big-endian),
#: uuid, properties frame, body.  The same shape as :data:`clone.server.store.Entry`.
BatchEntry = tuple[bytes, bytes, bytes, bytes]


def _typecode(size: int) -> str:
    for code in "BHILQ":
        if array(code).itemsize == size:
            return code
    raise ImportError(f"no array typecode of {size} bytes on this platform")


_U32 = _typecode(4)
_U64 = _typecode(8)
_SWAP = sys.byteorder == "little"  # the wire is big-endian
_KEY_LENS = 1  # the frame of key lengths, after the command
_LENGTH_BYTES = 4  # one unsigned 32-bit length per entry
_COLUMNS = tuple(map(itemgetter, range(4)))
_PROPS, _BODY = _COLUMNS[2], _COLUMNS[3]


# --------------------------------------------------------------------------
# Encoding


def _lengths(values: Sequence[bytes]) -> bytes:
    lens = array(_U32, map(len, values))
    if _SWAP:
        lens.byteswap()
    return lens.tobytes()


def batch_size(keys: Sequence[bytes], entries: Sequence[BatchEntry]) -> int:
    """How many of the leading entries one batch takes (at least one).

    A sender stops once the keys, properties and bodies reach
    ``BATCH_TARGET_BYTES``; the entry that reaches it is still in.
    """
    n = min(len(keys), len(entries), MAX_BATCH_ENTRIES)
    if n == 0:
        raise ValueError("a batch needs at least one entry")
    sizes = map(add, map(len, keys), map(len, map(_PROPS, entries)))
    ends = list(accumulate(map(add, sizes, map(len, map(_BODY, entries)))))
    if ends[n - 1] < BATCH_TARGET_BYTES:
        return n
    return min(n, bisect_left(ends, BATCH_TARGET_BYTES) + 1)


def encode_kvbatch(keys: Sequence[bytes], entries: Sequence[BatchEntry]) -> list[bytes]:
    """The ten frames of a KVBATCH of ``keys[i]`` -> ``entries[i]``.

    The caller sizes the batch (:func:`batch_size`); too many or no entries is
    API misuse and raises ``ValueError``.
    """
    n = len(keys)
    if not 0 < n <= MAX_BATCH_ENTRIES:
        raise ValueError(f"a batch has 1 to {MAX_BATCH_ENTRIES} entries, not {n}")
    if len(entries) != n:
        raise ValueError(f"{n} keys but {len(entries)} entries")
    # Columns by itemgetter, not zip(*entries): that would allocate an iterator
    # per entry, thousands of GC-tracked objects per batch, and the collections
    # they trigger promote live objects until a full collection walks the store.
    seqs, uuids, props, bodies = (list(map(get, entries)) for get in _COLUMNS)
    join = b"".join
    return [
        KVBATCH,
        _lengths(keys),
        join(keys),
        join(seqs),
        _lengths(uuids),
        join(uuids),
        _lengths(props),
        join(props),
        _lengths(bodies),
        join(bodies),
    ]


# --------------------------------------------------------------------------
# Decoding


@dataclass(frozen=True, slots=True)
class KVBatch:
    """A decoded, valid KVBATCH: one list per column, entry *i* at index *i*.

    Both the raw frames (what a server stores and sends again) and the decoded
    values (what a client keeps) are here: the decoder needs both to validate.
    """

    raw_keys: list[bytes]
    keys: list[str]
    sequences: list[int]
    uuids: list[bytes]
    raw_properties: list[bytes]
    properties: list[Properties]
    bodies: list[bytes]
    sequence_data: bytes

    def __len__(self) -> int:
        return len(self.keys)

    def sequence_frames(self) -> list[bytes]:
        """Each entry's 8-byte sequence frame, as a KVSYNC would carry it."""
        data = self.sequence_data
        starts = range(0, len(data), 8)
        return list(map(data.__getitem__, map(slice, starts, range(8, len(data) + 8, 8))))

    def messages(self) -> list[KVMsg]:
        """The entries as messages (tests and slow paths: one object per entry)."""
        return list(map(KVMsg, self.keys, self.sequences, self.uuids, self.properties, self.bodies))


def is_kvbatch(frames: Sequence[bytes]) -> bool:
    """Whether ``frames`` claim to be a KVBATCH (decode to know if it is one)."""
    return len(frames) == BATCH_FRAMES and frames[0] == KVBATCH


def announced_entries(frames: Sequence[bytes]) -> int:
    """How many entries a KVBATCH's ``key_lens`` frame announces, without decoding.

    Only a cost estimate for the receive loop (it bounds the work per event):
    garbage that claims to be a KVBATCH announces whatever it likes, and
    :func:`decode_kvbatch` still rejects it.
    """
    return len(frames[_KEY_LENS]) // _LENGTH_BYTES


def _read_lengths(raw: bytes, what: str) -> array[int]:
    if len(raw) % 4:
        raise ProtocolError(
            f"KVBATCH {what} lengths frame of {len(raw)} bytes is not a multiple of 4"
        )
    lens = array(_U32)
    lens.frombytes(raw)
    if _SWAP:
        lens.byteswap()
    return lens


def _formats() -> list[str]:
    """``["0s", "1s", ...]``: the struct format of a value of each size."""
    if not _FORMATS:
        _FORMATS.extend(f"{size}s" for size in range(_FORMATS_MAX))
    return _FORMATS


_FORMATS: list[str] = []  # built on first use: clients that never decode pay nothing
_FORMATS_MAX = 2048  # covers every key, and the values of most configuration data


def _split(lens: array[int], data: bytes, what: str) -> list[bytes]:
    """Cut ``data`` into values of ``lens`` bytes.

    With a struct format of one ``<size>s`` per value, unpacking runs in C;
    it is twice as fast as slicing (building the format, too, is a C-level
    join of cached strings).  Values of one size, like uuids, need no lookup.
    """
    total = sum(lens)
    if total != len(data):
        raise ProtocolError(
            f"KVBATCH {what} lengths add up to {total} bytes but the frame has {len(data)}"
        )
    n = len(lens)
    if not data:
        return [b""] * n
    first = lens[0]
    if lens.count(first) == n:
        fmt = f"{first}s" * n
    elif max(lens) < _FORMATS_MAX:
        fmt = "".join(map(_formats().__getitem__, lens))
    else:  # a few large values (a batch stops at about 1 MiB): slices are fine
        offsets = list(accumulate(lens, initial=0))
        return list(map(data.__getitem__, map(slice, offsets, islice(offsets, 1, None))))
    # Not struct.unpack(fmt): its cache would keep a hundred 16 KiB formats.
    return list(Struct("=" + fmt).unpack(data))


def _decode_keys(raw_keys: list[bytes]) -> list[str]:
    try:
        return list(map(bytes.decode, raw_keys))
    except UnicodeDecodeError:
        pass
    for index, raw in enumerate(raw_keys):  # only to say which one
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(
                f"KVBATCH entry {index}: key is not UTF-8 ({exc.reason} at byte {exc.start})"
            ) from None
    raise ProtocolError("KVBATCH has a key that is not UTF-8")  # not reached


def _decode_all_properties(raw_props: list[bytes]) -> list[Properties]:
    # Identical frames (none at all, usually) are decoded once.
    decoded: dict[bytes, Properties] = {b"": ()}
    for raw in set(raw_props):
        if raw not in decoded:
            try:
                decoded[raw] = decode_properties(raw)
            except ProtocolError as exc:
                index = raw_props.index(raw)
                raise type(exc)(f"KVBATCH entry {index}: {exc}") from None
    return list(map(decoded.__getitem__, raw_props))


def decode_kvbatch(frames: Sequence[bytes]) -> KVBatch:
    """A KVBATCH as its receiver sees it (no identity frame), checked whole.

    Raises :class:`~clone.errors.ProtocolError` (or its subclass
    :class:`~clone.errors.LimitExceeded`) for anything a KVSYNC may not be, or
    any inconsistency between the columns; nothing else, for any input.
    """
    if len(frames) != BATCH_FRAMES:
        raise ProtocolError(f"KVBATCH must have {BATCH_FRAMES} frames, got {len(frames)}")
    head, key_lens_raw, key_data, seq_data, uuid_lens_raw, uuid_data = frames[:6]
    props_lens_raw, props_data, body_lens_raw, body_data = frames[6:]
    if head != KVBATCH:
        raise ProtocolError(f"expected KVBATCH, got command {bytes(head[:16])!r}")
    key_lens = _read_lengths(key_lens_raw, "key")
    uuid_lens = _read_lengths(uuid_lens_raw, "uuid")
    props_lens = _read_lengths(props_lens_raw, "properties")
    body_lens = _read_lengths(body_lens_raw, "body")
    n = len(key_lens)
    if not len(uuid_lens) == len(props_lens) == len(body_lens) == n:
        raise ProtocolError(
            f"KVBATCH columns disagree: {n} keys, {len(uuid_lens)} uuids, "
            f"{len(props_lens)} properties, {len(body_lens)} bodies"
        )
    if n == 0:
        raise ProtocolError("KVBATCH with no entries")
    if n > MAX_BATCH_ENTRIES:
        raise LimitExceeded(f"KVBATCH of {n} entries is over the {MAX_BATCH_ENTRIES}-entry limit")
    if len(seq_data) != 8 * n:
        raise ProtocolError(
            f"KVBATCH of {n} entries needs {8 * n} bytes of sequences, got {len(seq_data)}"
        )
    payload = len(key_data) + len(props_data) + len(body_data)
    if payload > MAX_BATCH_BYTES:
        raise LimitExceeded(
            f"KVBATCH of {payload} bytes of keys, properties and bodies is over the "
            f"{MAX_BATCH_BYTES}-byte limit"
        )
    # Per-entry limits, a column at a time; the loops that name the culprit
    # run only when there is one.
    shortest, longest = min(key_lens), max(key_lens)
    if shortest == 0:
        raise ProtocolError(f"KVBATCH entry {key_lens.index(0)}: empty key")
    if longest > MAX_KEY_BYTES:
        raise LimitExceeded(
            f"KVBATCH entry {key_lens.index(longest)}: key of {longest} bytes is over the "
            f"{MAX_KEY_BYTES}-byte limit"
        )
    if uuid_lens.count(16) + uuid_lens.count(0) != n:
        index, size = next((i, s) for i, s in enumerate(uuid_lens) if s not in (0, 16))
        raise ProtocolError(f"KVBATCH entry {index}: uuid must be 0 or 16 bytes, got {size}")
    longest = max(props_lens)
    if longest > MAX_PROPERTIES_BYTES:
        raise LimitExceeded(
            f"KVBATCH entry {props_lens.index(longest)}: properties of {longest} bytes are "
            f"over the {MAX_PROPERTIES_BYTES}-byte limit"
        )
    longest = max(body_lens)
    if longest > MAX_VALUE_BYTES:
        raise LimitExceeded(
            f"KVBATCH entry {body_lens.index(longest)}: value of {longest} bytes is over the "
            f"{MAX_VALUE_BYTES}-byte limit"
        )
    raw_keys = _split(key_lens, bytes(key_data), "key")
    uuids = _split(uuid_lens, bytes(uuid_data), "uuid")
    raw_props = _split(props_lens, bytes(props_data), "properties")
    bodies = _split(body_lens, bytes(body_data), "body")
    keys = _decode_keys(raw_keys)
    if any(raw[:1] == b"\x00" for raw in raw_keys):
        index = next(i for i, raw in enumerate(raw_keys) if raw[:1] == b"\x00")
        raise ProtocolError(
            f"KVBATCH entry {index}: keys beginning with NUL are reserved for control topics"
        )
    if not RESERVED_KEYS.isdisjoint(keys):
        key = next(k for k in keys if k in RESERVED_KEYS)
        raise ProtocolError(
            f"KVBATCH entry {keys.index(key)}: key {key!r} is reserved for protocol commands"
        )
    props: list[Properties] = _decode_all_properties(raw_props) if props_data else [()] * n
    seqs = array(_U64)
    seqs.frombytes(seq_data)
    if _SWAP:
        seqs.byteswap()
    return KVBatch(raw_keys, keys, seqs.tolist(), uuids, raw_props, props, bodies, bytes(seq_data))
