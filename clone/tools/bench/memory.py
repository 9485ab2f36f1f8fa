"""The memory section: server RSS per key, in memory and durable, at each size.

The fleet-scale measure is the bytes per key *over* key+value (the key's and the
value's own bytes), at 100k and 1M keys in one run, for a server in memory
and one with a data directory.  Each (mode, size) gets a fresh standalone
server; RSS (psutil) before and after loading the keys with raw KVSETs, the
difference divided by the keys.  The keys are ``/bench/snap/NNNNNNN``
(19 bytes) and the values ``value_size`` bytes, sent 10,000 at a time (each
chunk applied before the next is sent): unpaced, the server's receive queue
of up to a million messages left its high-water in the RSS (the 100k figure
swung from 487 to 1,626 B/key between runs of the same code).

Why a durable server may differ: SQLite's page cache (bounded) and the
journal's rows between a turn's apply and its commit are in its RSS; the map
itself is the same.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import zmq

from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.processes import SNAP_SUBTREE
from clone.tools.bench.targets import ServerOptions, load_keys, rss, running_target
from clone.tools.procs import ProcessGroup

__all__ = ["run_memory"]

#: Keys sent before waiting for them to be applied.
_CHUNK = 10_000
#: The length of the keys load_keys writes: the subtree and seven digits.
_KEY_BYTES = len(SNAP_SUBTREE) + 7


def _one(cfg: BenchConfig, group: ProcessGroup, keys: int, server: ServerOptions,
         ctx: zmq.Context[Any]) -> dict[str, Any]:
    with running_target("clone", group, cfg.server_heartbeat_ms, server) as target:
        time.sleep(0.3)
        rss0 = rss(target.pid)
        # In chunks: the store's bytes, not the high-water of a queue of a
        # million messages the writer sent faster than the server applied them.
        load_s = load_keys(ctx, target, keys, cfg.value_size, chunk=_CHUNK)
        time.sleep(0.5)
        rss1 = rss(target.pid)
    per_key = (rss1 - rss0) / keys
    return {
        "mode": server.label,
        "keys": keys,
        "value_size": cfg.value_size,
        "key_size": _KEY_BYTES,
        "rss_empty": rss0,
        "rss_loaded": rss1,
        "bytes_per_key": round(per_key, 1),
        "over_key_value": round(per_key - _KEY_BYTES - cfg.value_size, 1),
        "load_rate": round(keys / load_s),
    }


def run_memory(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Server RSS per key after loading keys with 100-byte values: every size
    of ``memory_sizes`` (or ``memory_keys``), in memory and (with
    ``memory_durable``) with ``--fsync batch``."""
    sizes = cfg.memory_sizes or (cfg.memory_keys,)
    base = (cfg.durability_dir or cfg.log_dir / "memory-data")
    modes = [ServerOptions()]
    if cfg.memory_durable:
        modes.append(ServerOptions(Path(base) / "server", ("--fsync", "batch")))
    ctx: zmq.Context[Any] = zmq.Context()
    runs: list[dict[str, Any]] = []
    try:
        for keys in sizes:
            for server in modes:
                run = _one(cfg, group, keys, server, ctx)
                runs.append(run)
                say(f"  memory {run['mode']:>11}: {keys:,} keys of {cfg.value_size} B: RSS "
                    f"{run['rss_empty'] / 2**20:.1f} -> {run['rss_loaded'] / 2**20:.1f} MiB, "
                    f"{run['bytes_per_key']:.0f} B/key, {run['over_key_value']:.0f} B over"
                    " key+value")
    finally:
        ctx.term()
        shutil.rmtree(base, ignore_errors=True)
    first = runs[0]
    # The first in-memory run at the top level: what the report's table shows.
    return {**{k: first[k] for k in ("keys", "value_size", "rss_empty", "rss_loaded",
                                      "bytes_per_key", "load_rate")}, "runs": runs}
