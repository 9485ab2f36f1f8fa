"""The calls section: what compare-and-set and leases cost.

Four parts, each on fresh standalone servers, the cases of a part
interleaved in each repeat so that the machine's mood hits them alike:

* **rtt**: one process, one call in flight.  A ``set`` CALL? with
  ``if_sequence`` (the key's sequence from the previous reply) from a raw
  DEALER to the snapshot port, timed until its REPLY; alternating with it, the
  plain *confirmed* write: a KVSET to the collector, timed until the KVPUB
  carrying its uuid comes back.  On a server ``--in-memory`` and on one with
  ``--fsync batch`` (its data directory on a real disk, as the durability
  section's): a call's reply, like a KVPUB, is sent after the commit.
* **concurrency**: K DEALERs in one process (one call in flight each, a poller
  over them), for ``calls_seconds``: either each incrementing its own key
  (CAS on the sequence its last reply gave), or all incrementing one key,
  retrying on ``conflict`` with the ``current=`` the reply carries.  Calls/s,
  the latency of each call and of each successful increment (first attempt
  to ``ok``), the conflict rate, and the server's and the callers' CPU %.
  The contended run checks that the increments form one chain: each ``ok``
  was conditioned on the sequence of the ``ok`` before it (no lost update).
* **leases**: a driver process grants L leases (ttl ``calls_lease_ttl``,
  pipelined) and keeps each alive every ttl/3 with raw ``lease-keepalive``
  calls, on a schedule (its lag behind it is recorded), counting replies
  that are not ``ok`` (a lease that expired) and keepalives never answered
  (after the run it waits up to ``DRAIN_S`` for the answers still on their
  way: a starved host held some for seconds).  Once all are granted the
  keepalives are spread evenly over ttl/3: the grants come in bursts, and
  keepalives in the same bursts would hold the server's loop for
  milliseconds at a time (measured in a first run: plain-write p99 x10
  with 1,000 leases).  Once every lease is granted
  and one keepalive round went by: the server's CPU % over one ttl with
  nothing else going on, then the **latency** of plain writes at
  ``calls_write_rate``/s and the **throughput** of plain writes, measured
  as the latency and throughput sections measure them (:func:`.targets.traffic`,
  HDR histograms from the intended send time), against the same server
  with 0 leases, and with the most leases *held but not kept alive* (ttl
  one hour): the lease table alone, without the keepalive traffic.  The
  keepalives compete for the machine's two cores with
  the writer and the watcher: a slowdown is theirs, not the lease table's
  (plain writes do not touch it).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import random
import shutil
import statistics
import time
from collections.abc import Callable, Iterator
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import zmq

from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.leasedriver import DRAIN_S, lease_main, open_dealer
from clone.tools.bench.processes import MP, ZERO_SEQ, reap
from clone.tools.bench.targets import ServerOptions, Target, cpu_seconds, running_target, traffic
from clone.tools.drill.analysis import nearest_rank
from clone.tools.histogram import LatencyHistogram
from clone.tools.procs import ProcessGroup
from clone.wire.calls import (
    IF_SEQUENCE_PROPERTY,
    OP_SET,
    Reply,
    decode_reply,
    encode_call,
)
from clone.wire.codec import new_uuid
from clone.wire.frames import cap_message_size, recv_frames

__all__ = ["calls_tables", "run_calls"]

log = logging.getLogger(__name__)

IN_MEMORY = "in-memory"
RTT_MODES = (IN_MEMORY, "batch")
_KV_PREFIX = b"/bench/kv/"
_CAS_PREFIX = "/bench/cas/"
_HOT_KEY = "/bench/cas-hot"
_SUMMARY = ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")
#: The lease driver is one client holding every lease: lift the per-client quota.
_ONE_DRIVER = ServerOptions(extra=("--max-leases-per-client", "1000000"))
#: The leases of the held-not-kept-alive case: they outlive the run.
_IDLE_LEASE_TTL = 3600.0


# --------------------------------------------------------------------------
# Processes (module-level, for the spawn start method)


def _await_reply(dealer: zmq.Socket[Any], uuid: bytes, timeout: float = 10.0) -> Reply:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if dealer.poll(100):
            reply = decode_reply(dealer.recv_multipart())
            if reply.uuid == uuid:
                return reply
    raise TimeoutError(f"no REPLY to call {uuid.hex()} in {timeout} s")


def _await_kvpub(sub: zmq.Socket[Any], uuid: bytes, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sub.poll(100):
            frames = recv_frames(sub)
            if len(frames) >= 3 and frames[2] == uuid:
                return
    raise TimeoutError(f"no KVPUB of {uuid.hex()} in {timeout} s")


def rtt_main(snapshot_ep: str, in_ep: str, out_ep: str, n: int, value_size: int,
             results: Any) -> None:
    """``n`` sequential CAS calls, alternating with ``n`` confirmed KVSETs; both timed."""
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = open_dealer(ctx, snapshot_ep)
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    pub.connect(in_ep)
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, _KV_PREFIX)
    cap_message_size(sub)
    sub.connect(out_ep)
    body = b"c" * value_size
    try:
        # Warm-up: the subscription reaches the server, the DEALER is connected.
        deadline = time.monotonic() + 15
        while True:
            u = new_uuid()
            pub.send_multipart([_KV_PREFIX + b"warm", ZERO_SEQ, u, b"", b"w"])
            try:
                _await_kvpub(sub, u, 0.1)
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
        u = new_uuid()
        dealer.send_multipart(encode_call(OP_SET, u, _CAS_PREFIX + "warm", (), b"w"))
        _await_reply(dealer, u)
        cas, kv = LatencyHistogram(), LatencyHistogram()
        statuses: collections.Counter[str] = collections.Counter()
        key, kvkey, seq = _CAS_PREFIX + "rtt", _KV_PREFIX + b"rtt", 0
        mono = time.monotonic
        for _ in range(n):
            u = new_uuid()
            call = encode_call(OP_SET, u, key, ((IF_SEQUENCE_PROPERTY, str(seq)),), body)
            t0 = mono()
            dealer.send_multipart(call)
            reply = _await_reply(dealer, u)
            cas.record_seconds(mono() - t0)
            statuses[reply.status] += 1
            seq = reply.sequence if reply.ok else (reply.current or 0)
            u = new_uuid()
            msg = [kvkey, ZERO_SEQ, u, b"", body]
            t0 = mono()
            pub.send_multipart(msg)
            _await_kvpub(sub, u)
            kv.record_seconds(mono() - t0)
        results.put({"cas": cas.encode(), "kvset": kv.encode(), "statuses": dict(statuses)})
    finally:
        for s in (dealer, pub, sub):
            s.close(linger=0)
        ctx.term()


def callers_main(snapshot_ep: str, callers: int, contended: bool, seconds: float,
                 value_size: int, go: MpEvent, ready: Any, results: Any) -> None:
    """``callers`` DEALERs, one CAS increment in flight each, for ``seconds``."""
    ctx: zmq.Context[Any] = zmq.Context()
    socks = [open_dealer(ctx, snapshot_ep) for _ in range(callers)]
    body = b"i" * value_size
    try:
        for i, s in enumerate(socks):  # connected, and the server knows each
            u = new_uuid()
            s.send_multipart(encode_call(OP_SET, u, f"{_CAS_PREFIX}warm{i}", (), b"w"))
            _await_reply(s, u)
        ready.put(callers)
        go.wait(60)
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        keys = [_HOT_KEY if contended else f"{_CAS_PREFIX}{i}" for i in range(callers)]
        seqs = [0] * callers  # the sequence each caller believes its key has (0: absent)
        inflight: dict[bytes, tuple[int, float]] = {}  # uuid -> (caller, sent)
        attempt = [0.0] * callers  # when the increment under way was first tried
        call_lat, inc_lat = LatencyHistogram(), LatencyHistogram()
        statuses: collections.Counter[str] = collections.Counter()
        chain: list[tuple[int, int]] = []  # (if_sequence, sequence) of every ok
        oks = [0] * callers
        # The oldest increment still failing when the run ended: one that never
        # succeeded is in no histogram, so a caller starved by the others shows here.
        abandoned = 0.0
        index = {s: i for i, s in enumerate(socks)}
        mono = time.monotonic
        cpu0 = time.process_time()

        def send(i: int, now: float) -> None:
            u = new_uuid()
            socks[i].send_multipart(
                encode_call(OP_SET, u, keys[i], ((IF_SEQUENCE_PROPERTY, str(seqs[i])),), body))
            inflight[u] = (i, now)

        t_start = mono()
        end = t_start + seconds
        for i in range(callers):
            attempt[i] = t_start
            send(i, t_start)
        last = t_start
        hard = end + 30
        while inflight and mono() < hard:
            events = poller.poll(100)
            # In a random order: in the poller's, the first sockets would always
            # retry first, and a contended key would measure our loop's bias.
            random.shuffle(events)
            for s, _ in events:
                try:
                    reply = decode_reply(s.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    continue
                now = mono()
                i, sent = inflight.pop(reply.uuid, (index[s], now))
                call_lat.record_seconds(now - sent)
                statuses[reply.status if reply.status != "refused" else reply.reason] += 1
                last = now
                if reply.ok:
                    oks[i] += 1
                    inc_lat.record_seconds(now - attempt[i])
                    chain.append((seqs[i], reply.sequence))
                    seqs[i] = reply.sequence
                    attempt[i] = now
                elif reply.status == "conflict":
                    seqs[i] = reply.current or 0
                else:
                    attempt[i] = now
                if now < end:
                    send(i, now)
                elif not reply.ok:
                    abandoned = max(abandoned, now - attempt[i])
        elapsed = max(1e-9, last - t_start)
        chained = True
        if contended:
            prev = 0
            for cond, new in sorted(chain, key=lambda c: c[1]):
                chained = chained and cond == prev
                prev = new
        results.put({
            "elapsed_s": elapsed,
            "statuses": dict(statuses),
            "ok": statuses["ok"],
            "unanswered": len(inflight),
            "call": call_lat.encode(),
            "increment": inc_lat.encode(),
            "chained": chained,
            "ok_per_caller": [min(oks), max(oks)],
            "abandoned_s": abandoned,
            "cpu_s": time.process_time() - cpu0,
        })
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()


def _repeat(cfg: BenchConfig, rep: int) -> str:
    return f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else ""


def _ms(lat: dict[str, Any]) -> str:
    return (f"p50 {lat['p50_ms']:.3f} p99 {lat['p99_ms']:.3f} p99.9 {lat['p99_9_ms']:.3f}"
            f" max {lat['max_ms']:.3f} ms")


def _median_run(ones: list[dict[str, Any]], p99: Callable[[dict[str, Any]], float]
                ) -> dict[str, Any]:
    """The run with the median p99."""
    return sorted(ones, key=p99)[nearest_rank(len(ones), 50)]


def _get(q: Any, timeout: float, what: str) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue.Empty:
        raise RuntimeError(f"{what} did not report in {timeout:.0f} s") from None


def _rtt(cfg: BenchConfig, group: ProcessGroup, base: Path, say: Say) -> list[dict[str, Any]]:
    n = cfg.calls_rtt
    ones: dict[str, list[dict[str, Any]]] = {m: [] for m in RTT_MODES}
    for rep in range(cfg.repeats):
        for mode in RTT_MODES:
            opts = (ServerOptions() if mode == IN_MEMORY
                    else ServerOptions(base / f"server-{mode}", ("--fsync", mode)))
            with running_target("clone", group, cfg.server_heartbeat_ms, opts) as target:
                results = MP.Queue()
                p = MP.Process(target=rtt_main, args=(
                    target.snapshot_endpoint, target.in_endpoint, target.out_endpoint, n,
                    cfg.value_size, results), daemon=True)
                p.start()
                try:
                    got = _get(results, 60 + n / 100, "the CAS round-trip process")
                finally:
                    reap([p])
            one = {"cas": LatencyHistogram.decode(got["cas"]).summary(),
                   "kvset": LatencyHistogram.decode(got["kvset"]).summary(),
                   "statuses": got["statuses"]}
            ones[mode].append(one)
            say(f"  rtt {mode:>9}: CAS call {_ms(one['cas'])}; confirmed KVSET "
                f"{_ms(one['kvset'])} ({one['statuses']}){_repeat(cfg, rep)}")
    runs = []
    for mode, reps in ones.items():
        median = _median_run(reps, lambda o: o["cas"]["p99_ms"])
        runs.append({
            "mode": mode,
            "calls": n,
            "cas": median["cas"],
            "kvset": median["kvset"],
            "cas_vs_kvset_p50": round(median["cas"]["p50_ms"] / median["kvset"]["p50_ms"], 2)
            if median["kvset"]["p50_ms"] else None,
            "conflicts": sum(o["statuses"].get("conflict", 0) for o in reps),
            "repeats": [{"cas": {k: o["cas"][k] for k in _SUMMARY},
                         "kvset": {k: o["kvset"][k] for k in _SUMMARY}} for o in reps],
        })
    return runs


def _callers_once(cfg: BenchConfig, group: ProcessGroup, callers: int,
                  contended: bool) -> dict[str, Any]:
    with running_target("clone", group, cfg.server_heartbeat_ms) as target:
        go, ready, results = MP.Event(), MP.Queue(), MP.Queue()
        p = MP.Process(target=callers_main, args=(
            target.snapshot_endpoint, callers, contended, cfg.calls_seconds, cfg.value_size,
            go, ready, results), daemon=True)
        p.start()
        try:
            _get(ready, 30, "the callers")
            cpu0, t0 = sum(cpu_seconds(target.pid)), time.monotonic()
            go.set()
            got = _get(results, cfg.calls_seconds + 60, "the callers")
            cpu1, t1 = sum(cpu_seconds(target.pid)), time.monotonic()
        finally:
            go.set()
            reap([p])
    elapsed = got["elapsed_s"]
    calls = sum(got["statuses"].values())
    return {
        "calls_per_s": round(calls / elapsed),
        "ok_per_s": round(got["ok"] / elapsed),
        "statuses": got["statuses"],
        "conflict_rate": round(got["statuses"].get("conflict", 0) / calls, 4) if calls else None,
        "unanswered": got["unanswered"],
        "chained": got["chained"],
        "ok_per_caller": got["ok_per_caller"],
        "abandoned_ms": round(got["abandoned_s"] * 1000, 1),
        "call": LatencyHistogram.decode(got["call"]).summary(),
        "increment": LatencyHistogram.decode(got["increment"]).summary(),
        "server_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        "callers_cpu_pct": round(100 * got["cpu_s"] / elapsed, 1),
    }


def _concurrency(cfg: BenchConfig, group: ProcessGroup, say: Say) -> list[dict[str, Any]]:
    plan = [(k, c) for c in (False, True) for k in cfg.calls_concurrency]
    ones: dict[tuple[int, bool], list[dict[str, Any]]] = {p: [] for p in plan}
    for rep in range(cfg.repeats):
        for k, contended in plan:
            one = _callers_once(cfg, group, k, contended)
            ones[(k, contended)].append(one)
            what = "one key" if contended else "own keys"
            say(f"  {k:>3} callers, {what:>8}: {one['calls_per_s']:>6,} calls/s, "
                f"{one['ok_per_s']:>6,} ok/s, conflicts {one['conflict_rate']:.1%}, call p99 "
                f"{one['call']['p99_ms']:.2f} ms, increment p99 "
                f"{one['increment']['p99_ms']:.2f} ms, ok per caller {one['ok_per_caller']}, "
                f"longest unfinished {one['abandoned_ms']} ms; CPU server {one['server_cpu_pct']}% "
                f"callers {one['callers_cpu_pct']}%{'' if one['chained'] else ' NOT CHAINED'}"
                f"{_repeat(cfg, rep)}")
    runs = []
    for (k, contended), reps in ones.items():
        median = _median_run(reps, lambda o: o["call"]["p99_ms"])
        runs.append({
            "callers": k,
            "contended": contended,
            "seconds": cfg.calls_seconds,
            "ok_per_s_median": round(statistics.median(o["ok_per_s"] for o in reps)),
            "ok_per_s": [o["ok_per_s"] for o in reps],
            "calls_per_s_median": round(statistics.median(o["calls_per_s"] for o in reps)),
            "conflict_rate_median": statistics.median(o["conflict_rate"] or 0 for o in reps),
            "call": median["call"],
            "increment": median["increment"],
            "server_cpu_pct_median": statistics.median(o["server_cpu_pct"] for o in reps),
            "callers_cpu_pct_median": statistics.median(o["callers_cpu_pct"] for o in reps),
            "unanswered": sum(o["unanswered"] for o in reps),
            "refused": sum(n for o in reps for s, n in o["statuses"].items()
                           if s not in ("ok", "conflict")),
            "chained": all(o["chained"] for o in reps),
            "call_p99_repeats": [o["call"]["p99_ms"] for o in reps],
            "increment_p99_repeats": [o["increment"]["p99_ms"] for o in reps],
            "ok_per_caller_min": min(o["ok_per_caller"][0] for o in reps),
            "ok_per_caller_max": max(o["ok_per_caller"][1] for o in reps),
            "abandoned_max_ms": max(o["abandoned_ms"] for o in reps),
        })
    return runs


def _plain_writes(cfg: BenchConfig, target: Target) -> dict[str, Any]:
    """Plain-write latency at ``calls_write_rate``, then throughput, through ``target``."""
    rate, seconds = cfg.calls_write_rate, cfg.rate_seconds
    count = max(1, int(rate * seconds))
    writer, watchers = traffic(target, "latency", 1, count,
                               {"rate": rate, "seconds": seconds, "value_size": cfg.value_size},
                               deadline_s=seconds + 60, probes=1)
    merged = LatencyHistogram()
    for w in watchers:
        merged.merge(LatencyHistogram.decode(w["hist"]))
    n = cfg.calls_messages
    twriter, twatchers = traffic(target, "throughput", 1, n,
                                 {"messages": n, "value_size": cfg.value_size},
                                 deadline_s=60 + n / 1000, probes=1)
    rates = [w["received"] / (w["last"] - twriter["t_start"]) for w in twatchers
             if w["received"] and w["last"] > twriter["t_start"]]
    return {
        "latency": merged.summary(),
        "writer_lag_p99_ms": LatencyHistogram.decode(writer["lag"]).summary()["p99_ms"],
        "lost": writer["sent"] * len(watchers) - sum(w["received"] for w in watchers),
        "rate": round(min(rates)) if rates else 0,
        "delivered": round(sum(w["received"] for w in twatchers) / (n * len(twatchers)), 4),
    }


def _leases_once(cfg: BenchConfig, group: ProcessGroup, leases: int,
                 kept: bool, elsewhere: bool = False, batched: bool = False) -> dict[str, Any]:
    """One lease case.  ``elsewhere``: the control, the same driver keeping its
    leases alive on a second server while the plain writes go to the first, so
    what the driver and its server cost the two shared cores is told apart from
    what the measured server's keepalive handling costs it."""
    ttl = cfg.calls_lease_ttl if kept else _IDLE_LEASE_TTL
    with running_target("clone", group, cfg.server_heartbeat_ms, _ONE_DRIVER) as target, \
            _maybe_target(group, cfg, elsewhere) as other:
        ready, stop, results = MP.Event(), MP.Event(), MP.Queue()
        driver = None
        try:
            if leases:
                driven = other if other is not None else target
                driver = MP.Process(target=lease_main, args=(
                    driven.snapshot_endpoint, leases, ttl, kept, 500, ready, stop, results,
                    batched),
                    daemon=True)
                driver.start()
                if not ready.wait(30 + leases / 500):
                    raise RuntimeError(f"{leases:,} leases not granted in time")
                if kept:
                    time.sleep(ttl / 3 + 0.1)  # one keepalive round: the steady state
            cpu0, t0 = cpu_seconds(target.pid), time.monotonic()
            time.sleep(cfg.calls_lease_ttl)
            cpu1, t1 = cpu_seconds(target.pid), time.monotonic()
            run = _plain_writes(cfg, target)
            stop.set()
            drv = _get(results, 15 + DRAIN_S, "the lease driver") if driver is not None else None
        finally:
            stop.set()
            if driver is not None:
                reap([driver])
    run["leases"] = leases
    run["kept_alive"] = kept
    run["elsewhere"] = elsewhere
    run["batched"] = batched
    run["server_cpu_pct"] = round(100 * (sum(cpu1) - sum(cpu0)) / (t1 - t0), 1)
    run["server_main_cpu_pct"] = round(100 * (cpu1[0] - cpu0[0]) / (t1 - t0), 1)
    if drv is not None:
        run["driver"] = {
            **{k: drv[k] for k in ("granted", "grant_s", "keepalives", "keepalives_per_s",
                                   "statuses", "unanswered")},
            "lag": LatencyHistogram.decode(drv["lag"]).summary(),
            "reply": LatencyHistogram.decode(drv["reply"]).summary(),
        }
    return run


@contextlib.contextmanager
def _maybe_target(
    group: ProcessGroup, cfg: BenchConfig, wanted: bool
) -> Iterator[Target | None]:
    if not wanted:
        yield None
        return
    with running_target("clone", group, cfg.server_heartbeat_ms, _ONE_DRIVER) as other:
        yield other


def _lease_label(leases: int, kept: bool, elsewhere: bool, batched: bool = False) -> str:
    if elsewhere:
        how = " by batched keepalives" if batched else ""
        return f"{leases:,} kept alive{how} on another server (control)"
    if batched:
        return f"{leases:,} kept alive by batched keepalives"
    return f"{leases:,}" + ("" if kept else " held, no keepalives")


def _lease_cases(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """0 leases, then each of ``calls_leases`` kept alive a call per lease (what
    a client before batched keepalives sent) and with batched keepalives (what the agent
    sends now), the most held idle, the fewest kept alive (batched) on another server."""
    cases = [(0, True, False, False)]
    for n in cfg.calls_leases:
        cases += [(n, True, False, False), (n, True, False, True)]
    if cfg.calls_leases:
        cases.append((max(cfg.calls_leases), False, False, False))
        # The control drives batched keepalives, as the agent does: a call per
        # lease from the driver could not even grant 10,000 leases at ttl 3 s
        # on a loaded machine (they expired while it granted the rest).
        cases.append((min(cfg.calls_leases), True, True, True))
    ones: dict[tuple[int, bool, bool, bool], list[dict[str, Any]]] = {c: [] for c in cases}
    for rep in range(cfg.repeats):
        for leases, kept, elsewhere, batched in cases:
            one = _leases_once(cfg, group, leases, kept, elsewhere, batched)
            ones[(leases, kept, elsewhere, batched)].append(one)
            drv = one.get("driver")
            extra = (f"; {drv['keepalives_per_s']:,} keepalives/s, {drv['statuses']}, lag p99 "
                     f"{drv['lag']['p99_ms']:.1f} ms" if drv and kept else "")
            say(f"  {_lease_label(leases, kept, elsewhere, batched)} leases: server CPU "
                f"{one['server_cpu_pct']}% idle; plain "
                f"{cfg.calls_write_rate}/s {_ms(one['latency'])} (lost {one['lost']}); "
                f"throughput {one['rate']:,} msg/s{extra}{_repeat(cfg, rep)}")
    runs = []
    for (leases, kept, elsewhere, batched), reps in ones.items():
        median = _median_run(reps, lambda o: o["latency"]["p99_ms"])
        run: dict[str, Any] = {
            "leases": leases,
            "kept_alive": kept,
            "elsewhere": elsewhere,
            "batched": batched,
            "ttl": cfg.calls_lease_ttl if kept else _IDLE_LEASE_TTL,
            "server_cpu_pct_median": statistics.median(o["server_cpu_pct"] for o in reps),
            "server_cpu_pcts": [o["server_cpu_pct"] for o in reps],
            "write_rate": cfg.calls_write_rate,
            "latency": median["latency"],
            "writer_lag_p99_ms": median["writer_lag_p99_ms"],
            "lost": sum(o["lost"] for o in reps),
            "p99_repeats": [o["latency"]["p99_ms"] for o in reps],
            "messages": cfg.calls_messages,
            "rate_median": round(statistics.median(o["rate"] for o in reps)),
            "rates": [o["rate"] for o in reps],
            "delivered": min(o["delivered"] for o in reps),
        }
        drivers = [o["driver"] for o in reps if "driver" in o]
        if drivers and kept:
            run["keepalives_per_s_median"] = statistics.median(
                d["keepalives_per_s"] for d in drivers)
            run["keepalive_not_ok"] = sum(n for d in drivers for s, n in d["statuses"].items()
                                          if s != "ok")
            run["keepalive_unanswered"] = sum(d["unanswered"] for d in drivers)
            run["keepalive_lag_p99_ms"] = max(d["lag"]["p99_ms"] for d in drivers)
            run["keepalive_reply_p99_ms"] = statistics.median(
                d["reply"]["p99_ms"] for d in drivers)
            # The worst of each: a lease is lost only if the grants, a
            # keepalive's send and its answer together took longer than
            # its ttl allows (what a starved host does).
            run["keepalive_lag_max_ms"] = max(d["lag"]["max_ms"] for d in drivers)
            run["keepalive_reply_max_ms"] = max(d["reply"]["max_ms"] for d in drivers)
        if drivers:
            run["grant_s"] = statistics.median(d["grant_s"] or 0 for d in drivers)
        runs.append(run)
    base = runs[0]["rate_median"]
    ratios = {f"{r['leases']}_leases{'' if r['kept_alive'] else '_held_idle'}"
              f"{'_elsewhere' if r.get('elsewhere') else ''}"
              f"{'_batched' if r.get('batched') else ''}_vs_0":
              round(r["rate_median"] / base, 3) for r in runs[1:] if base}
    return {"runs": runs, "throughput_ratios": ratios}


def run_calls(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """CAS round trips, calls/s with concurrency, keepalive cost; see the module.

    A part that fails is recorded under ``errors``; the parts after it still run.
    """
    base = cfg.durability_dir or cfg.log_dir / "calls-data"
    base.mkdir(parents=True, exist_ok=True)
    parts: dict[str, Callable[[], Any]] = {
        "rtt": lambda: _rtt(cfg, group, base, say),
        "concurrency": lambda: _concurrency(cfg, group, say),
        "leases": lambda: _lease_cases(cfg, group, say),
    }
    out: dict[str, Any] = {"data_dir": str(base.resolve())}
    try:
        for name, part in parts.items():
            if name not in cfg.calls_parts:
                continue
            try:
                out[name] = part()
            except Exception as exc:
                log.exception("calls: %s failed", name)
                say(f"  {name} FAILED: {exc}")
                out.setdefault("errors", {})[name] = repr(exc)[:2000]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


# --------------------------------------------------------------------------
# Tables


def calls_tables(section: dict[str, Any], *, markdown: bool = False) -> list[tuple[str, str]]:
    """(title, table) pairs for the calls section's results."""
    from clone.tools.report import table

    out: list[tuple[str, str]] = []
    if "rtt" in section:
        rows = []
        for r in section["rtt"]:
            for what in ("cas", "kvset"):
                lat = r[what]
                rows.append([r["mode"], "CAS call -> REPLY" if what == "cas"
                             else "KVSET -> own KVPUB", r["calls"], lat["p50_ms"],
                             lat["p99_ms"], lat["p99_9_ms"], lat["max_ms"],
                             " / ".join(f"{x[what]['p99_ms']:.2f}" for x in r["repeats"])])
        out.append(("Calls: round trip, one in flight (ms; the repeat with the median CAS p99)",
                    table(["server", "write", "each", "p50", "p99", "p99.9", "max",
                           "p99 of each repeat"], rows, markdown=markdown)))
    if "concurrency" in section:
        out.append(("Calls: CAS increments with K callers (in memory; medians of the repeats)",
                    table(["callers", "keys", "ok/s", "each repeat", "calls/s", "conflicts",
                           "call p99 ms", "increment p99 ms (each repeat)",
                           "ok per caller (fewest-most)", "longest unfinished ms",
                           "server CPU %", "callers CPU %", "chain"],
                          [[r["callers"], "one" if r["contended"] else "own",
                            r["ok_per_s_median"], " / ".join(f"{x:,}" for x in r["ok_per_s"]),
                            r["calls_per_s_median"], f"{r['conflict_rate_median']:.1%}",
                            r["call"]["p99_ms"],
                            " / ".join(f"{x:.2f}" for x in r["increment_p99_repeats"]),
                            f"{r['ok_per_caller_min']:,}-{r['ok_per_caller_max']:,}",
                            r["abandoned_max_ms"],
                            r["server_cpu_pct_median"], r["callers_cpu_pct_median"],
                            ("ok" if r["chained"] else "BROKEN") if r["contended"] else "-"]
                           for r in section["concurrency"]], markdown=markdown)))
    if "leases" in section:
        runs = section["leases"]["runs"]
        out.append((f"Calls: leases kept alive every ttl/3 (ttl {runs[0]['ttl']:g} s) and "
                    "plain writes",
                    table(["leases", "keepalives/s", "not ok", "keepalive lag p99 ms",
                           "server CPU % (idle)", f"plain {runs[0]['write_rate']:,}/s p50 ms",
                           "p99 ms", "p99.9 ms", "p99 of each repeat", "lost",
                           "plain msg/s (median)", "each repeat"],
                          [[_lease_label(r["leases"], r["kept_alive"], r.get("elsewhere", False),
                                         r.get("batched", False)),
                            r.get("keepalives_per_s_median", "-"),
                            r.get("keepalive_not_ok", "-"), r.get("keepalive_lag_p99_ms", "-"),
                            r["server_cpu_pct_median"], r["latency"]["p50_ms"],
                            r["latency"]["p99_ms"], r["latency"]["p99_9_ms"],
                            " / ".join(f"{x:.2f}" for x in r["p99_repeats"]), r["lost"],
                            r["rate_median"], " / ".join(f"{x:,}" for x in r["rates"])]
                           for r in runs], markdown=markdown)
                    + ("\n\nplain throughput as a fraction of 0 leases: " + ", ".join(
                        f"{k.removesuffix('_vs_0').replace('_', ' ')} = {v:.0%}"
                        for k, v in section["leases"]["throughput_ratios"].items())
                       if section["leases"]["throughput_ratios"] else "")))
    for name, error in section.get("errors", {}).items():
        out.append((f"Calls: {name} FAILED", error))
    return out
