"""Storage engines compared on the server's workload: SQLite (WAL) against LMDB.

How this works: the data directory keeps SQLite in WAL mode unless a benchmark shows it
cannot hold the targets and a better-kept engine can.  Both engines get the
workload of :class:`clone.storage.Storage` under ``--fsync batch``: a *group*
of updates (one reactor turn) is one transaction that upserts each key into a
key table and appends each update to a log, then fsyncs.  The keys cycle
over 10,000 names, the values are ~100 bytes (a sequence, a uuid and the body,
as the server stores them).  Each group's commit is timed into an HDR
histogram; a *load* writes N keys in one transaction and then times what a
restart does: open the store and read every key into a dict.

SQLite: ``journal_mode=WAL``, ``synchronous=FULL`` (the server's settings for
batch), ``INSERT OR REPLACE`` into ``kv`` and ``log`` by ``executemany``.
LMDB: one environment, two named databases, ``sync=True`` (an fsync per
commit, its default durability), ``put`` per row.  The log is never trimmed
in either (the server trims in the same commit; that costs both alike).
"""

from __future__ import annotations

import gc
import shutil
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from clone.tools.histogram import LatencyHistogram

__all__ = ["ENGINES", "compare_engines"]

ENGINES: tuple[str, ...] = ("sqlite", "lmdb")
_CYCLE = 10_000
_UUID = b"u" * 16


class _Engine(Protocol):
    def commit(self, rows: Sequence[tuple[bytes, int, bytes]]) -> None: ...
    def bulk_load(self, n: int, body: bytes) -> None: ...
    def read_all(self) -> int: ...
    def close(self) -> None: ...


class _Sqlite:
    def __init__(self, path: Path) -> None:
        self.path = path / "engine.db"
        self.conn = sqlite3.connect(self.path, isolation_level=None)
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute("PRAGMA synchronous = FULL")
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS kv (key BLOB PRIMARY KEY, seq BLOB, uuid BLOB, "
            "body BLOB) WITHOUT ROWID"
        )
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS log (seq INTEGER PRIMARY KEY, key BLOB, uuid BLOB, "
            "body BLOB)"
        )

    def commit(self, rows: Sequence[tuple[bytes, int, bytes]]) -> None:
        conn = self.conn
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT OR REPLACE INTO kv (key, seq, uuid, body) VALUES (?, ?, ?, ?)",
            [(k, s.to_bytes(8, "big"), _UUID, b) for k, s, b in rows],
        )
        conn.executemany(
            "INSERT OR REPLACE INTO log (seq, key, uuid, body) VALUES (?, ?, ?, ?)",
            [(s, k, _UUID, b) for k, s, b in rows],
        )
        conn.execute("COMMIT")

    def bulk_load(self, n: int, body: bytes) -> None:
        conn = self.conn
        conn.execute("BEGIN")
        conn.executemany(
            "INSERT OR REPLACE INTO kv (key, seq, uuid, body) VALUES (?, ?, ?, ?)",
            ((b"/bench/load/%08d" % i, (i + 1).to_bytes(8, "big"), _UUID, body)
             for i in range(n)),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def read_all(self) -> int:
        conn = sqlite3.connect(self.path)
        try:
            rows = conn.execute("SELECT key, seq, uuid, body FROM kv")
            out = {k: (s, u, b) for k, s, u, b in rows}
        finally:
            conn.close()
        return len(out)

    def close(self) -> None:
        self.conn.close()


class _Lmdb:
    def __init__(self, path: Path) -> None:
        import lmdb

        self.path = path / "engine.lmdb"
        self.path.mkdir(parents=True, exist_ok=True)
        self.env = lmdb.open(str(self.path), map_size=8 << 30, max_dbs=2, sync=True)
        self.kv = self.env.open_db(b"kv")
        self.log = self.env.open_db(b"log")

    def commit(self, rows: Sequence[tuple[bytes, int, bytes]]) -> None:
        with self.env.begin(write=True) as txn:
            put, kv, log = txn.put, self.kv, self.log
            for key, seq, body in rows:
                s8 = seq.to_bytes(8, "big")
                put(key, s8 + _UUID + body, db=kv)
                put(s8, key + b"\0" + _UUID + body, db=log)

    def bulk_load(self, n: int, body: bytes) -> None:
        with self.env.begin(write=True) as txn:
            put, kv = txn.put, self.kv
            for i in range(n):
                put(b"/bench/load/%08d" % i, (i + 1).to_bytes(8, "big") + _UUID + body, db=kv)
        self.env.sync(True)

    def read_all(self) -> int:
        import lmdb

        self.env.close()  # a restart: the writer is gone (closing twice is harmless)
        env = lmdb.open(str(self.path), map_size=8 << 30, max_dbs=2, readonly=True, lock=False)
        try:
            kv = env.open_db(b"kv", create=False)
            with env.begin(db=kv, buffers=False) as txn:
                out = {k: (v[:8], v[8:24], v[24:]) for k, v in txn.cursor()}
        finally:
            env.close()
        return len(out)

    def close(self) -> None:
        self.env.close()


_FACTORIES: dict[str, Callable[[Path], _Engine]] = {"sqlite": _Sqlite, "lmdb": _Lmdb}


def _commit_latency(engine: _Engine, size: int, groups: int, body: bytes) -> dict[str, Any]:
    hist = LatencyHistogram()
    seq = 0
    elapsed = 0.0
    for g in range(groups + 10):
        rows = []
        for _ in range(size):
            seq += 1
            rows.append((b"/bench/key/%06d" % (seq % _CYCLE), seq, body))
        t0 = time.perf_counter()
        engine.commit(rows)
        took = time.perf_counter() - t0
        if g >= 10:  # the first few warm the caches
            hist.record_seconds(took)
            elapsed += took
    summary = hist.summary()
    return {
        "group": size,
        "commits": groups,
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "p99_9_ms": summary["p99_9_ms"],
        "max_ms": summary["max_ms"],
        "updates_per_s": round(size * groups / elapsed) if elapsed else 0,
    }


def compare_engines(
    base: Path,
    *,
    group_sizes: Sequence[int] = (1, 10, 100),
    groups: int = 1000,
    load_keys: int = 1_000_000,
    value_size: int = 100,
    engines: Sequence[str] = ENGINES,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Commit latency per group size and the ``load_keys`` load, for each engine, under ``base``."""
    body = b"v" * value_size
    out: dict[str, Any] = {"groups": groups, "load_keys": load_keys, "value_size": value_size,
                           "engines": {}}
    for name in engines:
        res: dict[str, Any] = {"commits": []}
        for size in group_sizes:
            where = base / f"{name}-commit-{size}"
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            engine = _FACTORIES[name](where)
            try:
                one = _commit_latency(engine, size, max(50, groups // max(1, size // 10)), body)
            finally:
                engine.close()
                shutil.rmtree(where, ignore_errors=True)
            res["commits"].append(one)
            if say:
                say(f"  engine {name:>6} group {size:>3}: p50 {one['p50_ms']:.3f} p99 "
                    f"{one['p99_ms']:.3f} p99.9 {one['p99_9_ms']:.3f} ms, "
                    f"{one['updates_per_s']:,} updates/s")
        where = base / f"{name}-load"
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        engine = _FACTORIES[name](where)
        try:
            gc.collect()
            gc.disable()  # as the server's load does: the GC would walk the growing dict
            try:
                t0 = time.perf_counter()
                engine.bulk_load(load_keys, body)
                written = time.perf_counter() - t0
                t0 = time.perf_counter()
                count = engine.read_all()
                read = time.perf_counter() - t0
            finally:
                gc.enable()
            size_mb = sum(f.stat().st_size for f in where.rglob("*") if f.is_file()) / 1e6
        finally:
            engine.close()
            shutil.rmtree(where, ignore_errors=True)
        if count != load_keys:
            raise RuntimeError(f"{name}: read back {count} of {load_keys} keys")
        res["load"] = {"keys": load_keys, "write_s": round(written, 3),
                       "read_s": round(read, 3), "size_mb": round(size_mb, 1)}
        if say:
            say(f"  engine {name:>6} {load_keys:,} keys: write {written:.2f} s, "
                f"read into a dict {read:.2f} s, {size_mb:.0f} MB")
        out["engines"][name] = res
    return out
