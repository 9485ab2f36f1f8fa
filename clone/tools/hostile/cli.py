"""``scripts/drill --scenario hostile [--attacks a,b] [--hold S] [--scale F]``."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from clone.tools.hostile.attacks import ATTACKS
from clone.tools.hostile.harness import HARNESS_ATTACKS, AttackResult, run_attack

__all__ = ["ALL_ATTACKS", "format_line", "main"]

#: In the order of the issue's table.
ALL_ATTACKS = (
    "sub-flood", "sub-flood-valid", "slow-subscribers", "snapshot-requesters",
    "snapshot-requesters-big",
    "memory-cgroup", "disk", "ws-viewers", "idle-http", "delete-lock",
)  # fmt: skip
assert set(ALL_ATTACKS) == set(ATTACKS) | set(HARNESS_ATTACKS)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_line(r: AttackResult) -> str:
    """One attack's numbers and verdict on one line."""
    rss = " ".join(f"{n[0]}:{_mb(r.rss_before.get(n))}->{_mb(r.rss_peak.get(n))}"
                   for n in ("primary", "backup"))
    disk = "/".join(f"{r.data_dir_bytes.get(n, 0) / 2**20:.1f}" for n in ("primary", "backup"))
    stored = "/".join(f"{r.store_bytes.get(n, 0) / 2**20:.1f}" for n in ("primary", "backup"))
    verdict = "PASS" if not r.failures else "FAIL: " + "; ".join(r.failures)
    return (f"{r.attack:24s} rss MB {rss:22s} hugz-gap {_s(r.longest_hugz_gap)} s "
            f"(at {_s(r.hugz_gap_at)}, harness {_s(r.hugz_gap_in_harness)}, host late"
            f" {r.host_wake_late_in_gap:.3f} in it, {r.host_wake_late:.3f} max)  "
            + (f"sync {_s(r.empty_store_sync)}/" if r.empty_store_sync is not None else "sync ")
            + f"{_s(r.baseline_sync)}->{_s(r.sync_under_attack)} s  "
            f"write p99 {_s(r.write_p99)} s ({r.writes_confirmed} ok, {r.write_errors} err)  "
            f"lost {r.confirmed_lost}  sigterm {_s(r.sigterm_seconds)} s  "
            f"disk MB {disk} (stored {stored})  {verdict}"
            + (f"  [{r.note.strip()}]" if r.note.strip() else ""))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/drill --scenario hostile",
                                description="Attacks on a pair's memory, descriptors and "
                                "loop, measured.")
    p.add_argument("--attacks", default=",".join(ALL_ATTACKS),
                   help=f"comma-separated, of: {', '.join(ALL_ATTACKS)} (default all)")
    p.add_argument("--hold", type=float, default=15.0,
                   help="seconds each attack is held once in place (default 15)")
    p.add_argument("--scale", type=float, default=1.0,
                   help="shrink the attacks' volumes (0 < F <= 1; default 1: the issue's)")
    p.add_argument("--rate", type=float, default=20.0, help="healthy confirmed writes/s")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--shared-session", action="store_true",
                   help="run the servers, the attack and the watcher in the drill's own session"
                   " (with the kernel's autogroups, one CPU share for all of them) instead of"
                   " one session each")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    attacks = [a.strip() for a in args.attacks.split(",") if a.strip()]
    unknown = [a for a in attacks if a not in ALL_ATTACKS]
    if unknown or not 0 < args.scale <= 1:
        print(f"drill: unknown attacks {unknown} or a bad --scale", file=sys.stderr)
        return 2
    out = args.out or Path("results") / f"drill-hostile-{time.strftime('%Y%m%d-%H%M%S')}"
    results = []
    for attack in attacks:
        r = run_attack(attack, out / attack, hold=args.hold, scale=args.scale, rate=args.rate,
                       say=lambda line: print(line, flush=True),
                       own_sessions=not args.shared_session)
        print(format_line(r), flush=True)
        results.append(r)
    (out / "results.json").write_text(json.dumps([r.as_dict() for r in results], indent=1))
    print(f"\n{sum(not r.failures for r in results)}/{len(results)} attacks pass;"
          f" results: {out / 'results.json'}")
    return 0 if all(not r.failures for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
