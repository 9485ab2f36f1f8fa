"""The durability section: what a data directory costs, and what it buys.

Side by side in one run, so that the machine's mood hits every mode alike:

* **throughput** and **latency** of a standalone server in memory and with
  ``--fsync batch|always|off``, measured exactly as the throughput and latency
  sections measure (their :func:`throughput_once` / :func:`latency_once`);
* **restart**: a data directory of N keys built directly with
  :func:`clone.storage.write_state_file` (what ``Storage.open`` accepts, at
  sequence N, term 1); time from starting the process until a snapshot request
  (ICANHAZ? for a subtree holding nothing) gets its KTHXBAI;
* **catch-up**: a durable primary + backup holding N keys; the backup follows
  one update, is killed (-9), misses M updates, is started again; time from its
  start until its log says ``synced from ... (catch-up)``, the catch-up's own
  time as it logs it, and its ``stats`` counters (a catch-up, not a full sync);
* **engines**: SQLite against LMDB on the same group-commit workload
  (:mod:`clone.tools.bench.engines`).
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import zmq

from clone.storage import DATA_FILE, write_state_file
from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.engines import compare_engines
from clone.tools.bench.latency import latency_once
from clone.tools.bench.redisref import (
    REDIS_ALWAYS,
    redis_latency_once,
    redis_server,
    redis_throughput_once,
)
from clone.tools.bench.targets import ServerOptions, Target, load_keys
from clone.tools.bench.throughput import throughput_once
from clone.tools.drill.analysis import nearest_rank
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    free_port,
    server_argv,
)
from clone.wire.protocol import COLLECTOR_OFFSET, KTHXBAI, PUBLISHER_OFFSET, SNAPSHOT_OFFSET

__all__ = ["durability_tables", "run_durability"]

log = logging.getLogger(__name__)

IN_MEMORY = "in-memory"
#: clone-server's default heartbeat (--heartbeat), when the bench does not set one.
_DEFAULT_HEARTBEAT_MS = 250
_LOADED = re.compile(rb"data directory .*?: (\d+) keys at sequence (\d+).*? loaded in ([\d.]+) s")
_SYNCED = re.compile(rb"synced from (\S+) \(([^)]+)\): (\d+) keys at sequence (\d+) in ([\d.]+) s")
_EMPTY_SUBTREE = b"/bench/nothing-here/"


def _options(base: Path, mode: str) -> ServerOptions:
    if mode == IN_MEMORY:
        return ServerOptions()
    return ServerOptions(base / f"server-{mode}", ("--fsync", mode))


def _throughput(cfg: BenchConfig, group: ProcessGroup, base: Path, say: Say) -> dict[str, Any]:
    modes = (IN_MEMORY, *cfg.durability_fsyncs, *_redis_mode(cfg, say))
    rates: dict[str, list[int]] = {m: [] for m in modes}
    delivered: dict[str, list[float]] = {m: [] for m in modes}
    servers: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(cfg.repeats):
        for mode in modes:
            if mode == REDIS_ALWAYS:
                one = redis_throughput_once(_redis_exe(), base / "redis", cfg.durability_messages,
                                            cfg.value_size)
            else:
                # A long idle wait: a stalled server (a turn of fsyncs) is slow, not done.
                one = throughput_once(cfg, group, "clone", 1, rep, _options(base, mode),
                                      messages=cfg.durability_messages, idle_s=30.0)
            rates[mode].append(one["rate"])
            delivered[mode].append(one["delivered"])
            servers[mode].append(one.get("server", {}))
            say(f"  throughput {mode:>12}: {one['rate']:>8,} msg/s (delivered "
                f"{one['delivered']:.1%}){_server_note(one.get('server', {}), cfg)}"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else ""))
    runs: list[dict[str, Any]] = [
        {"mode": m, "messages": cfg.durability_messages, "rate_median": round(
            statistics.median(rates[m])), "rates": rates[m], "delivered": min(delivered[m]),
         **_server_fields(servers[m], cfg)}
        for m in modes
    ]
    memory = next(r["rate_median"] for r in runs if r["mode"] == IN_MEMORY)
    ratios = {f"{r['mode']}_vs_in-memory": round(r["rate_median"] / memory, 3)
              for r in runs if r["mode"] != IN_MEMORY and memory}
    return {"runs": runs, "ratios": ratios}


def _latency(cfg: BenchConfig, group: ProcessGroup, base: Path, say: Say) -> list[dict[str, Any]]:
    floors = tuple(cfg.durability_floors)
    modes = (IN_MEMORY, *cfg.durability_latency_fsyncs, *_redis_mode(cfg, say), *floors)
    rate = cfg.durability_rate
    reps: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rep in range(cfg.repeats):
        for mode in modes:
            if mode == REDIS_ALWAYS:
                one = redis_latency_once(_redis_exe(), base / "redis", rate, cfg.rate_seconds,
                                         cfg.value_size)
            elif mode in floors:  # the same writer, hops and watcher, with no store at all
                one = latency_once(cfg, group, mode, rate, 1, rep)
            else:
                one = latency_once(cfg, group, "clone", rate, 1, rep, _options(base, mode))
            reps[mode].append(one)
            lat = one["latency"]
            say(f"  latency {mode:>12} {rate}/s: p50 {lat['p50_ms']:.3f} p99 {lat['p99_ms']:.3f} "
                f"p99.9 {lat['p99_9_ms']:.3f} max {lat['max_ms']:.3f} ms (lost {one['lost']}, "
                f"writer lag p99 {one['writer_lag']['p99_ms']:.3f})"
                f"{_server_note(one.get('server', {}), cfg)}"
                + (f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else ""))
    runs = []
    for mode, ones in reps.items():
        ranked = sorted(ones, key=lambda o: o["latency"]["p99_ms"])
        median = ranked[nearest_rank(len(ranked), 50)]  # the run with the median p99
        runs.append({
            "mode": mode,
            "rate": rate,
            "seconds": cfg.rate_seconds,
            "latency": {k: v for k, v in median["latency"].items()},
            "writer_lag_p99_ms": median["writer_lag"]["p99_ms"],
            "lost": sum(o["lost"] for o in ones),
            "repeats": [{k: o["latency"][k] for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")}
                        for o in ones],
            **_server_fields([o.get("server", {}) for o in ones], cfg),
            **({"profile": median["profile"]} if "profile" in median else {}),
        })
    return runs


def _redis_exe() -> str:
    exe = redis_server()
    assert exe is not None
    return exe


def _redis_mode(cfg: BenchConfig, say: Say) -> tuple[str, ...]:
    """The Redis ``appendfsync always`` row, when asked for and installed."""
    if not cfg.durability_redis:
        return ()
    if redis_server() is None:
        say("  redis-always: skipped, redis-server is not installed"
            " (Debian: apt-get install redis-server)")
        return ()
    return (REDIS_ALWAYS,)


def _server_note(server: dict[str, Any], cfg: BenchConfig) -> str:
    """The server's own account of a run: its worst heartbeat and its commits."""
    if not server:
        return ""
    note = f"; heartbeat max late {server.get('heartbeat_max_late_ms', '?')} ms"
    commits = server.get("commits")
    if commits:
        note += (f", {commits:,} commits: write {server['commit_write_us'] / commits:.0f} us"
                 f" + COMMIT {server['commit_sync_us'] / commits:.0f} us each,"
                 f" max {server['commit_max_us'] / 1000:.1f} ms")
    return note


def _server_fields(servers: list[dict[str, Any]], cfg: BenchConfig) -> dict[str, Any]:
    """Per mode: the worst heartbeat lateness over the repeats and, for durable
    servers, the mean commit's statement and COMMIT (fsync) times."""
    servers = [s for s in servers if s]
    if not servers:
        return {}
    late = max(int(s.get("heartbeat_max_late_ms", 0)) for s in servers)
    heartbeat_ms = cfg.server_heartbeat_ms or _DEFAULT_HEARTBEAT_MS
    out: dict[str, Any] = {"heartbeat_max_late_ms": late,
                           "heartbeat_late_over_interval": late > heartbeat_ms}
    commits = sum(int(s.get("commits", 0)) for s in servers)
    if commits:
        out["commits"] = commits
        out["commit_write_us_mean"] = round(
            sum(int(s["commit_write_us"]) for s in servers) / commits, 1)
        out["commit_sync_us_mean"] = round(
            sum(int(s["commit_sync_us"]) for s in servers) / commits, 1)
        out["commit_max_ms"] = round(max(int(s["commit_max_us"]) for s in servers) / 1000, 2)
        out["updates_per_commit"] = round(
            sum(int(s.get("sequence", 0)) for s in servers) / commits, 1)
    return out


def _entries(n: int, value_size: int) -> Iterator[tuple[bytes, tuple[bytes, bytes, bytes, bytes]]]:
    body = b"r" * value_size
    for i in range(n):
        yield (b"/bench/state/%08d" % i,
               ((i + 1).to_bytes(8, "big"), b"%016d" % i, b"", body))


def _build_data_dir(path: Path, keys: int, value_size: int) -> float:
    """A data directory holding ``keys`` keys at sequence ``keys``; seconds to write it."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    t0 = time.monotonic()
    write_state_file(path / DATA_FILE, _entries(keys, value_size), sequence=keys, term=1)
    return time.monotonic() - t0


def _wait_snapshot_answer(port: int, proc: ManagedProcess, timeout: float) -> None:
    """Block until an ICANHAZ? on ``port`` gets KTHXBAI (one DEALER, reconnecting fast)."""
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.reconnect_ivl = 5
    dealer.connect(f"tcp://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    try:
        # Queued until the connection is up: sent the moment the server listens.
        dealer.send_multipart([b"ICANHAZ?", _EMPTY_SUBTREE])
        while time.monotonic() < deadline:
            if dealer.poll(20) and dealer.recv_multipart()[0] == KTHXBAI:
                return
            if not proc.alive:
                raise RuntimeError(f"{proc.name} exited while starting:\n{proc.log_tail()}")
        raise TimeoutError(f"{proc.name} did not answer ICANHAZ? in {timeout} s")
    finally:
        dealer.close(linger=0)
        ctx.term()


def _loaded(proc: ManagedProcess, after: int) -> dict[str, Any]:
    with open(proc.log_path, "rb") as f:
        f.seek(after)
        m = _LOADED.search(f.read())
    if m is None:
        return {}
    return {"keys": int(m[1]), "sequence": int(m[2]), "load_s": float(m[3])}


def _restart(cfg: BenchConfig, group: ProcessGroup, base: Path, say: Say) -> dict[str, Any]:
    keys = cfg.durability_keys
    data = base / "restart"
    build_s = _build_data_dir(data, keys, cfg.value_size)
    say(f"  restart: built a {keys:,}-key data directory in {build_s:.1f} s")
    port = free_base_port(3)
    name = f"clone-restart-{len(group.procs)}"
    proc = group.add(name, server_argv("standalone", ServerAddress(name, port), data_dir=data),
                     start=False)
    runs = []
    try:
        for i in range(cfg.durability_restarts):
            offset = proc.log_size()
            t0 = time.monotonic()
            proc.start()
            _wait_snapshot_answer(port + SNAPSHOT_OFFSET, proc, 60 + keys / 20_000)
            serving = time.monotonic() - t0
            run = {"start": i + 1, "serving_s": round(serving, 3), **_loaded(proc, offset)}
            runs.append(run)
            say(f"  restart #{i + 1} with {keys:,} keys: serving after {serving:.2f} s"
                f" (loaded in {run.get('load_s', '?')} s by its log)")
            if run.get("keys") != keys:
                raise RuntimeError(f"{name} loaded {run.get('keys')} keys, not {keys}")
            proc.stop(timeout=30)  # a clean stop: the next start finds a checkpointed WAL
    finally:
        proc.stop(timeout=30)
        shutil.rmtree(data, ignore_errors=True)
    return {"keys": keys, "build_s": round(build_s, 2), "runs": runs,
            "serving_max_s": max(r["serving_s"] for r in runs)}


def _stats(proc: ManagedProcess, timeout: float = 10.0) -> dict[str, Any]:
    """The server's counters: SIGUSR1, then its ``stats: {json}`` line."""
    offset = proc.log_size()
    proc.signal(signal.SIGUSR1)
    end = proc.wait_log("stats: ", timeout, after=offset)
    deadline = time.monotonic() + timeout
    while True:
        with open(proc.log_path, "rb") as f:
            f.seek(end)
            rest = f.read()
        if b"\n" in rest or time.monotonic() > deadline:
            return dict(json.loads(rest.split(b"\n", 1)[0]))
        time.sleep(0.01)


def _wait_sequence(proc: ManagedProcess, sequence: int, timeout: float,
                   field: str = "sequence") -> dict[str, Any]:  # fmt: skip
    """``proc``'s stats once its ``field`` (``sequence``: applied;
    ``committed_sequence``: on disk) reaches ``sequence``."""
    deadline = time.monotonic() + timeout
    while True:
        stats = _stats(proc)
        if int(stats[field]) >= sequence:
            return stats
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} at {field} {stats[field]}, not {sequence}")
        time.sleep(0.1)


def _catch_up(cfg: BenchConfig, group: ProcessGroup, base: Path, say: Say) -> dict[str, Any]:
    keys, missed = cfg.durability_keys, cfg.durability_missed
    pdir, bdir = base / "primary", base / "backup"
    shutil.rmtree(bdir, ignore_errors=True)
    _build_data_dir(pdir, keys, cfg.value_size)
    me = ServerAddress("primary", free_base_port(3), free_port())
    peer = ServerAddress("backup", free_base_port(3), free_port())
    tag = len(group.procs)
    extra = ("--peer-wait", "0.5")
    load_timeout = 60 + keys / 20_000
    primary = group.add(f"clone-primary-{tag}",
                        server_argv("primary", me, peer, data_dir=pdir, extra=extra))
    backup = group.add(f"clone-backup-{tag}",
                       server_argv("backup", peer, me, data_dir=bdir, extra=extra), start=False)
    ctx: zmq.Context[Any] = zmq.Context()
    target = Target("clone-primary", f"tcp://127.0.0.1:{me.port + COLLECTOR_OFFSET}",
                    f"tcp://127.0.0.1:{me.port + PUBLISHER_OFFSET}", 0)
    try:
        # The primary goes active once it hears its peer (or a client's vote).
        t0 = time.monotonic()
        backup.start()
        primary.wait_log("now ACTIVE", load_timeout)
        backup.wait_log("synced from", load_timeout)
        first_sync_s = time.monotonic() - t0
        # The backup follows an update, so that it holds the last update itself
        # (what it names in its catch-up request), then dies.
        # On its disk, not only in its map: a kill -9 before the commit brings
        # it back one update short, at a sequence whose update the primary's
        # history (begun at its own load) does not hold, so it syncs in full.
        load_keys(ctx, target, 1, cfg.value_size)
        followed = _wait_sequence(backup, int(_stats(primary)["sequence"]), 30,
                                  field="committed_sequence")
        backup.kill9()
        load_keys(ctx, target, missed, cfg.value_size)
        primary_seq = int(_stats(primary)["sequence"])
        offset = backup.log_size()
        t0 = time.monotonic()
        backup.start()
        end = backup.wait_log("synced from", load_timeout, after=offset)
        synced_s = time.monotonic() - t0
        with open(backup.log_path, "rb") as f:
            f.seek(offset)
            line = f.read(end - offset + 200)
        m = _SYNCED.search(line)
        if m is None:
            raise RuntimeError(f"no 'synced from' line in {backup.name}'s log")
        after = _wait_sequence(backup, primary_seq, 30)
        loaded = _loaded(backup, offset)
    finally:
        ctx.term()
        backup.stop(timeout=30)
        primary.stop(timeout=30)
        shutil.rmtree(pdir, ignore_errors=True)
        shutil.rmtree(bdir, ignore_errors=True)
    result: dict[str, Any] = {
        "keys": keys,
        "missed_updates": primary_seq - int(followed["sequence"]),
        "first_full_sync_s": round(first_sync_s, 2),
        "kind": m[2].decode(),
        "catch_up_s": float(m[5]),
        "start_to_synced_s": round(synced_s, 3),
        "backup_load_s": loaded.get("load_s"),
        "keys_after": int(m[3]),
        "syncs_full": int(after.get("syncs_full", -1)),
        "syncs_catchup": int(after.get("syncs_catchup", -1)),
    }
    result["was_catch_up"] = (result["kind"] == "catch-up" and result["syncs_full"] == 0
                              and result["syncs_catchup"] >= 1)
    say(f"  catch-up of {result['missed_updates']:,} missed updates ({keys:,} keys): "
        f"{result['kind']} in {result['catch_up_s']:.3f} s by its log, "
        f"{synced_s:.2f} s from start (load {result['backup_load_s']} s); "
        f"syncs_full {result['syncs_full']}, syncs_catchup {result['syncs_catchup']}")
    return result


def run_durability(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Throughput, latency, restart, catch-up and the engine comparison; see the module.

    A part that fails is recorded under ``errors`` (and as a missed target);
    the parts after it still run.
    """
    base = cfg.durability_dir or cfg.log_dir / "durability-data"
    base.mkdir(parents=True, exist_ok=True)
    parts: dict[str, Callable[[], Any]] = {
        "throughput": lambda: _throughput(cfg, group, base, say),
        "latency": lambda: _latency(cfg, group, base, say),
        "restart": lambda: _restart(cfg, group, base, say),
        "catch_up": lambda: _catch_up(cfg, group, base, say),
        "engines": lambda: compare_engines(
            base / "engines",
            groups=cfg.engine_groups,
            load_keys=cfg.durability_keys,
            value_size=cfg.value_size,
            say=say,
        ),
    }
    out: dict[str, Any] = {"data_dir": str(base.resolve())}
    unknown = set(cfg.durability_parts) - set(parts)
    if unknown:
        raise ValueError(f"unknown durability parts {sorted(unknown)}; choose from {list(parts)}")
    try:
        for name, part in parts.items():
            if name not in cfg.durability_parts:
                continue
            try:
                out[name] = part()
            except Exception as exc:
                log.exception("durability: %s failed", name)
                say(f"  {name} FAILED: {exc}")
                out.setdefault("errors", {})[name] = repr(exc)[:2000]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def durability_tables(section: dict[str, Any], *, markdown: bool = False) -> list[tuple[str, str]]:
    """(title, table) pairs for the durability section's results."""
    from clone.tools.report import table

    out: list[tuple[str, str]] = []
    if "throughput" in section:
        out.append(_throughput_table(section["throughput"], table, markdown))
    if "latency" in section:
        out.append(_latency_table(section["latency"], table, markdown))
    if "restart" in section or "catch_up" in section:
        out.append(_recovery_table(section, table, markdown))
    if "engines" in section:
        out.append(_engines_table(section["engines"], table, markdown))
    for name, error in section.get("errors", {}).items():
        out.append((f"Durability: {name} FAILED", error))
    return out


_Table = Callable[..., str]


def _throughput_table(tput: dict[str, Any], table: _Table, markdown: bool) -> tuple[str, str]:
    text = table(
        ["server", "messages", "msg/s (median)", "each repeat", "delivered",
         *_SERVER_COLUMNS],
        [[r["mode"], r["messages"], r["rate_median"], " / ".join(f"{x:,}" for x in r["rates"]),
          f"{r['delivered']:.1%}", *_server_cells(r)] for r in tput["runs"]],
        markdown=markdown,
    )
    if tput["ratios"]:
        text += "\n\nas a fraction of in-memory: " + ", ".join(
            f"{k.removesuffix('_vs_in-memory')} = {v:.0%}" for k, v in tput["ratios"].items())
    return ("Durability: throughput (1 subscriber)", text)


def _latency_table(runs: list[dict[str, Any]], table: _Table, markdown: bool) -> tuple[str, str]:
    return (
        f"Durability: latency at {runs[0]['rate']:,} updates/s (ms)",
        table(
            ["server", "p50", "p99", "p99.9", "max", "lost", "writer lag p99",
             "p99 of each repeat", *_SERVER_COLUMNS],
            [[r["mode"], r["latency"]["p50_ms"], r["latency"]["p99_ms"], r["latency"]["p99_9_ms"],
              r["latency"]["max_ms"], r["lost"], r["writer_lag_p99_ms"],
              " / ".join(f"{x['p99_ms']:.2f}" for x in r["repeats"]), *_server_cells(r)]
             for r in runs],
            markdown=markdown,
        ),
    )


#: The server's own account of a mode's runs (clone rows only).
_SERVER_COLUMNS = ("heartbeat max late ms", "updates/commit", "statements us/commit",
                   "COMMIT us/commit", "longest commit ms")


def _server_cells(run: dict[str, Any]) -> list[Any]:
    if "heartbeat_max_late_ms" not in run:
        return ["-"] * len(_SERVER_COLUMNS)
    late = f"{run['heartbeat_max_late_ms']:,}" + (
        " (over 1 interval)" if run.get("heartbeat_late_over_interval") else "")
    if "commits" not in run:
        return [late, "-", "-", "-", "-"]
    return [late, run["updates_per_commit"], run["commit_write_us_mean"],
            run["commit_sync_us_mean"], run["commit_max_ms"]]


def _recovery_table(section: dict[str, Any], table: _Table, markdown: bool) -> tuple[str, str]:
    rows: list[list[Any]] = []
    if "restart" in section:
        rs = section["restart"]
        rows += [[f"restart #{r['start']}: start -> answers ICANHAZ?", rs["keys"], r["serving_s"],
                  f"load {r.get('load_s', '?')} s by its log"] for r in rs["runs"]]
    if "catch_up" in section:
        cu = section["catch_up"]
        rows.append([f"catch-up of {cu['missed_updates']:,} missed updates", cu["keys"],
                     cu["catch_up_s"], f"{cu['kind']}; start -> synced {cu['start_to_synced_s']} s"
                     f" (load {cu['backup_load_s']} s); syncs_full {cu['syncs_full']}, "
                     f"syncs_catchup {cu['syncs_catchup']}"])
    return ("Durability: restart and catch-up",
            table(["case", "keys", "measured s", "detail"], rows, markdown=markdown))


def _engines_table(eng: dict[str, Any], table: _Table, markdown: bool) -> tuple[str, str]:
    rows = []
    for name, res in eng["engines"].items():
        for c in res["commits"]:
            rows.append([name, c["group"], c["commits"], c["p50_ms"], c["p99_ms"], c["p99_9_ms"],
                         c["updates_per_s"]])
    text = table(["engine", "group", "commits", "p50 ms", "p99 ms", "p99.9 ms", "updates/s"],
                 rows, markdown=markdown)
    text += "\n\n" + table(
        ["engine", "keys", "write s", "read into a dict s", "MB"],
        [[n, r["load"]["keys"], r["load"]["write_s"], r["load"]["read_s"], r["load"]["size_mb"]]
         for n, r in eng["engines"].items()],
        markdown=markdown,
    )
    return ("Durability: storage engines, group commit with an fsync per group", text)
