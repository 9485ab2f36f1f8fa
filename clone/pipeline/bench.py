"""Benchmark clone-pipeline load and export: rows/s at given table sizes.

Starts its own standalone clone-server on free loopback ports (and stops it at
the end), generates a table per size (key /bench/<n>/kNNNNNNN, a value of
--value-bytes), loads it with confirmed writes from the Spark executors, then
exports the store, and writes the numbers as JSON.

    scripts/bench_pipeline --rows 100000 1000000 --output results/bench_pipeline.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from clone.tools.procs import free_base_port

ROOT = Path(__file__).resolve().parents[2]

log = logging.getLogger(__name__)


def _make_table(path: Path, rows: int, value_bytes: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pad = b"x" * max(0, value_bytes - 8)
    chunk = 100_000
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        keys = [f"/bench/{rows}/k{i:08d}" for i in range(start, start + n)]
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
    parser.add_argument("--max-in-flight", type=int, default=64)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--output", default="results/bench_pipeline.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    logging.getLogger("py4j").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark.*")

    from clone.pipeline import jobs
    from clone.pipeline.session import build_session

    port = free_base_port()
    server_log = open(Path(tempfile.gettempdir()) / f"bench_pipeline_server_{port}.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "clone.server.cli", "--standalone", "--port", str(port),
         "--bind", "127.0.0.1"],
        cwd=ROOT, stdout=server_log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    servers = [f"tcp://127.0.0.1:{port}"]
    results = []
    try:
        spark = build_session(args.master, "clone-pipeline bench")
        with tempfile.TemporaryDirectory() as tmp:
            for rows in args.rows:
                table = Path(tmp) / f"t{rows}.parquet"
                _make_table(table, rows, args.value_bytes)
                load = jobs.load_table(
                    spark, servers, str(table), max_in_flight=args.max_in_flight,
                    rejects=os.path.join(tmp, "rejects"),
                )  # fmt: skip
                started = time.monotonic()
                meta = jobs.export_snapshot(spark, servers, os.path.join(tmp, f"export{rows}"),
                                            subtree=f"/bench/{rows}/")  # fmt: skip
                export_s = time.monotonic() - started
                entry = {
                    "rows": rows,
                    "value_bytes": args.value_bytes,
                    "load_written": load.written,
                    "load_total_s": round(load.seconds, 2),
                    "load_write_s": round(load.write_seconds, 2),
                    "load_rows_per_s": round(load.written / load.write_seconds),
                    "load_rows_per_s_end_to_end": round(load.written / load.seconds),
                    "load_partitions": load.partitions,
                    "export_rows": meta.rows,
                    "export_s": round(export_s, 2),
                    "export_rows_per_s": round(meta.rows / export_s),
                }
                log.info("%s", entry)
                results.append(entry)
    finally:
        server.terminate()
        server.wait(10)
        server_log.close()
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
