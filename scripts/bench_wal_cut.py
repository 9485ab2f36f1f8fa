"""How long each way of cutting a grown WAL holds the writer: SQLite alone.

Fills a WAL past 66 MiB with small commits (as the durable server writes,
``synchronous=FULL``, ``journal_size_limit`` 64 MiB), lets a second
connection run a passive checkpoint (the checkpoint thread's catch-up),
commits 50 more updates (a reader keeps the WAL from starting again from
the top meanwhile, as a steady writer does), then times ``wal_checkpoint(MODE)`` on the writer's
connection, the commit after it and the longest of the next 200.  Run each
mode in the same session and compare (docs/benchmarks.md, "The WAL's cut
without the stall")::

    for m in TRUNCATE RESTART PASSIVE; do
        .venv/bin/python scripts/bench_wal_cut.py $m 3 /tmp/walcut
    done
"""

from __future__ import annotations

import os
import sqlite3
import sys
import time
from pathlib import Path

LIMIT = 64 << 20


def _commit(conn: sqlite3.Connection, key: str) -> float:
    started = time.perf_counter()
    conn.execute("BEGIN IMMEDIATE")
    conn.execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, os.urandom(100)))
    conn.execute("COMMIT")
    return time.perf_counter() - started


def once(mode: str, path: Path) -> str:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{path}{suffix}").unlink(missing_ok=True)
    writer = sqlite3.connect(path, isolation_level=None)
    writer.execute("PRAGMA journal_mode = WAL")
    writer.execute("PRAGMA synchronous = FULL")
    writer.execute("PRAGMA wal_autocheckpoint = 0")
    writer.execute(f"PRAGMA journal_size_limit = {LIMIT}")
    writer.execute("CREATE TABLE kv (k TEXT PRIMARY KEY, v BLOB)")
    wal = Path(f"{path}-wal")
    i = 0
    while wal.stat().st_size < LIMIT + (2 << 20):
        _commit(writer, f"/k/{i % 50_000}")
        i += 1
    # As under a steady writer: the WAL does not start again from the top
    # before the cut (a reader here, in the WAL since before the catch-up; in
    # the server, the next commits), and the cut has the last commits' frames
    # to copy.
    reader = sqlite3.connect(path, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM kv").fetchone()
    checkpointer = sqlite3.connect(path, isolation_level=None)
    checkpointer.execute("PRAGMA wal_checkpoint(PASSIVE)")
    for _ in range(50):
        i += 1
        _commit(writer, f"/k/{i % 50_000}")
    reader.execute("ROLLBACK")
    reader.close()
    started = time.perf_counter()
    result = writer.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
    cut = time.perf_counter() - started
    after = _commit(writer, "/x")
    longest = max(_commit(writer, f"/k/{(i + n) % 50_000}") for n in range(200))
    size = wal.stat().st_size
    writer.close()
    checkpointer.close()
    return (f"{mode}: cut {cut * 1e3:.1f} ms, next commit {after * 1e3:.2f} ms, longest of "
            f"the next 200 {longest * 1e3:.2f} ms, WAL file {size >> 10} KiB, result {result}")


def main() -> None:
    mode = sys.argv[1]
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    where = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("/tmp/walcut")
    where.mkdir(parents=True, exist_ok=True)
    for n in range(repeats):
        print(once(mode, where / f"db{n}"), flush=True)


if __name__ == "__main__":
    main()
