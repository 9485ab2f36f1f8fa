"""``scripts/drill``: the command line of one drill."""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clone.progress import LOGGER_NAME as PROGRESS_LOGGER
from clone.tools.drill.client import DEFAULT_SHARED_KEYS
from clone.tools.drill.config import (
    CRASH_ORDERS,
    PARTITION_SCENARIOS,
    SCENARIOS,
    DrillConfig,
)
from clone.tools.drill.harness import run_drill
from clone.tools.drill.netns import NetnsUnavailable, preflight
from clone.tools.drill.upgrade import UpgradeError
from clone.wire.protocol import DEFAULT_HEARTBEAT_MS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/drill",
        description="Failover drill: a server pair, N writing clients, injected faults.",
    )
    p.add_argument("--scenario", required=True, choices=SCENARIOS)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--duration", type=float, default=30.0, help="seconds of writing")
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--rate", type=float, default=20.0, help="writes per second per client")
    p.add_argument("--confirm-every", type=int, default=4,
                   help="every k-th write is confirmed (0: none)")
    p.add_argument("--heartbeat", type=int, default=DEFAULT_HEARTBEAT_MS, metavar="MS",
                   help=f"servers' heartbeat (default {DEFAULT_HEARTBEAT_MS}, as the server's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault-at", type=float, default=0.35, help="fraction of the duration")
    p.add_argument("--ttl-per-tick", type=int, default=3, help="ttl-storm: ephemeral writes/tick")
    p.add_argument("--ttl-min", type=float, default=0.5)
    p.add_argument("--ttl-max", type=float, default=2.0)
    p.add_argument("--confirm-timeout", type=float, default=10.0)
    p.add_argument("--preload", type=int, default=0,
                   help="keys loaded before the clients start (outside /drill/), so a "
                   "restarted server syncs a real snapshot")
    p.add_argument("--shared-keys", type=int, default=DEFAULT_SHARED_KEYS,
                   help="keys every client also overwrites, one write per tick, so that a "
                   f"revert to an older value shows (default {DEFAULT_SHARED_KEYS}; 0: none)")
    p.add_argument("--lock-clients", type=int, default=3, metavar="N",
                   help="clients that also contend for one lock, so that its fencing tokens"
                   " are checked (default 3; 0: none)")
    p.add_argument("--lock-hold", type=float, default=0.05, metavar="S",
                   help="seconds each lock holder keeps it (default 0.05)")
    crash = p.add_argument_group("both-crash")
    crash.add_argument("--crash-order", choices=CRASH_ORDERS, default="primary-first",
                       help="which server is killed first (default primary-first)")
    crash.add_argument("--crash-gap", type=float, default=None, metavar="S",
                       help="seconds between the two kills (default 3 heartbeats)")
    crash.add_argument("--down-time", type=float, default=1.0, metavar="S",
                       help="seconds both stay down before the restart (default 1)")
    crash.add_argument("--restart-stagger", type=float, default=0.0, metavar="S",
                       help="seconds between the two restarts (default 0: together); "
                       "under the servers' --peer-wait")
    part = p.add_argument_group("partition-pair, partition-active, partition-split "
                                "(root: network namespaces)")
    part.add_argument("--partition-time", type=float, default=None, metavar="S",
                      help="seconds the cut lasts before it heals (default max(25%% of the "
                      "duration, one failover budget))")
    part.add_argument("--locks", type=int, default=None, metavar="N",
                      help="lock keys every client takes and releases with compare-and-set "
                      "(default 2 for partition-split, else 0)")
    part.add_argument("--island-reset", action="store_true",
                      help="partition-split: reset the island client's connections to the "
                      "passive (TCP RST) instead of dropping their packets")
    part.add_argument("--split-writes", type=int, default=0, metavar="N",
                      help="partition-split: the island client also writes N keys as fast as "
                      "it can during the split (e.g. 50000), and the drill checks that the "
                      "heal stalls neither server's loop by more than a heartbeat")
    up = p.add_argument_group("rolling-restart --upgrade-from")
    up.add_argument("--upgrade-from", metavar="REF", default=None,
                    help="start the pair on release REF (a git ref of this checkout, or a "
                    ".whl file), then restart each server onto this code in turn, backup "
                    "first (docs/operations.md, Upgrading)")
    up.add_argument("--release-cache", type=Path, default=None, metavar="DIR",
                    help="where REF's virtual environment is built and kept, by commit "
                    "(default $CLONE_RELEASE_CACHE, else ~/.cache/clone/releases)")
    # Diagnostic: servers without a data directory, to see the drill fail.
    p.add_argument("--in-memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--scenario=chaos" in argv or any(
            argv[i:i + 2] == ["--scenario", "chaos"] for i in range(len(argv))):
        # Random faults and a checker, with options of their own: clone.tools.chaos.
        from clone.tools.chaos.cli import main as chaos_main

        return chaos_main(argv)
    given = list(argv)
    if "--scenario=hostile" in given or any(
        pair == ("--scenario", "hostile") for pair in itertools.pairwise(given)
    ):  # its own flags: clone.tools.hostile.cli
        from clone.tools.hostile.cli import main as hostile_main

        rest = [a for a in given if a != "--scenario=hostile"]
        if "--scenario" in rest:
            i = rest.index("--scenario")
            del rest[i : i + 2]
        return hostile_main(rest)
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # The run's progress: a bar on a terminal, else a line every few seconds.
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)
    from clone.tools import report

    out = args.out or Path("results") / f"drill-{args.scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        cfg = DrillConfig(
            scenario=args.scenario, clients=args.clients, duration=args.duration, out=out,
            rate=args.rate, confirm_every=args.confirm_every, heartbeat_ms=args.heartbeat,
            seed=args.seed, fault_at=args.fault_at, ttl_per_tick=args.ttl_per_tick,
            ttl_min=args.ttl_min, ttl_max=args.ttl_max, confirm_timeout=args.confirm_timeout,
            preload=args.preload, shared_keys=args.shared_keys,
            lock_clients=args.lock_clients, lock_hold=args.lock_hold,
            crash_order=args.crash_order, crash_gap=args.crash_gap, down_time=args.down_time,
            restart_stagger=args.restart_stagger, in_memory=args.in_memory,
            partition_time=args.partition_time, island_reset=args.island_reset,
            locks=args.locks,
            upgrade_from=args.upgrade_from, release_cache=args.release_cache,
            split_writes=args.split_writes,
        )
    except ValueError as exc:
        print(f"drill: {exc}", file=sys.stderr)
        return 2
    try:
        if cfg.scenario in PARTITION_SCENARIOS:
            preflight()
        summary = run_drill(cfg, say=lambda line: print(line, flush=True))
    except NetnsUnavailable as exc:
        print(f"drill: {cfg.scenario} cannot run here: {exc}", file=sys.stderr)
        return 2
    except UpgradeError as exc:
        print(f"drill: --upgrade-from: {exc}", file=sys.stderr)
        return 2
    print()
    print(report.drill_text(summary))
    print(f"\nevents: {out / 'events.jsonl'}\nsummary: {out / 'summary.json'}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
