"""Standalone state files: what ``clone backup`` writes and ``--restore`` reads.

A state file is a database in the data directory's format (``kv`` and ``meta``,
an empty ``log``) in one self-contained file, built aside and renamed into
place so that a reader never sees half of one.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Mapping
from pathlib import Path

from clone.errors import StorageError
from clone.storage.copying import temp_path
from clone.storage.files import replace_durably
from clone.storage.schema import (
    KV_COLUMNS,
    Entry,
    connect_readonly,
    create_schema,
    read_position,
    translate,
    verify,
)

__all__ = ["check_state_file", "write_state_file"]


def write_state_file(
    target: str | os.PathLike[str],
    entries: Mapping[bytes, Entry] | Iterable[tuple[bytes, Entry]],
    *,
    sequence: int,
    term: int,
) -> None:
    """Write ``entries`` at (``sequence``, ``term``) as a state file at ``target``."""
    path = Path(target)
    tmp = temp_path(path)
    items = entries.items() if isinstance(entries, Mapping) else entries
    try:
        tmp.unlink(missing_ok=True)
        conn = sqlite3.connect(tmp, isolation_level=None)
        try:
            # No journal while building: an unfinished temp file is thrown away.
            conn.execute("PRAGMA journal_mode = OFF")
            conn.execute("PRAGMA synchronous = OFF")
            conn.execute("BEGIN")
            create_schema(conn, sequence=sequence, term=term)
            conn.executemany(
                f"INSERT OR REPLACE INTO kv ({KV_COLUMNS}) VALUES (?, ?, ?, ?, ?)",
                ((key, *entry) for key, entry in items),
            )
            conn.execute("COMMIT")
            conn.execute("PRAGMA journal_mode = DELETE")
        finally:
            conn.close()
        replace_durably(tmp, path)
    except sqlite3.Error as exc:
        tmp.unlink(missing_ok=True)
        raise translate(exc, path, "writing") from exc
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise StorageError(
            f"cannot write {path}: {exc.strerror}; check the path, free space and modes"
        ) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_state_file(path: str | os.PathLike[str]) -> tuple[int, int, int]:
    """(keys, sequence, term) of a state file or database; raises like ``Storage.open``."""
    file = Path(path)
    conn = connect_readonly(file)
    try:
        verify(conn, file)
        sequence, term = read_position(conn, file)
        keys = conn.execute("SELECT count(*) FROM kv").fetchone()[0]
    except sqlite3.Error as exc:
        raise translate(exc, file, "checking") from exc
    finally:
        conn.close()
    return keys, sequence, term
