"""The store's memory budget: the default ``--max-bytes`` from the memory the process may use.

Why: a fixed default (it was 4 GiB) is wrong both ways.  In a 700 MB container
the store filled past what the process could hold and the kernel killed it, and
killed it again while it loaded the same data at the next start: a crash loop.
So the default is a fraction of the memory the process may use -- its cgroup's
limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, the smallest along the
way up the hierarchy), else the machine's ``MemTotal`` -- and a write beyond it
is refused ``full`` instead.

Why :data:`STORE_FRACTION` is 1/4: the store's counted bytes (keys, values,
properties) are not all the process holds.  Loading a data directory holds the
rows read from SQLite beside the store for a moment; the history (up to
``--history-bytes``), the snapshot and subscriber queues, SQLite's page cache,
the interpreter and per-key overhead all draw on the same memory.  A quarter
leaves three quarters for these, which covers the measured peaks of a load
(about twice the data) with room for the queues.

The parsing is pure (:func:`memory_limit`, :func:`default_max_bytes`), tested
with literal file contents; :func:`read_memory_limit` does the reading.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from clone.errors import DataDirTooBig

if TYPE_CHECKING:
    from clone.storage import Storage

__all__ = [
    "COLLECTOR_TURN_BYTES",
    "check_fits",
    "collector_hwm",
    "STORE_FRACTION",
    "MemoryLimit",
    "default_max_bytes",
    "memory_limit",
    "read_memory_limit",
]

log = logging.getLogger(__name__)

#: The share of the process's memory the store's bytes may take by default.
STORE_FRACTION = 0.25

#: A cgroup v1 "no limit" is a page-rounded 2**63-1; anything above this is no limit.
_UNLIMITED_ABOVE = 1 << 60

_CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True, slots=True)
class MemoryLimit:
    """How much memory the process may use, and where that figure came from."""

    nbytes: int
    #: ``"cgroup"`` or ``"MemTotal"``, for the log line that explains the default.
    source: str


def _parse_limit(text: str) -> int | None:
    """One cgroup limit file's value in bytes, or None for no limit (or garbage)."""
    value = text.strip()
    if not value or value == "max":
        return None
    try:
        n = int(value)
    except ValueError:
        return None
    if n <= 0 or n >= _UNLIMITED_ABOVE:
        return None
    return n


def _mem_total(meminfo: str) -> int | None:
    """``MemTotal`` from /proc/meminfo's text, in bytes."""
    for line in meminfo.splitlines():
        if line.startswith("MemTotal:"):
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                unit = parts[2].lower() if len(parts) > 2 else "kb"
                return int(parts[1]) * (1024 if unit == "kb" else 1)
    return None


def memory_limit(cgroup_limits: Iterable[str], meminfo: str) -> MemoryLimit | None:
    """The memory the process may use: the smallest cgroup limit, else ``MemTotal``.

    ``cgroup_limits`` are the texts of the limit files of the process's cgroup
    and its ancestors (any order); ``meminfo`` is /proc/meminfo's text.  A
    cgroup limit above the machine's memory is no limit.  None when neither says.
    """
    total = _mem_total(meminfo)
    limits = [n for n in map(_parse_limit, cgroup_limits) if n is not None]
    if limits and (total is None or min(limits) < total):
        return MemoryLimit(min(limits), "cgroup")
    if total is not None:
        return MemoryLimit(total, "MemTotal")
    return None


def default_max_bytes(limit: MemoryLimit | None, fallback: int = 4 * 1024**3) -> int:
    """The default ``--max-bytes``: :data:`STORE_FRACTION` of ``limit``, else ``fallback``."""
    if limit is None:
        return fallback
    return max(1, int(limit.nbytes * STORE_FRACTION))


#: Bytes of client updates one loop turn takes from the collector at most (the
#: rest wait in the socket, within its byte-derived high-water mark).
COLLECTOR_TURN_BYTES = 2 * 1024 * 1024


def collector_hwm(collector_bytes: int, largest: int, hwm: int) -> int:
    """The collector's RCVHWM: at most ``collector_bytes`` of ``largest``-byte
    messages (``MAXMSGSIZE``, which libzmq enforces), and at most ``hwm``
    (``--hwm``; 0: no count limit).  At least 1.

    Why: libzmq counts a pipe's messages, not its bytes.  At the default
    100,000 a writer's 512 KB updates could queue 50 GB in the server while it
    applied a few hundred a second; that, not the store, is what killed servers
    in a 700 MB cgroup.  Bounding the count by the largest message a writer may
    send bounds the bytes whatever it sends; small updates are hardly slowed,
    since libzmq refills the pipe while the loop drains it.
    """
    if largest < 1 or collector_bytes < 1:
        raise ValueError("collector_bytes and the largest message must be >= 1")
    by_bytes = max(1, collector_bytes // largest)
    return by_bytes if hwm == 0 else max(1, min(hwm, by_bytes))


def _cgroup_dirs(proc_cgroup: str, root: Path) -> list[Path]:
    """The directories of the process's memory cgroup and its ancestors that exist here."""
    found: list[Path] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _hid, controllers, rel = parts
        if controllers == "":
            base = root if (root / "cgroup.controllers").exists() else root / "unified"
        elif "memory" in controllers.split(","):
            base = root / "memory"
        else:
            continue
        found += _ancestors(base, rel)
    return found


def _ancestors(base: Path, rel: str) -> list[Path]:
    """``base/rel`` and its parents up to ``base``; when the mount's root is itself a
    cgroup (a container), ``rel`` is matched by dropping its leading parts."""
    names: Sequence[str] = [p for p in rel.split("/") if p]
    for start in range(len(names) + 1):
        here = base.joinpath(*names[start:])
        if here.is_dir():
            out = [here]
            while here != base:
                here = here.parent
                out.append(here)
            return out
    return []


def read_memory_limit(root: Path = _CGROUP_ROOT) -> MemoryLimit | None:
    """Read the process's memory limit from /proc and the cgroup file system."""
    texts: list[str] = []
    try:
        proc_cgroup = Path("/proc/self/cgroup").read_text()
    except OSError:
        proc_cgroup = ""
    for directory in _cgroup_dirs(proc_cgroup, root):
        for name in ("memory.max", "memory.limit_in_bytes"):
            try:
                texts.append((directory / name).read_text())
            except OSError:
                continue
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        meminfo = ""
    return memory_limit(texts, meminfo)


def check_fits(storage: Storage, max_bytes: int) -> None:
    """Raise :class:`DataDirTooBig` if ``storage`` holds more than ``max_bytes`` (0: no limit).

    Checked before loading: a store over its budget would refuse every write
    that grows it, and in a memory-limited container loading it is what gets
    the process killed, again at every restart.  Saying so and exiting (code 2)
    lets a supervisor and an operator see why.
    """
    if not max_bytes:
        return
    need = storage.logical_bytes()
    if need > max_bytes:
        raise DataDirTooBig(
            f"data directory {storage.path} holds {need} bytes of data, more than this "
            f"server's --max-bytes budget of {max_bytes}: give the process more memory, "
            "raise --max-bytes explicitly, or restore a smaller state"
        )
