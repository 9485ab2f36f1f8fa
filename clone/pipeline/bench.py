"""Benchmark clone-pipeline load, export and ``clone dump``: rows/s at given sizes.

Starts its own durable pair (primary and backup, data directories, on free
loopback ports; stopped at the end), generates a Parquet table per size (key
/bench/<n>/node-NNNNNNN/cpu, a value of --value-bytes), loads it with
confirmed writes from the Spark executors (end to end: Spark start excluded,
validation and the probe included), exports the store with the default
--timeout, lists it with ``clone dump`` with its defaults, and writes the
numbers as JSON.  Each size also reports the pair's failovers and its worst
heartbeat lateness (a loop stall) during the load, from the servers' STATUS.
Two sizes (100k and 1M) show the fixed cost: the difference of their times
over the difference of their rows is the marginal rate.

    scripts/bench_pipeline --rows 100000 1000000 --output results/bench_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from clone.tools.procs import free_base_port

ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger(__name__)


def _cpu_seconds(pids: set[int], *, tree: bool = False) -> float:
    """User + system CPU seconds of ``pids`` (and, with ``tree``, of all their
    descendants, with the children they reaped), from /proc; 0 where unreadable.

    On a machine shared with other work, wall-clock rates say little; the CPU
    a load costs per row says what an idle machine of as many cores could do.
    """
    stats: dict[int, tuple[int, float]] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
        stats[int(entry)] = (int(fields[1]), cpu)
    chosen = set(pids)
    if tree:
        grew = True
        while grew:
            more = {pid for pid, (ppid, _) in stats.items() if ppid in chosen} - chosen
            chosen |= more
            grew = bool(more)
    return sum(stats[pid][1] for pid in chosen if pid in stats)


def _make_table(path: Path, rows: int, value_bytes: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pad = b"x" * max(0, value_bytes - 8)
    chunk = 100_000
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        keys = [f"/bench/{rows}/node-{i:07d}/cpu" for i in range(start, start + n)]
        values = [b"%08d" % i + pad for i in range(start, start + n)]
        table = pa.table({"key": keys, "value": pa.array(values, pa.binary())})
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--max-in-flight", type=int, default=256)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--output", default="results/bench_pipeline.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    logging.getLogger("py4j").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark.*")

    from clone.client.status import query_status
    from clone.pipeline import jobs
    from clone.pipeline.session import build_session
    from clone.tools.procs import free_port

    ports = [free_base_port(), free_base_port()]
    ha = [free_port(), free_port()]
    tmpdir = tempfile.mkdtemp(prefix="bench_pipeline_")
    procs = []
    logs = []
    for i, role in enumerate(("primary", "backup")):
        other = 1 - i
        log_file = open(Path(tmpdir) / f"{role}.log", "wb")
        logs.append(log_file)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "clone.server.cli", f"--{role}", "--port", str(ports[i]),
             "--peer", f"127.0.0.1:{ports[other]}", "--ha-port", str(ha[i]),
             "--peer-ha", f"127.0.0.1:{ha[other]}", "--bind", "127.0.0.1",
             "--data-dir", os.path.join(tmpdir, f"{role}.data")],
            cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
        ))  # fmt: skip
    servers = [f"tcp://127.0.0.1:{p}" for p in ports]

    def stats() -> list[dict[str, object]]:
        return list(query_status(servers, timeout=10))

    def log_sizes() -> list[int]:
        return [os.path.getsize(Path(tmpdir) / f"{r}.log") for r in ("primary", "backup")]

    def worst_stall_ms(since: list[int]) -> int:
        """The servers' worst "heartbeat ran N ms late" (a blocked loop) since ``since``."""
        worst = 0
        for role, offset in zip(("primary", "backup"), since, strict=True):
            with open(Path(tmpdir) / f"{role}.log", "rb") as fh:
                fh.seek(offset)
                for m in re.finditer(rb"heartbeat ran (\d+) ms late", fh.read()):
                    worst = max(worst, int(m.group(1)))
        return worst

    results = []
    try:
        spark = build_session(args.master, "clone-pipeline bench")
        with tempfile.TemporaryDirectory() as tmp:
            for rows in args.rows:
                table = Path(tmp) / f"t{rows}.parquet"
                _make_table(table, rows, args.value_bytes)
                before, sizes = stats(), log_sizes()
                load_avg = os.getloadavg()[0]
                server_cpu = _cpu_seconds({p.pid for p in procs})
                spark_cpu = _cpu_seconds({os.getpid()}, tree=True) - _cpu_seconds(
                    {p.pid for p in procs}, tree=True
                )
                load = jobs.load_table(
                    spark, servers, str(table), max_in_flight=args.max_in_flight,
                    rejects=os.path.join(tmp, "rejects"),
                )  # fmt: skip
                after = stats()
                server_cpu = _cpu_seconds({p.pid for p in procs}) - server_cpu
                spark_cpu = (
                    _cpu_seconds({os.getpid()}, tree=True)
                    - _cpu_seconds({p.pid for p in procs}, tree=True)
                    - spark_cpu
                )
                load_avg_after = os.getloadavg()[0]
                started = time.monotonic()
                meta = jobs.export_snapshot(spark, servers, os.path.join(tmp, f"export{rows}"),
                                            subtree=f"/bench/{rows}/")  # fmt: skip
                export_s = time.monotonic() - started
                started = time.monotonic()
                dump = subprocess.run(
                    [sys.executable, "-m", "clone.client.cli", "--servers", ",".join(servers),
                     "dump", f"/bench/{rows}/"],
                    cwd=ROOT, capture_output=True, timeout=3600,
                )  # fmt: skip
                dump_s = time.monotonic() - started
                entry = {
                    "rows": rows,
                    "value_bytes": args.value_bytes,
                    "load_written": load.written,
                    "load_total_s": round(load.seconds, 2),
                    "load_write_s": round(load.write_seconds, 2),
                    "load_rows_per_s": round(load.written / load.write_seconds),
                    "load_rows_per_s_end_to_end": round(load.written / load.seconds),
                    "load_partitions": load.partitions,
                    "load_average_before_after": [round(load_avg, 1), round(load_avg_after, 1)],
                    # CPU per row written: the two servers, and this process
                    # with Spark's JVM and Python workers (the writers).
                    "load_cpu_us_per_row_servers": round(server_cpu * 1e6 / load.written),
                    "load_cpu_us_per_row_spark": round(spark_cpu * 1e6 / load.written),
                    "failovers": sum(
                        int(str(a.get("failovers") or 0)) - int(str(b.get("failovers") or 0))
                        for a, b in zip(after, before, strict=True)
                    ),
                    "worst_loop_stall_ms": worst_stall_ms(sizes),
                    "export_rows": meta.rows,
                    "export_s": round(export_s, 2),
                    "export_rows_per_s": round(meta.rows / export_s),
                    "dump_exit": dump.returncode,
                    "dump_lines": dump.stdout.count(b"\n"),
                    "dump_s": round(dump_s, 2),
                    "dump_error": dump.stderr.decode(errors="replace").strip()[-300:],
                }
                log.info("%s", entry)
                results.append(entry)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
        for log_file in logs:
            log_file.close()
    report = {
        "benchmark": "clone-pipeline load/export",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "master": args.master,
        "max_in_flight": args.max_in_flight,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
