"""The peer-only properties of a split-brain write forwarded to the winner.

How this works: after a split brain the server that steps down sends the winner
the client writes it confirmed that the winner cannot hold, as ``set`` calls
(docs/failover.md, "Writes of a split brain").  The winner decides whether to
apply each with the rule of :mod:`clone.server.splitrule`, which needs what the
loser knew when it applied the write; the call carries that as properties only
a peer server may send (docs/protocol.md, "CALL? / REPLY", split writes)::

    split_term=<n>      the loser's term (its Binary Star epoch); marks a split write
    split_fork=<n>      the winner's fork the loser sorted its writes by
    split_at=<unix s>   when the write was made (the time in its UUIDv7)
    split_prev=<prev>   what the loser's key held before this write, if the loser
                        itself had changed it since the fork: ``u:<32 hex>``, the
                        uuid of that update, or ``gone``, a delete without one
    split_if=<n>        the write's own ``if_sequence`` on the loser (0: if absent);
                        never sent as ``if_sequence``, which would be judged
                        against the winner's sequences

Pure: encode and a total parse.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

__all__ = [
    "GONE",
    "SPLIT_AT_PROPERTY",
    "SPLIT_FORK_PROPERTY",
    "SPLIT_IF_PROPERTY",
    "SPLIT_PREV_PROPERTY",
    "SPLIT_PROPERTIES",
    "SPLIT_TERM_PROPERTY",
    "SplitOrigin",
    "parse_split_origin",
    "split_properties",
    "uuid_time",
]

SPLIT_TERM_PROPERTY: Final = "split_term"
SPLIT_FORK_PROPERTY: Final = "split_fork"
SPLIT_AT_PROPERTY: Final = "split_at"
SPLIT_PREV_PROPERTY: Final = "split_prev"
SPLIT_IF_PROPERTY: Final = "split_if"
#: Every peer-only property: a call from anyone but the peer may not carry them.
SPLIT_PROPERTIES: Final = frozenset(
    {
        SPLIT_TERM_PROPERTY,
        SPLIT_FORK_PROPERTY,
        SPLIT_AT_PROPERTY,
        SPLIT_PREV_PROPERTY,
        SPLIT_IF_PROPERTY,
    }
)
#: ``split_prev`` for a delete the loser made without a uuid (an expiry).
GONE: Final = b""

_UINT_RE = re.compile(r"[0-9]{1,20}")
_HEX_RE = re.compile(r"u:[0-9a-f]{32}")
_SEQ_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SplitOrigin:
    """What the loser knew of one forwarded write."""

    term: int
    #: The winner's fork (KVAPPLIED ``fork=``) the write was sorted by.
    fork: int
    at: float
    #: The loser's previous update of the key after the fork: its uuid, or
    #: :data:`GONE` for a delete without one; None when the loser had not
    #: changed the key since the fork.
    prev: bytes | None = None
    #: The write's ``if_sequence`` on the loser; None for a plain write.
    condition: int | None = None


def split_properties(origin: SplitOrigin) -> tuple[tuple[str, str], ...]:
    """The call properties that say ``origin``."""
    props = [
        (SPLIT_TERM_PROPERTY, str(origin.term)),
        (SPLIT_FORK_PROPERTY, str(origin.fork)),
        (SPLIT_AT_PROPERTY, f"{origin.at:.3f}"),
    ]
    if origin.prev is not None:
        prev = "gone" if origin.prev == GONE else "u:" + origin.prev.hex()
        props.append((SPLIT_PREV_PROPERTY, prev))
    if origin.condition is not None:
        props.append((SPLIT_IF_PROPERTY, str(origin.condition)))
    return tuple(props)


def parse_split_origin(properties: Sequence[tuple[str, str]]) -> SplitOrigin | None:
    """The origin a call's properties state, None when they state none (no
    ``split_term``); ValueError saying what is wrong with a malformed one."""
    props = dict(properties)
    if not SPLIT_PROPERTIES & props.keys():
        return None
    term_text = props.get(SPLIT_TERM_PROPERTY)
    if term_text is None or _UINT_RE.fullmatch(term_text) is None:
        raise ValueError(f"split_term {str(term_text)[:40]!r} is not a whole number")
    fork_text = props.get(SPLIT_FORK_PROPERTY)
    if fork_text is None or _UINT_RE.fullmatch(fork_text) is None or int(fork_text) > _SEQ_MAX:
        raise ValueError(f"split_fork {str(fork_text)[:40]!r} is not a sequence")
    at_text = props.get(SPLIT_AT_PROPERTY, "")
    try:
        at = float(at_text)
    except ValueError:
        raise ValueError(f"split_at {at_text[:40]!r} is not a time") from None
    if not 0.0 <= at < 1e11:  # also false for nan
        raise ValueError(f"split_at {at_text[:40]!r} is not a time")
    prev: bytes | None = None
    prev_text = props.get(SPLIT_PREV_PROPERTY)
    if prev_text == "gone":
        prev = GONE
    elif prev_text is not None:
        if _HEX_RE.fullmatch(prev_text) is None:
            raise ValueError(f"split_prev {prev_text[:40]!r} is neither u:<32 hex> nor gone")
        prev = bytes.fromhex(prev_text[2:])
    condition: int | None = None
    if_text = props.get(SPLIT_IF_PROPERTY)
    if if_text is not None:
        if _UINT_RE.fullmatch(if_text) is None or int(if_text) > _SEQ_MAX:
            raise ValueError(f"split_if {if_text[:40]!r} is not a sequence")
        condition = int(if_text)
    return SplitOrigin(int(term_text), int(fork_text), at, prev, condition)


def uuid_time(uuid: bytes) -> float | None:
    """The Unix time in a UUIDv7 (its first 48 bits, milliseconds), or None
    when ``uuid`` is not one."""
    if len(uuid) != 16:
        return None
    # Imported here: uuid6 brings importlib.metadata, a tenth of a server's
    # start-up imports, for a call made only when a split brain heals.
    import uuid6

    parsed = uuid6.UUID(bytes=uuid)  # the library reads the layouts of RFC 9562
    if parsed.version != 7:
        return None
    return parsed.time / 1000.0
