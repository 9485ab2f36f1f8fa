"""``scripts/drill --scenario chaos``: the command line of one chaos run.

The drill's command line hands an argument list naming the chaos scenario
over to :func:`main` (also ``python -m clone.tools.chaos``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clone.progress import LOGGER_NAME as PROGRESS_LOGGER
from clone.tools.chaos.runner import ChaosConfig, run_chaos
from clone.tools.chaos.schedule import FAULT_KINDS

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scripts/drill --scenario chaos",
        description="Random, combined faults against a server pair under recorded "
        "traffic; then every guarantee checked on the saved history (docs/drills.md, Chaos).",
    )
    p.add_argument("--scenario", choices=("chaos",), default="chaos")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    p.add_argument("--seed", type=int, default=0, help="the fault plan's seed: same seed, "
                   "same plan")
    p.add_argument("--out", type=Path, default=None, help="output directory")
    p.add_argument("--faults", default=",".join(FAULT_KINDS),
                   help="fault kinds to draw from, comma-separated (default: all)")
    p.add_argument("--gap", type=float, nargs=2, default=(3.0, 8.0), metavar=("MIN", "MAX"),
                   help="seconds between two fault starts (default 3 8)")
    p.add_argument("--length", type=float, nargs=2, default=(1.0, 6.0), metavar=("MIN", "MAX"),
                   help="seconds a fault lasts (default 1 6)")
    p.add_argument("--heartbeat", type=int, default=250, metavar="MS")
    p.add_argument("--rate", type=float, default=8.0,
                   help="operations per second per writer and per incrementer")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger(PROGRESS_LOGGER).setLevel(logging.INFO)
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad:
        print(f"drill: unknown fault kind(s) {', '.join(bad)}; known: "
              f"{', '.join(FAULT_KINDS)}", file=sys.stderr)
        return 2
    out = args.out or Path("results") / f"chaos-{args.seed}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = ChaosConfig(duration=args.duration, seed=args.seed, out=out, kinds=kinds,
                      gap=tuple(args.gap), length=tuple(args.length),
                      heartbeat_ms=args.heartbeat, rate=args.rate)
    verdict = run_chaos(cfg, say=lambda line: print(line, flush=True))
    print()
    sys.stdout.write((out / "verdict.md").read_text())
    print(f"\nhistory: {out / 'history.jsonl'}\nverdict: {out / 'verdict.json'}, "
          f"{out / 'verdict.md'}\ntimeline: {out / 'timeline.png'}\n"
          f"judge again: python -m clone.tools.chaos.check {out}")
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
