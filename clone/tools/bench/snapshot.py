"""The snapshot section: serve and sync times per store size, and the heartbeat meanwhile."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import zmq

from clone.errors import CloneError
from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.processes import MP, SNAP_SUBTREE, reap, watcher_main
from clone.tools.bench.profiling import Profiler
from clone.tools.bench.targets import load_keys, rss, running_target
from clone.tools.procs import ProcessGroup
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size, recv_frames
from clone.wire.protocol import BATCH_METADATA, KTHXBAI, KVBATCH

__all__ = ["run_snapshot"]

log = logging.getLogger(__name__)


def _raw_snapshot(
    ctx: zmq.Context[Any], endpoint: str, subtree: str, timeout: float, *, batched: bool = False
) -> dict[str, Any]:
    """ICANHAZ? until KTHXBAI on a raw DEALER, counting entries.

    The receive loop is :func:`clone.wire.frames.recv_frames`, as cheap as
    pyzmq allows (~3.5 us per entry here), so that the requester is not what
    limits the serve time; the socket has the caps of a snapshot DEALER.
    ``batched`` asks for our KVBATCH extension (entries counted from each
    batch's key lengths frame).
    """
    dealer = ctx.socket(zmq.DEALER)
    dealer.rcvhwm = 0
    cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
    if batched:
        dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
    dealer.connect(endpoint)
    try:
        t0 = time.monotonic()
        dealer.send_multipart([b"ICANHAZ?", subtree.encode()])
        count = 0
        first = 0.0
        deadline = t0 + timeout
        while True:
            try:
                frames = recv_frames(dealer)
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not dealer.poll(max(1, int(remaining * 1000))):
                    return {"complete": False, "entries": count, "seconds": None}
                continue
            head = frames[0]
            entries = 1
            if head == KVBATCH and len(frames) > 1:
                entries = len(frames[1]) // 4  # the key lengths: 4 bytes per entry
            if head == KTHXBAI:
                t1 = time.monotonic()
                return {
                    "complete": True,
                    "entries": count,
                    "seconds": round(t1 - t0, 4),
                    "first_entry_s": round(first - t0, 4) if count else None,
                }
            if count == 0:
                first = time.monotonic()
            count += entries
    finally:
        dealer.close(linger=0)


def _client_sync(endpoint: str, subtree: str, timeout: float) -> dict[str, Any]:
    """Time a real clone.Clone from construction to wait_synced()."""
    try:
        from clone import Clone
    except ImportError:
        return {"available": False}
    t0 = time.monotonic()
    with Clone([endpoint], subtree=subtree, command_timeout=30.0) as client:
        try:
            client.wait_synced(timeout)
        except CloneError as exc:
            return {"available": True, "seconds": None, "error": str(exc)}
        t1 = time.monotonic()
        # status() rather than items(): listing a million entries through the
        # agent's command pipe is not what is measured here.
        keys = client.status().keys
    return {"available": True, "seconds": round(t1 - t0, 4), "keys": keys}


def _max_gap(times: Sequence[float], start: float, end: float) -> float:
    """The longest silence between HUGZ that overlaps [start, end]."""
    if not times:
        return end - start
    gap = 0.0
    for a, b in itertools.pairwise(times):
        if b >= start and a <= end:
            gap = max(gap, b - a)
    if times[-1] < end:  # silence at the end is a gap too
        gap = max(gap, end - times[-1])
    return gap


def run_snapshot(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Serve and sync times per store size, with the heartbeat gap meanwhile."""
    runs: list[dict[str, Any]] = []
    hb = cfg.snapshot_heartbeat_ms / 1000.0
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        for n in cfg.snapshot_sizes:
            try:
                run = _snapshot_one(cfg, group, ctx, n)
            except Exception as exc:  # keep the other sizes
                log.exception("snapshot of %d keys failed", n)
                say(f"  snapshot {n:>9,} keys: FAILED: {exc}")
                runs.append({"keys": n, "error": repr(exc)})
                continue
            runs.append(run)
            sync = run["client_sync"]
            sync_text = f"{sync['seconds']}s" if sync.get("available") else "n/a"
            say(
                f"  snapshot {n:>9,} keys: served {run['serve_s']}s "
                f"(complete={run['serve_complete']}), batched {run['serve_batched_s']}s, "
                f"client sync {sync_text}, "
                f"max HUGZ gap {run['hugz_max_gap_s']}s (heartbeat {hb}s), "
                f"{run['bytes_per_key']} B/key"
            )
    finally:
        ctx.term()
    return {"runs": runs}


def _snapshot_one(
    cfg: BenchConfig, group: ProcessGroup, ctx: zmq.Context[Any], n: int
) -> dict[str, Any]:
    hb = cfg.snapshot_heartbeat_ms / 1000.0
    with running_target("clone", group, cfg.snapshot_heartbeat_ms) as target:
        time.sleep(0.3)
        rss0 = rss(target.pid)
        load_s = load_keys(ctx, target, n, cfg.value_size)
        time.sleep(0.3)
        rss1 = rss(target.pid)
        ready, results, stop = MP.Queue(), MP.Queue(), MP.Event()
        hugz = MP.Process(
            target=watcher_main,
            args=(0, target.out_endpoint, "hugz", 0, 3600.0, ready, results, stop),
            daemon=True,
        )
        hugz.start()
        try:
            ready.get(timeout=15)
            windows: list[tuple[float, float]] = []
            serves: list[dict[str, Any]] = []
            batched: list[dict[str, Any]] = []
            with Profiler(cfg.profile_dir, f"snapshot-{n}", target.pid) as prof:
                for _ in range(cfg.snapshot_repeats):
                    for out, batch in ((serves, False), (batched, True)):
                        t0 = time.monotonic()
                        out.append(
                            _raw_snapshot(
                                ctx, target.snapshot_endpoint, SNAP_SUBTREE, 60, batched=batch
                            )
                        )
                        windows.append((t0, time.monotonic()))
                        time.sleep(hb)
                t0 = time.monotonic()
                sync = _client_sync(target.snapshot_endpoint, SNAP_SUBTREE, 120)
                windows.append((t0, time.monotonic()))
            time.sleep(hb * 1.5)
            stop.set()
            hugz_times = results.get(timeout=15)["hugz"]
        finally:
            stop.set()
            reap([hugz])
    gaps = [_max_gap(hugz_times, a, b) for a, b in windows]
    ok_serves = [s for s in serves if s["complete"] and s["entries"] == n]
    ok_batched = [s for s in batched if s["complete"] and s["entries"] == n]
    run: dict[str, Any] = {
        "keys": n,
        "load_s": round(load_s, 3),
        "load_rate": round(n / load_s),
        "rss_before": rss0,
        "rss_after": rss1,
        "bytes_per_key": round((rss1 - rss0) / n, 1),
        "serve_s": min((s["seconds"] for s in ok_serves), default=None),
        "serve_all": serves,
        "serve_complete": len(ok_serves) == len(serves) and len(ok_batched) == len(batched),
        # Our KVBATCH extension, as our own client asks for it.
        "serve_batched_s": min((s["seconds"] for s in ok_batched), default=None),
        "serve_batched_all": batched,
        "client_sync": sync,
        "heartbeat_s": hb,
        "hugz_max_gap_s": round(max(gaps), 4) if gaps else None,
        "hugz_max_gap_during_sync_s": round(gaps[-1], 4),
        "hugz_missed": bool(gaps) and max(gaps) > 1.5 * hb,
    }
    if prof.summary:
        run["profile"] = prof.summary
    return run
