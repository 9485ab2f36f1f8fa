"""The memory section: server RSS per key."""

from __future__ import annotations

import time
from typing import Any

import zmq

from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.targets import load_keys, rss, running_target
from clone.tools.procs import ProcessGroup

__all__ = ["run_memory"]


def run_memory(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Server RSS per key after loading keys with 100-byte values."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        with running_target("clone", group, cfg.server_heartbeat_ms) as target:
            time.sleep(0.3)
            rss0 = rss(target.pid)
            load_s = load_keys(ctx, target, cfg.memory_keys, cfg.value_size)
            time.sleep(0.5)
            rss1 = rss(target.pid)
    finally:
        ctx.term()
    per_key = (rss1 - rss0) / cfg.memory_keys
    say(
        f"  memory: {cfg.memory_keys:,} keys of {cfg.value_size} B: "
        f"RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, {per_key:.0f} B/key"
    )
    return {
        "keys": cfg.memory_keys,
        "value_size": cfg.value_size,
        "rss_empty": rss0,
        "rss_loaded": rss1,
        "bytes_per_key": round(per_key, 1),
        "load_rate": round(cfg.memory_keys / load_s),
    }
