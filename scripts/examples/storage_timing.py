"""How long the data directory takes: start-up load, and one append() group's commit.

Prints the load time of a database of ``--keys`` keys (1M by default), then the
p50/p99/p99.9 latency of ``Storage.append`` groups of 1, 10 and 100 updates under
each fsync policy -- the reactor pays that once per loop turn.  The numbers go
into docs/benchmarks.md; they depend on the disk, so say which one.

    python scripts/examples/storage_timing.py [--keys 1000000] [--dir /some/disk]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from clone.storage import DATA_FILE, FsyncPolicy, Storage, write_state_file

GROUP_SIZES = (1, 10, 100)


def _entries(keys: int, value_size: int) -> dict[bytes, tuple[bytes, bytes, bytes, bytes]]:
    body = b"v" * value_size
    return {
        b"/bench/key/%08d" % i: ((i + 1).to_bytes(8, "big"), b"u" * 16, b"", body)
        for i in range(keys)
    }


def _percentile(sorted_values: list[float], q: float) -> float:
    index = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[index]


def time_load(base: Path, keys: int, value_size: int) -> None:
    data_dir = base / "load"
    data_dir.mkdir()
    started = time.perf_counter()
    write_state_file(data_dir / DATA_FILE, _entries(keys, value_size), sequence=keys, term=1)
    written = time.perf_counter() - started
    size_mb = (data_dir / DATA_FILE).stat().st_size / 1e6
    started = time.perf_counter()
    storage = Storage.open(data_dir, create=False)
    opened = time.perf_counter() - started
    try:
        started = time.perf_counter()
        loaded = storage.load()
        load_s = time.perf_counter() - started
    finally:
        storage.close()
    assert len(loaded.entries) == keys
    print(f"{keys} keys, {value_size}-byte values, {size_mb:.0f} MB file")
    print(f"  write_state_file {written:.2f} s   open (incl. quick_check) {opened:.2f} s   "
          f"load {load_s:.2f} s")


def time_appends(base: Path, policy: FsyncPolicy, size: int, groups: int,
                 value_size: int) -> list[float]:
    data_dir = base / f"append-{policy.value}-{size}"
    storage = Storage.open(data_dir, fsync=policy)
    body = b"v" * value_size
    latencies: list[float] = []
    seq = 0
    try:
        for g in range(groups + 10):
            updates = []
            for _ in range(size):
                seq += 1
                updates.append([b"/bench/key/%06d" % (seq % 10_000), seq.to_bytes(8, "big"),
                                b"u" * 16, b"", body])
            started = time.perf_counter()
            storage.append(updates, term=1, at=time.time(), keep_from=max(0, seq - 10_000))
            if g >= 10:  # the first few warm the page cache and statement cache
                latencies.append(time.perf_counter() - started)
    finally:
        storage.close()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--value-size", type=int, default=100)
    parser.add_argument("--groups", type=int, default=2000,
                        help="append() calls per case (fewer for big ALWAYS groups)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="clone-storage-timing-") as tmp:
        base = Path(tmp)
        time_load(base, args.keys, args.value_size)
        print(f"\nappend() latency in ms ({os.path.realpath(base)}, "
              f"{args.value_size}-byte values)")
        print(f"  {'policy':<7} {'group':>5} {'calls':>6} {'p50':>8} {'p99':>8} {'p99.9':>8} "
              f"{'updates/s':>10}")
        for policy in FsyncPolicy:
            for size in GROUP_SIZES:
                # ALWAYS commits every update: cap its cases at ~20k fsyncs.
                groups = args.groups if policy is not FsyncPolicy.ALWAYS else \
                    min(args.groups, max(200, 20_000 // size))
                lat = sorted(time_appends(base, policy, size, groups, args.value_size))
                rate = size * len(lat) / sum(lat)
                print(f"  {policy.value:<7} {size:>5} {len(lat):>6} "
                      f"{_percentile(lat, 0.5) * 1e3:>8.3f} {_percentile(lat, 0.99) * 1e3:>8.3f} "
                      f"{_percentile(lat, 0.999) * 1e3:>8.3f} {rate:>10.0f}")


if __name__ == "__main__":
    main()
