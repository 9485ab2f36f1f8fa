"""SQLite (WAL) against LMDB on the server's group-commit workload.

Groups of 1, 10 and 100 updates of ~100-byte values, each group one transaction
into a key table and an append log with an fsync; p50/p99/p99.9 commit latency
and updates/s per engine, then the time to write and to read back ``--keys``
keys.  The workload is :mod:`clone.tools.bench.engines`; ``scripts/bench
durability`` runs the same comparison next to the server's own numbers.
Needs ``pip install lmdb`` (the ``bench`` extra).  The numbers depend on the
disk: say which one.

    python scripts/examples/engine_compare.py [--keys 1000000] [--groups 1000] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from clone.tools.bench.engines import ENGINES, compare_engines


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys in the load test")
    parser.add_argument("--groups", type=int, default=1000,
                        help="commits per group size (a tenth of it for groups of 100)")
    parser.add_argument("--value-size", type=int, default=100)
    parser.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temporary directory under ./results;"
                        " /tmp may be tmpfs, where an fsync costs nothing)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    where = args.dir or Path("results")
    where.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=where, prefix="engine-compare-") as tmp:
        print(f"writing under {os.path.realpath(tmp)}")
        results = compare_engines(
            Path(tmp),
            groups=args.groups,
            load_keys=args.keys,
            value_size=args.value_size,
            engines=[e for e in args.engines.split(",") if e],
            say=print,
        )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
