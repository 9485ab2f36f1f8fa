"""The durable data directory of one server.

``DIR/clone.db`` is a SQLite database in WAL mode holding the state (``kv``), a
bounded log of recent updates (``log``) and the position (``meta``: sequence,
term); ``DIR/LOCK`` keeps a second server out.  :class:`Storage` is plain
blocking I/O that the server's reactor calls once per loop turn (group commit),
so each call is short and bounded.

May import: :mod:`clone.errors` and :mod:`clone.release`.  Never zmq, tornado,
:mod:`clone.wire`, :mod:`clone.server` or :mod:`clone.client` (docs/architecture.md
says the same; tests/test_architecture.py checks it).

Modules: :mod:`.db` (Storage), :mod:`.schema` (the format and its checks),
:mod:`.lock` (the directory lock), :mod:`.checkpointer` (the WAL thread),
:mod:`.statefile`, :mod:`.copying` and :mod:`.restore` (files for backup and
restore), :mod:`.files` (fsync helpers).
"""

from __future__ import annotations

from clone.storage.db import Entry, FsyncPolicy, Loaded, Storage, Update
from clone.storage.restore import restore_into
from clone.storage.schema import DATA_FILE, FORMAT_VERSION
from clone.storage.statefile import check_state_file, write_state_file

__all__ = [
    "DATA_FILE",
    "FORMAT_VERSION",
    "Entry",
    "FsyncPolicy",
    "Loaded",
    "Storage",
    "Update",
    "check_state_file",
    "restore_into",
    "write_state_file",
]
