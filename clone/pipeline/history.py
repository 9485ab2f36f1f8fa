"""The servers' update history, read on the driver, as Arrow tables.

How this works: the audit reads two kinds of input into one schema
(:data:`HISTORY_COLUMNS`, one row per update, in sequence order):

- a **data directory** (``DIR/clone.db``): its ``log`` table, the bounded
  history the server keeps (``--history``), and its ``kv`` table, the state
  at the database's sequence (``meta``).  SQLite is read with Python's
  ``sqlite3`` on the driver and handed to Spark as Arrow: Spark's JDBC source
  would need the sqlite-jdbc jar on every executor, which pip's pyspark does
  not ship, and a configuration store's history fits in the driver's memory;
- a **history export**, taken over the network by ``clone-pipeline history``
  (:func:`fetch_history`): the updates after a sequence, up to the server's
  sequence when it answered, written as Parquet with ``_clone_history.json``.

Each input says which sequences it holds completely (:class:`HistorySpan`):
what the audit can reconstruct exactly follows from that
(:mod:`clone.pipeline.audit`).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from clone.errors import CloneError, HistoryCompacted, StorageError
from clone.pipeline.errors import InputError, ServersUnreachable
from clone.wire.codec import KVMsg, encode_properties

if TYPE_CHECKING:
    import pyarrow as pa

    from clone.security import KeyPair

__all__ = [
    "HISTORY_COLUMNS",
    "HISTORY_META_FILE",
    "HistorySpan",
    "DataDirHistory",
    "fetch_history",
    "history_arrow_schema",
    "read_data_dir",
]

log = logging.getLogger(__name__)

#: Next to the Parquet files of a history export: what it covers.
HISTORY_META_FILE = "_clone_history.json"

#: One update: sequence, key, value (null for a delete), writer's uuid (hex),
#: properties (``name=value`` lines), deleted, ``at`` (Unix seconds the server
#: applied it; null over the network) and ``term`` (null over the network).
HISTORY_COLUMNS = ("seq", "key", "value", "uuid", "props", "deleted", "at", "term")
#: The state at a sequence: one row per key, as ``kv`` holds it.
STATE_COLUMNS = ("key", "seq", "value", "uuid", "props")


def history_arrow_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("seq", pa.int64()),
            ("key", pa.string()),
            ("value", pa.binary()),
            ("uuid", pa.string()),
            ("props", pa.string()),
            ("deleted", pa.bool_()),
            ("at", pa.float64()),
            ("term", pa.int64()),
        ]
    )


def state_arrow_schema() -> pa.Schema:
    import pyarrow as pa

    return pa.schema(
        [
            ("key", pa.string()),
            ("seq", pa.int64()),
            ("value", pa.binary()),
            ("uuid", pa.string()),
            ("props", pa.string()),
        ]
    )


@dataclass(frozen=True, slots=True)
class HistorySpan:
    """What one input holds: every update ``first``..``last`` (``first`` > ``last``
    when it holds none), and, if ``state`` is set, the state at ``state_seq``."""

    source: str
    first: int
    last: int
    state_seq: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "first": self.first, "last": self.last,
                "state_seq": self.state_seq}  # fmt: skip


@dataclass(slots=True)
class DataDirHistory:
    """A data directory read on the driver: its log, its state and their span."""

    updates: pa.Table
    state: pa.Table | None
    span: HistorySpan


def _text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def read_data_dir_span(path: str) -> HistorySpan:
    """What a data directory holds, from its bounds alone (two indexed reads,
    no update or key read): the audit decides from this whether a state can be
    rebuilt before it reads anything in bulk (at a million rows)."""
    from clone.storage.schema import DATA_FILE, connect_readonly, read_position, verify

    db = Path(path)
    if db.is_dir():
        db = db / DATA_FILE
    if not db.exists():
        raise InputError(f"{path}: no {DATA_FILE} here (not a Clone data directory)")
    try:
        conn = connect_readonly(db)
        try:
            verify(conn, db)
            conn.execute("BEGIN")
            (first,) = conn.execute("SELECT MIN(seq) FROM log").fetchone()
            sequence, _term = read_position(conn, db)
            conn.execute("COMMIT")
        finally:
            conn.close()
    except StorageError as exc:
        raise InputError(f"{path}: {exc}") from None
    except sqlite3.Error as exc:
        raise InputError(f"{path}: cannot read {db}: {exc}") from None
    first = sequence + 1 if first is None else int(first)
    return HistorySpan(str(path), first, sequence, sequence)


def read_data_dir(path: str) -> DataDirHistory:
    """``path/clone.db`` (or a ``clone.db`` / ``clone backup`` file itself):
    its ``log`` and ``kv`` tables, read-only, without disturbing a running server."""
    import pyarrow as pa

    from clone.storage.schema import DATA_FILE, connect_readonly, read_position, verify

    db = Path(path)
    if db.is_dir():
        db = db / DATA_FILE
    if not db.exists():
        raise InputError(f"{path}: no {DATA_FILE} here (not a Clone data directory)")
    try:
        conn = connect_readonly(db)
        try:
            verify(conn, db)
            sequence, _term = read_position(conn, db)
            # One read transaction: the log and the state agree with meta.
            conn.execute("BEGIN")
            rows = conn.execute(
                "SELECT seq, key, uuid, props, body, term, at FROM log ORDER BY seq"
            ).fetchall()
            kv = conn.execute("SELECT key, seq, uuid, props, body FROM kv").fetchall()
            sequence, _term = read_position(conn, db)
            conn.execute("COMMIT")
        finally:
            conn.close()
    except StorageError as exc:
        raise InputError(f"{path}: {exc}") from None
    except sqlite3.Error as exc:
        raise InputError(f"{path}: cannot read {db}: {exc}") from None
    updates = pa.table(
        {
            "seq": [r[0] for r in rows],
            "key": [_text(r[1]) for r in rows],
            "value": [bytes(r[4]) if r[4] else None for r in rows],
            "uuid": [bytes(r[2]).hex() if r[2] else None for r in rows],
            "props": [_text(r[3]) or "" for r in rows],
            "deleted": [not r[4] for r in rows],
            "at": [r[6] for r in rows],
            "term": [r[5] for r in rows],
        },
        schema=history_arrow_schema(),
    )
    state = pa.table(
        {
            "key": [_text(r[0]) for r in kv],
            "seq": [int.from_bytes(r[1], "big") for r in kv],
            "value": [bytes(r[4]) for r in kv],
            "uuid": [bytes(r[2]).hex() if r[2] else None for r in kv],
            "props": [_text(r[3]) or "" for r in kv],
        },
        schema=state_arrow_schema(),
    )
    # The log holds every update after its first one (the server trims it
    # from below only); empty, it holds none, and the state is all there is.
    first = rows[0][0] if rows else sequence + 1
    log.info("%s: state at %d, log %d..%d (%d updates)", path, sequence, first, sequence, len(rows))
    return DataDirHistory(updates, state, HistorySpan(str(path), first, sequence, sequence))


def _row(msg: KVMsg) -> dict[str, Any]:
    deleted = not msg.body
    return {
        "seq": msg.sequence,
        "key": msg.key,
        "value": None if deleted else msg.body,
        "uuid": msg.uuid.hex() if msg.uuid else None,
        "props": encode_properties(msg.properties).decode("utf-8"),
        "deleted": deleted,
        "at": None,  # the wire carries no time of application
        "term": None,
    }


@dataclass(slots=True)
class FetchedHistory:
    """The updates after ``since`` up to ``until`` (the server's sequence when it answered)."""

    updates: pa.Table
    since: int
    until: int
    servers: tuple[str, ...]
    taken: float

    def meta(self) -> dict[str, Any]:
        return {"since": self.since, "until": self.until, "servers": list(self.servers),
                "time": self.taken, "rows": self.updates.num_rows}  # fmt: skip


def fetch_history(
    servers: Sequence[str],
    since: int,
    *,
    silence: float = 3.0,
    curve: tuple[KeyPair, bytes] | None = None,
    deadline: float | None = None,
) -> FetchedHistory:
    """Every update after ``since`` up to the active server's sequence when it
    answered, over the network (:func:`clone.client.history.read_history`).

    Raises :class:`InputError` when the server's history no longer reaches
    back to ``since`` and :class:`ServersUnreachable` when no server answers
    within ``deadline`` seconds (default: ``silence`` per server, three rounds).
    """
    import pyarrow as pa

    from clone.client.history import read_history

    rows: list[dict[str, Any]] = []
    limit = deadline if deadline is not None else 3 * silence * max(1, len(servers)) + 5
    give_up = time.monotonic() + limit
    taken = time.time()
    try:
        until = read_history(
            servers,
            since,
            lambda entry: None,
            lambda: time.monotonic() > give_up,
            silence=silence,
            curve=curve,
            until_live=True,
            on_message=lambda msg: rows.append(_row(msg)),
        )
    except HistoryCompacted as exc:
        raise InputError(str(exc)) from None
    except ValueError as exc:
        raise InputError(str(exc)) from None
    except CloneError as exc:
        raise ServersUnreachable(f"reading the history: {exc}") from None
    if time.monotonic() > give_up:
        raise ServersUnreachable(
            f"no Clone server at {', '.join(servers)} delivered the history after {since} "
            f"in {limit:g}s (reached {until})"
        )
    table = pa.Table.from_pylist(rows, schema=history_arrow_schema())
    return FetchedHistory(table, since, until, tuple(servers), taken)


def read_history_meta(path: str) -> dict[str, Any] | None:
    """The ``_clone_history.json`` of a local history export, or None if absent."""
    meta_path = os.path.join(path, HISTORY_META_FILE)
    if not os.path.exists(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as fh:
            meta: dict[str, Any] = json.load(fh)
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {meta_path}: {exc}") from None
    for field in ("since", "until"):
        if not isinstance(meta.get(field), int):
            raise InputError(f"{meta_path}: no integer {field!r}")
    return meta
