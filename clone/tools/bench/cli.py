"""``scripts/bench``: the command line, its configuration and its output files."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from clone.progress import LOGGER_NAME as PROGRESS_LOGGER
from clone.tools.bench.calls import calls_tables
from clone.tools.bench.catchup import RESYNC_MODES
from clone.tools.bench.config import DEFAULT_SECTIONS, SECTIONS, BenchConfig
from clone.tools.bench.durability import durability_tables
from clone.tools.bench.run import run_benchmarks
from clone.tools.bench.security import security_tables
from clone.tools.bench.subscribers import subscribers_tables

__all__ = ["config_from_args", "main"]


#: Sections whose tables the report module does not know: printed after its text.
_TABLES = {"durability": durability_tables, "security": security_tables,
           "subscribers": subscribers_tables, "calls": calls_tables}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(float(x)) for x in text.split(",") if x)


def _words(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/bench",
        description="Benchmark clone-server against libzmq's C proxy and a raw pyzmq forwarder.",
    )
    p.add_argument("sections", nargs="*", metavar="SECTION",
                   help=f"sections to run, of {', '.join(SECTIONS)}"
                   f" (default: {', '.join(DEFAULT_SECTIONS)})")
    p.add_argument("--quick", action="store_true", help="tiny sizes, seconds per section")
    p.add_argument("--out", type=Path, default=Path("results/bench.json"), help="JSON results")
    p.add_argument("--plot", type=Path, default=None, help="PNG of latency against rate")
    p.add_argument("--md", type=Path, default=None,
                   help="markdown file whose generated section gets the results table")
    p.add_argument("--profile", type=Path, default=None,
                   help="directory for py-spy profiles of the server (needs py-spy)")
    p.add_argument(
        "--log-dir", type=Path, default=None, help="server logs (default: next to --out)"
    )
    p.add_argument("--messages", type=int, help="throughput: messages per run")
    p.add_argument("--subscribers", type=_ints, help="throughput: subscriber counts, e.g. 1,10")
    p.add_argument("--rates", type=_ints, help="latency: offered rates, e.g. 1000,2000,5000,10000")
    p.add_argument("--rate-seconds", type=float, help="latency: seconds per rate")
    p.add_argument("--snapshot-sizes", type=_ints, help="snapshot: key counts, e.g. 10000,100000")
    p.add_argument("--memory-keys", type=_ints,
                   help="memory: keys to load, or sizes, e.g. 100000,1000000")
    p.add_argument("--durability-keys", type=int,
                   help="durability: keys in the restart and catch-up data directories (1M)")
    p.add_argument("--durability-messages", type=int,
                   help="durability: messages per throughput run (20000)")
    p.add_argument("--durability-parts", type=_words,
                   help="durability: parts to run, of throughput,latency,restart,catch_up,engines"
                   " (all)")
    p.add_argument("--durability-fsyncs", type=_words,
                   help="durability: --fsync policies of the throughput and latency runs"
                   " (batch,always,off)")
    p.add_argument("--no-redis", action="store_true",
                   help="durability: no Redis appendfsync-always row even if redis-server exists")
    p.add_argument("--durability-floors", type=_words,
                   help="durability: store-less forwarders measured beside the latency rows, of"
                   " py-forwarder,c-proxy (both; '' for none)")
    p.add_argument("--durability-dir", type=Path,
                   help="durability, calls: where durable servers keep their data (default: in the"
                   " log directory; use a real disk, not tmpfs)")
    p.add_argument("--security-messages", type=int,
                   help="security: messages per throughput run (50000)")
    p.add_argument("--security-rate", type=int,
                   help="security: offered rate of the latency runs, updates/s (2000)")
    p.add_argument("--sub-counts", type=_ints,
                   help="subscribers: subscriber counts (1000,5000)")
    p.add_argument("--sub-rate", type=int, help="subscribers: updates/s of the fan-out runs (1000)")
    p.add_argument("--sub-relays", type=int, help="subscribers: relays (4)")
    p.add_argument("--sub-processes", type=int,
                   help="subscribers: processes holding the subscribers (4)")
    p.add_argument("--resync-keys", type=int, help="subscribers: keys of the resync run (10000)")
    p.add_argument("--resync-clients", type=int,
                   help="subscribers: snapshot requesters of the resync run (1000)")
    p.add_argument("--resync-topologies", type=_words,
                   help="subscribers: resync runs, of relays,direct (both)")
    p.add_argument("--resync-modes", type=_words,
                   help="subscribers: how the resync's clients ask, of full,catchup (both)")
    p.add_argument("--calls-rtt", type=int,
                   help="calls: sequential CAS calls (and confirmed KVSETs) per run (5000)")
    p.add_argument("--calls-concurrency", type=_ints,
                   help="calls: callers with one call in flight each (1,8,32)")
    p.add_argument("--calls-seconds", type=float, help="calls: seconds per concurrency run (5)")
    p.add_argument("--calls-leases", type=_ints,
                   help="calls: leases kept alive, each against 0 (1000,10000)")
    p.add_argument("--calls-lease-ttl", type=float,
                   help="calls: the leases' ttl; kept alive every ttl/3 (3)")
    p.add_argument("--calls-write-rate", type=int,
                   help="calls: plain writes/s measured next to the leases (2000)")
    p.add_argument("--calls-messages", type=int,
                   help="calls: plain writes of the throughput run next to the leases (20000)")
    p.add_argument("--calls-parts", type=_words,
                   help="calls: parts to run, of rtt,concurrency,leases (all)")
    p.add_argument("--repeats", type=int,
                   help="throughput/latency: runs of each case, median reported (default 3)")
    p.add_argument("--probes", type=int,
                   help="measuring watcher processes per run (the other subscribers are C sinks)")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    changes: dict[str, Any] = {}
    if args.sections:
        changes["sections"] = tuple(dict.fromkeys(args.sections))
    for arg, name in [
        ("messages", "throughput_messages"),
        ("subscribers", "subscriber_counts"),
        ("rates", "rates"),
        ("rate_seconds", "rate_seconds"),
        ("snapshot_sizes", "snapshot_sizes"),
        ("durability_keys", "durability_keys"),
        ("durability_messages", "durability_messages"),
        ("durability_dir", "durability_dir"),
        ("security_messages", "security_messages"),
        ("security_rate", "security_rate"),
        ("probes", "probes"),
        ("sub_counts", "sub_counts"),
        ("sub_rate", "sub_rate"),
        ("sub_relays", "sub_relays"),
        ("sub_processes", "sub_processes"),
        ("resync_keys", "resync_keys"),
        ("resync_clients", "resync_clients"),
        ("calls_rtt", "calls_rtt"),
        ("calls_concurrency", "calls_concurrency"),
        ("calls_seconds", "calls_seconds"),
        ("calls_leases", "calls_leases"),
        ("calls_lease_ttl", "calls_lease_ttl"),
        ("calls_write_rate", "calls_write_rate"),
        ("calls_messages", "calls_messages"),
        ("repeats", "repeats"),
    ]:
        value = getattr(args, arg)
        if value is not None:
            changes[name] = value
    if args.durability_fsyncs is not None:
        changes["durability_fsyncs"] = args.durability_fsyncs
        changes["durability_latency_fsyncs"] = args.durability_fsyncs
    if args.durability_floors is not None:
        unknown = set(args.durability_floors) - {"py-forwarder", "c-proxy"}
        if unknown:
            raise SystemExit(f"scripts/bench: --durability-floors takes py-forwarder and c-proxy,"
                             f" not {', '.join(sorted(unknown))}")
        changes["durability_floors"] = args.durability_floors
    if args.durability_parts is not None:
        changes["durability_parts"] = args.durability_parts
    if args.memory_keys is not None:
        changes["memory_keys"] = args.memory_keys[0]
        changes["memory_sizes"] = args.memory_keys
    if args.calls_parts is not None:
        changes["calls_parts"] = args.calls_parts
    if args.resync_topologies is not None:
        changes["resync_topologies"] = args.resync_topologies
    if args.resync_modes is not None:
        changes["resync_modes"] = args.resync_modes
    if args.no_redis:
        changes["durability_redis"] = False
    changes["profile_dir"] = args.profile
    changes["log_dir"] = args.log_dir or args.out.parent / (args.out.stem + "-logs")
    return BenchConfig.quick(**changes) if args.quick else replace(BenchConfig(), **changes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    unknown = [x for x in args.sections if x not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    bad = sorted(set(args.resync_topologies or ()) - {"relays", "direct"})
    if bad:
        parser.error(f"--resync-topologies: unknown {', '.join(bad)}; choose from relays, direct")
    bad = sorted(set(args.resync_modes or ()) - set(RESYNC_MODES))
    if bad:
        parser.error(f"--resync-modes: unknown {', '.join(bad)}; choose from "
                     f"{', '.join(RESYNC_MODES)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The run's progress: a bar on a terminal, else a line every few seconds.
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)
    from clone.tools import report

    cfg = config_from_args(args)
    command = "scripts/bench " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"clone bench: sections {', '.join(cfg.sections)}{' (quick)' if args.quick else ''}",
          flush=True)
    results = run_benchmarks(cfg, say=lambda line: print(line, flush=True), command=command)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print()
    print(report.bench_text(results))
    extra = [(tables, results["sections"][name]) for name, tables in _TABLES.items()
             if name in results["sections"]]
    for tables, section in extra:
        for title, body in tables(section):
            print(f"\n{title}\n{body}")
    print(f"\nresults: {args.out}")
    if args.plot is not None and "latency" in results["sections"]:
        report.plot_latency(results, args.plot)
        print(f"plot: {args.plot}")
    if args.md is not None:
        generated = report.bench_markdown(results)
        for tables, section in extra:
            generated += "".join(
                f"\n#### {title}\n\n{body}\n"
                for title, body in tables(section, markdown=True)
            )
        report.update_markdown(args.md, generated)
        print(f"markdown: {args.md}")
    if results.get("errors"):
        print(f"FAILED sections: {', '.join(results['errors'])}", file=sys.stderr)
        return 1
    return 0
