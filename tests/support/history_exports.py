"""History exports built by hand, with times the test chooses.

``clone-pipeline history`` writes Parquet in the history schema plus
``_clone_history.json``; a test writes the same files itself, so that the
audit's write rates, which need the time each update was applied, can be
checked against numbers worked out by hand.  Over the network the times are
null; :func:`untimed` gives the same updates as such an export would hold.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from clone.pipeline.history import HISTORY_META_FILE, history_arrow_schema

__all__ = ["TIMED", "TIMED_RATES", "rate_rows", "update", "untimed", "write_history_export"]


def update(seq: int, key: str, value: bytes | None, at: float | None) -> dict[str, Any]:
    """One row of the history schema (``value`` None: a delete)."""
    return {"seq": seq, "key": key, "value": value, "uuid": f"{seq:032x}", "props": "",
            "deleted": value is None, "at": at, "term": None if at is None else 1}  # fmt: skip


#: Eight updates at chosen times.  In 10 s windows: 1000 holds /app/ 1, 2, 4
#: (keys a, b) and /cfg/ 3; 1010 the delete 5 of /app/b; 1020 nothing; 1030
#: /app/ 7, 8 (keys c, a) and /cfg/ 6.
TIMED = [
    update(1, "/app/a", b"1", 1000.0),
    update(2, "/app/b", b"2", 1001.0),
    update(3, "/cfg/x", b"x1", 1005.0),
    update(4, "/app/a", b"3", 1009.5),
    update(5, "/app/b", None, 1012.0),
    update(6, "/cfg/x", b"x2", 1030.0),
    update(7, "/app/c", b"4", 1031.0),
    update(8, "/app/a", b"5", 1039.9),
]


#: TIMED in 10 s windows, worked out by hand from the times above:
#: (prefix, window_start, window_end, writes, deletes, keys, writes per second).
TIMED_RATES = [
    ("/app/", 1000.0, 1010.0, 3, 0, 2, 0.3),
    ("/cfg/", 1000.0, 1010.0, 1, 0, 1, 0.1),
    ("/app/", 1010.0, 1020.0, 1, 1, 1, 0.1),
    ("/app/", 1030.0, 1040.0, 2, 0, 2, 0.2),
    ("/cfg/", 1030.0, 1040.0, 1, 0, 1, 0.1),
]
_RATE_COLUMNS = ("prefix", "window_start", "window_end", "writes", "deletes", "keys",
                 "writes_per_s")  # fmt: skip


def rate_rows(rows: Sequence[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Rows of ``rates/`` as tuples in TIMED_RATES' order (by window, then prefix)."""
    return sorted((tuple(r[c] for c in _RATE_COLUMNS) for r in rows), key=lambda t: (t[1], t[0]))


def untimed(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same updates as an export over the network holds them: no time, no term."""
    return [{**r, "at": None, "term": None} for r in rows]


def write_history_export(
    path: Path, rows: Sequence[dict[str, Any]], since: int, until: int
) -> Path:
    """``path`` as ``clone-pipeline history --since SINCE`` would write it."""
    path.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(list(rows), schema=history_arrow_schema()),
                   path / "part-00000.parquet")  # fmt: skip
    meta = {"since": since, "until": until, "servers": ["tcp://test:1"], "time": 0.0,
            "rows": len(rows)}  # fmt: skip
    (path / HISTORY_META_FILE).write_text(json.dumps(meta))
    return path
