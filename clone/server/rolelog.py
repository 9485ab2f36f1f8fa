"""The failover history kept in the data directory, so a restart does not lose it.

How this works: the status page lists the server's last role changes
(``starting -> active``, ``passive -> active``, ...).  They were kept in
memory only, so every restart emptied the table while operators most want it
then.  A durable server now writes them to ``DATA_DIR/role-changes.json`` (a
JSON list of ``[unix time, from, to]``, oldest first, at most ``limit``)
whenever one happens, which is rare (a start, a failover), and reads them back
at start.  The file is advisory: one that cannot be read or written is logged
and ignored (the server never stops for it), and it is no part of the state a
backup or restore carries.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["FILE_NAME", "load_role_changes", "save_role_changes"]

log = logging.getLogger(__name__)

FILE_NAME = "role-changes.json"

RoleChange = tuple[float, str, str]


def load_role_changes(data_dir: str | os.PathLike[str], limit: int) -> list[RoleChange]:
    """The recorded changes, oldest first (at most ``limit``); [] if none or unreadable."""
    path = Path(data_dir) / FILE_NAME
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as exc:
        log.warning("ignoring the failover history in %s: %s", path, exc)
        return []
    out: list[RoleChange] = []
    for item in raw if isinstance(raw, list) else []:
        if (
            isinstance(item, list) and len(item) == 3
            and isinstance(item[0], int | float) and not isinstance(item[0], bool)
            and isinstance(item[1], str) and isinstance(item[2], str)
        ):  # fmt: skip
            out.append((float(item[0]), item[1][:32], item[2][:32]))
    return out[-limit:] if limit > 0 else []


def save_role_changes(data_dir: str | os.PathLike[str], changes: Iterable[RoleChange]) -> None:
    """Replace the file whole (written aside, then renamed); failures are logged."""
    path = Path(data_dir) / FILE_NAME
    tmp = path.with_name(FILE_NAME + ".tmp")
    try:
        tmp.write_text(json.dumps([list(c) for c in changes]), encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not record the failover history in %s: %s", path, exc)
