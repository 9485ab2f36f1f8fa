"""A transaction cut short (a killed process, a WAL cut mid-write) is not seen.

Reopening shows the last committed state exactly, never part of a group.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from clone.storage import DATA_FILE
from tests.storage.conftest import OpenStorage, upd


def test_wal_cut_in_the_last_commit(tmp_path: Path, open_storage: OpenStorage) -> None:
    live, copy = tmp_path / "live", tmp_path / "copy"
    storage = open_storage(live)
    storage.append([upd(b"a", 1, b"A"), upd(b"b", 2, b"B")], term=1, at=0.0)
    storage.append([upd(b"a", 3, b"A2"), upd(b"c", 4, b"C")], term=2, at=0.0)
    wal = live / (DATA_FILE + "-wal")
    assert wal.stat().st_size > 0  # no checkpoint ran: both groups are in the WAL
    # A copy of the files as a power cut could leave them: the tail of the WAL,
    # the second group's commit frame, never reached the disk.
    copy.mkdir()
    shutil.copy(live / DATA_FILE, copy / DATA_FILE)
    cut = (copy / (DATA_FILE + "-wal"))
    cut.write_bytes(wal.read_bytes()[:-100])

    loaded = open_storage(copy).load()
    assert {k: e[3] for k, e in loaded.entries.items()} == {b"a": b"A", b"b": b"B"}
    assert (loaded.sequence, loaded.term, len(loaded.history)) == (2, 1, 2)


def test_process_killed_before_commit(data_dir: Path, open_storage: OpenStorage) -> None:
    script = textwrap.dedent(f"""
        import os
        from clone.storage import FsyncPolicy, Storage
        s = Storage.open({str(data_dir)!r}, fsync=FsyncPolicy.OFF, checkpoint_interval=3600)
        f = lambda k, n, b: [k, n.to_bytes(8, "big"), b"u", b"", b]
        s.append([f(b"a", 1, b"A")], term=1, at=0.0)
        s.append([f(b"b", 2, b"B")], term=1, at=0.0)  # committed, not checkpointed
        conn = s._conn
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany("INSERT INTO kv VALUES (?, ?, ?, ?, ?)",
                         [(b"x%d" % i, b"\\0" * 8, b"u", b"", b"y" * 500) for i in range(5000)])
        conn.execute("UPDATE meta SET value = 99 WHERE name = 'sequence'")
        os._exit(0)  # killed mid-transaction: no COMMIT, no close
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=30,
                   cwd=Path(__file__).parents[2])
    loaded = open_storage(data_dir).load()
    assert set(loaded.entries) == {b"a", b"b"}
    assert loaded.sequence == 2
