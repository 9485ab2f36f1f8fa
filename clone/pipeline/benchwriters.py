"""The load's writers without Spark: where a loaded row's CPU goes.

Starts a durable pair (as :mod:`clone.pipeline.bench` does), then runs
``--writers`` processes at once, each writing ``--rows`` rows (keys
``/bw/<run>/w<n>/node-NNNNNNN/cpu`` in key order, values of ``--value-bytes``)
through the load's own partition writer (:func:`clone.pipeline.writer.write_partition`
over Arrow batches, as ``mapInArrow`` hands them), and reports the CPU per row
written of the writers, of the primary and of the backup (``/proc``), the
wall clock, and the servers' own per-turn counters.  Several settings
(``--batch-rows``, ``--max-in-flight``) are run alternately in one sitting, so
that their ratios hold on a shared machine whose wall clock says little.
``--profile DIR`` writes one writer's cProfile per setting.

    PYTHONPATH=$PWD python -m clone.pipeline.benchwriters --writers 2 --rows 50000 \\
        --setting 64:256 --setting 256:1024 --repeat 2 --output results/benchwriters.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clone.pipeline.bench import ROOT, _cpu_seconds

log = logging.getLogger(__name__)


def _child(args: argparse.Namespace) -> int:
    """One writer process: build its Arrow batches, then write them."""
    import pyarrow as pa

    from clone.pipeline.writer import WriterConfig, _rows_of, write_partition

    pad = b"x" * max(0, args.value_bytes - 8)
    prefix = f"{args.prefix}w{args.index}/"
    keys = [f"{prefix}node-{i:07d}/cpu" for i in range(args.rows)]
    values = [b"%08d" % i + pad for i in range(args.rows)]
    table = pa.table({"key": keys, "value": pa.array(values, pa.binary()),
                      "ttl": pa.array([0.0] * args.rows, pa.float64())})  # fmt: skip
    batches = table.to_batches(max_chunksize=10_000)
    config = WriterConfig(servers=tuple(args.servers.split(",")),
                          batch_rows=args.batch_rows, max_in_flight=args.max_in_flight)  # fmt: skip
    profiler = cProfile.Profile() if args.profile else None
    cpu, wall = time.process_time(), time.monotonic()
    if profiler is not None:
        profiler.enable()
    result = write_partition(_rows_of(iter(batches)), config, args.index)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    out = {"written": result.written, "failed": result.failed, "error": result.error,
           "cpu_s": time.process_time() - cpu, "wall_s": time.monotonic() - wall}  # fmt: skip
    print(json.dumps(out))
    return 0


def _start_pair(tmpdir: str) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    from clone.tools.procs import free_base_port, free_port

    ports = [free_base_port(), free_base_port()]
    ha = [free_port(), free_port()]
    procs = []
    for i, role in enumerate(("primary", "backup")):
        other = 1 - i
        with open(Path(tmpdir) / f"{role}.log", "wb") as log_file:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "clone.server.cli", f"--{role}", "--port", str(ports[i]),
                 "--peer", f"127.0.0.1:{ports[other]}", "--ha-port", str(ha[i]),
                 "--peer-ha", f"127.0.0.1:{ha[other]}", "--bind", "127.0.0.1",
                 "--data-dir", os.path.join(tmpdir, f"{role}.data")],
                cwd=ROOT, stdout=log_file, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    return procs, [f"tcp://127.0.0.1:{p}" for p in ports]


#: The servers' own counters compared before and after a run (SIGUSR1's
#: ``stats:`` line: commits and their time, set-many calls and entries).
_STATS = ("commits", "commit_write_us", "commit_sync_us", "set_many_calls", "set_many_entries")


def _server_stats(tmpdir: str, procs: list[subprocess.Popen[bytes]]) -> list[dict[str, int]]:
    """Each server's ``stats:`` line, asked for with SIGUSR1 (its log)."""
    out = []
    for proc, role in zip(procs, ("primary", "backup"), strict=True):
        path = Path(tmpdir) / f"{role}.log"
        seen = path.read_bytes().count(b" stats: ")
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while path.read_bytes().count(b" stats: ") <= seen and time.monotonic() < deadline:
            time.sleep(0.05)
        lines = [ln for ln in path.read_bytes().splitlines() if b" stats: " in ln]
        stats = json.loads(lines[-1].split(b" stats: ", 1)[1]) if lines else {}
        out.append({k: int(stats.get(k) or 0) for k in _STATS})
    return out


def _run(args: argparse.Namespace, servers: list[str], procs: list[subprocess.Popen[bytes]],
         tmpdir: str, run: int, batch_rows: int, window: int,
         profile: str | None) -> dict[str, object]:  # fmt: skip
    before = [_cpu_seconds({p.pid}) for p in procs]
    status_before = _server_stats(tmpdir, procs)
    load = os.getloadavg()[0]
    started = time.monotonic()
    children = []
    for index in range(args.writers):
        cmd = [sys.executable, "-m", "clone.pipeline.benchwriters", "--child",
               "--servers", ",".join(servers), "--rows", str(args.rows),
               "--value-bytes", str(args.value_bytes), "--prefix", f"/bw/{run}/",
               "--index", str(index), "--batch-rows", str(batch_rows),
               "--max-in-flight", str(window)]  # fmt: skip
        if profile and index == 0:
            cmd += ["--profile", profile]
        children.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, cwd=ROOT))
    outs = []
    for child in children:
        stdout, _ = child.communicate(timeout=3600)
        outs.append(json.loads(stdout.decode().strip().splitlines()[-1]))
    wall = time.monotonic() - started
    after = [_cpu_seconds({p.pid}) for p in procs]
    status_after = _server_stats(tmpdir, procs)
    written = sum(int(o["written"]) for o in outs)
    per_row = 1e6 / max(1, written)
    deltas = [{k: a[k] - b[k] for k in _STATS}
              for a, b in zip(status_after, status_before, strict=True)]  # fmt: skip
    return {
        "batch_rows": batch_rows,
        "max_in_flight": window,
        "written": written,
        "failed": sum(int(o["failed"]) for o in outs),
        "wall_s": round(wall, 2),
        "rows_per_s": round(written / wall),
        "load_average_before": round(load, 1),
        "cpu_us_per_row_writers": round(sum(float(o["cpu_s"]) for o in outs) * per_row, 1),
        "cpu_us_per_row_primary": round((after[0] - before[0]) * per_row, 1),
        "cpu_us_per_row_backup": round((after[1] - before[1]) * per_row, 1),
        # The durable commit per row (write: the inserts and COMMIT; sync: fsync).
        "commit_us_per_row_primary": round(
            (deltas[0]["commit_write_us"] + deltas[0]["commit_sync_us"]) / max(1, written), 1
        ),
        "commit_us_per_row_backup": round(
            (deltas[1]["commit_write_us"] + deltas[1]["commit_sync_us"]) / max(1, written), 1
        ),
        "rows_per_commit_primary": round(written / max(1, deltas[0]["commits"]), 1),
        "servers_stats_delta": deltas,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--rows", type=int, default=50_000, help="rows per writer")
    parser.add_argument("--value-bytes", type=int, default=100)
    parser.add_argument("--setting", action="append", default=[],
                        help="BATCH_ROWS:MAX_IN_FLIGHT, repeatable (default 64:256)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--profile", help="directory for one writer's cProfile per run")
    parser.add_argument("--output", default="results/benchwriters.json")
    # A writer process (internal).
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--servers", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", default="/bw/", help=argparse.SUPPRESS)
    parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--batch-rows", type=int, default=64, help=argparse.SUPPRESS)
    parser.add_argument("--max-in-flight", type=int, default=256, help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING if args.child else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")  # fmt: skip
    if args.child:
        return _child(args)
    settings = [tuple(int(x) for x in s.split(":")) for s in args.setting or ["64:256"]]
    tmpdir = tempfile.mkdtemp(prefix="benchwriters_")
    procs, servers = _start_pair(tmpdir)
    results = []
    try:
        from clone.client.status import query_status

        deadline = time.monotonic() + 60
        while not any(s.get("role") == "active" for s in query_status(servers, timeout=2)):
            if time.monotonic() > deadline:
                raise RuntimeError("the pair did not become active")
        run = 0
        for _ in range(args.repeat):
            for batch_rows, window in settings:
                run += 1
                profile = None
                if args.profile:
                    Path(args.profile).mkdir(parents=True, exist_ok=True)
                    profile = os.path.join(args.profile, f"writer-{run}-{batch_rows}-{window}.prof")
                entry = _run(args, servers, procs, tmpdir, run, batch_rows, window, profile)
                log.info("%s", entry)
                results.append(entry)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    report = {"benchmark": "clone-pipeline writers without Spark", "writers": args.writers,
              "rows_per_writer": args.rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ",
              time.gmtime()), "data": tmpdir, "results": results}  # fmt: skip
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
