"""The security section: what CURVE and the ACL cost.

Side by side in one run, so that the machine's mood hits every mode alike,
three standalone servers ``--in-memory`` (no disk in the numbers):

* ``plain``: no security, the baseline;
* ``curve``: ``--curve-secret``/``--clients``, no ACL (every admitted client
  may do everything): the cost of the encryption and the ZAP handshake;
* ``curve-acl``: the same with ``--acl``; the writer and the watcher may do
  everything, and one more *restricted reader* (:func:`.processes.reader_main`)
  reads two prefixes only, so that the server checks every write, filters the
  stream and counts a view while the traffic runs.  The reader's counts are
  kept as a check: nothing outside its view, and its view heartbeats' counts
  equal what it received.

For each mode the **throughput** and the **latency** at ``security_rate``
updates/s are measured exactly as the throughput and latency sections
measure (their :func:`throughput_once` / :func:`latency_once`), the modes
interleaved in each repeat.  The throughput runs also record the server's CPU
time per message, its main thread (the Python loop: the ACL checks, the
view counts) apart from its libzmq I/O threads (where CURVE encrypts): unlike
the rates and the percentiles, that barely moves when others load the machine.
The keys are made fresh in the run's log directory and removed after it.
"""

from __future__ import annotations

import logging
import shutil
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from clone.security import keygen, load_secret
from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.latency import latency_once
from clone.tools.bench.processes import ClientCurve
from clone.tools.bench.targets import CurveOptions, ServerOptions
from clone.tools.bench.throughput import throughput_once
from clone.tools.drill.analysis import nearest_rank
from clone.tools.procs import ProcessGroup

__all__ = [
    "MODES",
    "PLAIN",
    "RESTRICTED_READ",
    "reader_ok",
    "run_security",
    "security_tables",
]

log = logging.getLogger(__name__)

PLAIN = "plain"
MODES = (PLAIN, "curve", "curve-acl")
#: What the restricted reader may read: about a ninth of the bench's keys
#: (``/bench/t/<i % 10000>`` and ``/bench/l/<i % 1000>`` starting with a 1).
RESTRICTED_READ = (b"/bench/t/1", b"/bench/l/1")
_WRITER, _READER = "bench", "reader"


def _acl_text() -> str:
    read = ", ".join(f'"{p.decode()}"' for p in RESTRICTED_READ)
    return (f'[client.{_WRITER}]\nread = [""]\nwrite = [""]\n\n'
            f"[client.{_READER}]\nread = [{read}]\nwrite = []\n")


def _options(base: Path) -> dict[str, ServerOptions]:
    """The three modes' server options; the certificates and the ACL made under ``base``."""
    secrets, clients = base / "secrets", base / "clients"
    shutil.rmtree(base, ignore_errors=True)
    _, server_secret = keygen(secrets, "server")
    server_public = load_secret(server_secret).public
    curve: dict[str, ClientCurve] = {}
    for name in (_WRITER, _READER):
        public, secret = keygen(secrets, name)
        clients.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(public, clients / public.name)
        pair = load_secret(secret)
        curve[name] = ClientCurve(pair.public, pair.secret, server_public)
    acl = base / "acl.toml"
    acl.write_text(_acl_text())
    no_acl = CurveOptions(server_secret, clients, curve[_WRITER])
    return {
        PLAIN: ServerOptions(),
        "curve": ServerOptions(curve=no_acl),
        "curve-acl": ServerOptions(curve=CurveOptions(
            server_secret, clients, curve[_WRITER], acl=acl, restricted=curve[_READER],
            restricted_read=RESTRICTED_READ)),
    }


def _repeat(cfg: BenchConfig, rep: int) -> str:
    return f" [repeat {rep + 1}/{cfg.repeats}]" if cfg.repeats > 1 else ""


def _reader(one: dict[str, Any]) -> str:
    r = one.get("restricted_reader")
    if r is None:
        return ""
    return (f"; restricted reader got {r['received']:,}, {r['outside_view']} outside its view,"
            f" {r['view_count_mismatches']}/{r['view_heartbeats']} view counts off")


def _throughput(cfg: BenchConfig, group: ProcessGroup, options: dict[str, ServerOptions],
                say: Say) -> dict[str, Any]:
    n = cfg.security_messages
    ones: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(cfg.repeats):
        for mode in MODES:
            one = throughput_once(cfg, group, "clone", 1, rep, options[mode], messages=n)
            ones[mode].append(one)
            cpu = one.get("server_cpu_us_per_msg", {})
            say(f"  throughput {mode:>9}: {one['rate']:>8,} msg/s (delivered "
                f"{one['delivered']:.1%}; server CPU us/msg: main {cpu.get('main_thread')}, "
                f"io {cpu.get('io_threads')}){_reader(one)}{_repeat(cfg, rep)}")
    runs: list[dict[str, Any]] = []
    for mode, reps in ones.items():
        rates = [o["rate"] for o in reps]
        run: dict[str, Any] = {"mode": mode, "messages": n,
                               "rate_median": round(statistics.median(rates)), "rates": rates,
                               "delivered": min(o["delivered"] for o in reps)}
        cpus = [o["server_cpu_us_per_msg"] for o in reps if "server_cpu_us_per_msg" in o]
        if cpus:
            run["server_cpu_us_per_msg"] = {
                k: round(statistics.median(c[k] for c in cpus), 2) for k in cpus[0]}
        readers = [o["restricted_reader"] for o in reps if "restricted_reader" in o]
        if readers:
            run["restricted_reader"] = readers
        profile = next((o["profile"] for o in reps if "profile" in o), None)
        if profile:
            run["profile"] = profile
        runs.append(run)
    plain = runs[0]["rate_median"]
    ratios = {f"{r['mode']}_vs_{PLAIN}": round(r["rate_median"] / plain, 3)
              for r in runs[1:] if plain}
    return {"runs": runs, "ratios": ratios}


def _latency(cfg: BenchConfig, group: ProcessGroup, options: dict[str, ServerOptions],
             say: Say) -> list[dict[str, Any]]:
    rate = cfg.security_rate
    ones: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for rep in range(cfg.repeats):
        for mode in MODES:
            one = latency_once(cfg, group, "clone", rate, 1, rep, options[mode])
            ones[mode].append(one)
            lat = one["latency"]
            say(f"  latency {mode:>9} {rate}/s: p50 {lat['p50_ms']:.3f} p99 {lat['p99_ms']:.3f} "
                f"p99.9 {lat['p99_9_ms']:.3f} max {lat['max_ms']:.3f} ms (lost {one['lost']}, "
                f"writer lag p99 {one['writer_lag']['p99_ms']:.3f}){_reader(one)}"
                f"{_repeat(cfg, rep)}")
    runs = []
    for mode, reps in ones.items():
        ranked = sorted(reps, key=lambda o: o["latency"]["p99_ms"])
        median = ranked[nearest_rank(len(ranked), 50)]  # the run with the median p99
        run: dict[str, Any] = {
            "mode": mode,
            "rate": rate,
            "seconds": cfg.rate_seconds,
            "sent": median["sent"],
            "latency": dict(median["latency"]),
            "writer_lag_p99_ms": median["writer_lag"]["p99_ms"],
            "lost": sum(o["lost"] for o in reps),
            "repeats": [{k: o["latency"][k] for k in ("p50_ms", "p99_ms", "p99_9_ms", "max_ms")}
                        for o in reps],
        }
        readers = [o["restricted_reader"] for o in reps if "restricted_reader" in o]
        if readers:
            run["restricted_reader"] = readers
        if "profile" in median:
            run["profile"] = median["profile"]
        runs.append(run)
    return runs


def run_security(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Throughput and latency without CURVE, with it, and with it and an ACL; see the module.

    A part that fails is recorded under ``errors`` (and as a missed target);
    the part after it still runs.
    """
    base = cfg.log_dir / "security-keys"
    options = _options(base)
    parts: dict[str, Callable[[], Any]] = {
        "throughput": lambda: _throughput(cfg, group, options, say),
        "latency": lambda: _latency(cfg, group, options, say),
    }
    out: dict[str, Any] = {"restricted_read": [p.decode() for p in RESTRICTED_READ]}
    try:
        for name, part in parts.items():
            try:
                out[name] = part()
            except Exception as exc:
                log.exception("security: %s failed", name)
                say(f"  {name} FAILED: {exc}")
                out.setdefault("errors", {})[name] = repr(exc)[:2000]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return out


def reader_ok(readers: list[dict[str, Any]]) -> bool:
    """Whether every restricted reader got updates, none outside its view, counts equal."""
    return bool(readers) and all(
        r["received"] > 0 and r["outside_view"] == 0 and r["view_count_mismatches"] == 0
        for r in readers)


def security_tables(section: dict[str, Any], *, markdown: bool = False) -> list[tuple[str, str]]:
    """(title, table) pairs for the security section's results."""
    from clone.tools.report import table

    out: list[tuple[str, str]] = []
    if "throughput" in section:
        tput = section["throughput"]
        text = table(
            ["server", "messages", "msg/s (median)", "each repeat", "delivered",
             "server CPU us/msg: main thread", "I/O threads", "restricted reader"],
            [[r["mode"], r["messages"], r["rate_median"], " / ".join(f"{x:,}" for x in r["rates"]),
              f"{r['delivered']:.1%}", *_cpu_cells(r), _reader_cell(r)] for r in tput["runs"]],
            markdown=markdown,
        )
        if tput["ratios"]:
            text += "\n\nas a fraction of plain: " + ", ".join(
                f"{k.removesuffix('_vs_' + PLAIN)} = {v:.0%}" for k, v in tput["ratios"].items())
        out.append(("Security: throughput (1 subscriber)", text))
    if "latency" in section:
        runs = section["latency"]
        out.append((
            f"Security: latency at {runs[0]['rate']:,} updates/s (ms)",
            table(
                ["server", "p50", "p99", "p99.9", "max", "lost", "writer lag p99",
                 "p99 of each repeat", "restricted reader"],
                [[r["mode"], r["latency"]["p50_ms"], r["latency"]["p99_ms"],
                  r["latency"]["p99_9_ms"], r["latency"]["max_ms"], r["lost"],
                  r["writer_lag_p99_ms"], " / ".join(f"{x['p99_ms']:.2f}" for x in r["repeats"]),
                  _reader_cell(r)] for r in runs],
                markdown=markdown,
            ),
        ))
    for name, error in section.get("errors", {}).items():
        out.append((f"Security: {name} FAILED", error))
    return out


def _cpu_cells(run: dict[str, Any]) -> list[Any]:
    cpu = run.get("server_cpu_us_per_msg")
    return [cpu["main_thread"], cpu["io_threads"]] if cpu else ["-", "-"]


def _reader_cell(run: dict[str, Any]) -> str:
    readers = run.get("restricted_reader")
    if not readers:
        return "-"
    got = " / ".join(f"{r['received']:,}" for r in readers)
    return f"got {got}; " + ("filtered, view counts equal" if reader_ok(readers) else "WRONG")
