"""``clone-pipeline``: bulk load, export, history audits and drill reports on Spark.

Exit status: 0 done; 1 done, but some rows were rejected (load); 2 failure
(missing input or column, servers or Spark unreachable, writes that could not
be confirmed), with a one-line message on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Sequence

from clone.argtypes import positive_float, positive_int
from clone.pipeline.errors import InputError, PipelineError, is_spark_error, one_line

__all__ = ["main", "build_parser", "SPARK_COMMANDS"]

log = logging.getLogger("clone.pipeline")

EXIT_OK = 0
EXIT_REJECTED = 1
EXIT_FAILED = 2

#: The subcommands that start Spark, and so take --master and --conf (``package``
#: only writes files); spark-submit's driver script runs any of them.
SPARK_COMMANDS = ("load", "export", "history", "audit", "drill-report")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        """Usage errors exit 2 like every other failure (argparse's default too)."""
        self.print_usage(sys.stderr)
        self.exit(EXIT_FAILED, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from clone.pipeline import DEFAULT_MANIFEST, DEFAULT_REJECTS
    from clone.pipeline.session import DEFAULT_MASTER

    parser = _Parser(prog="clone-pipeline", description=__doc__.splitlines()[0] if __doc__ else "")
    _verbosity(parser, default=False)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--master",
            default=None,
            help="Spark master URL: local[N], local-cluster[N,C,MB], spark://host:port, yarn, "
            f"k8s://https://host:port (default {DEFAULT_MASTER}; under spark-submit, "
            "spark-submit's master wins)",
        )
        p.add_argument(
            "--conf",
            action="append",
            type=_spark_conf,
            default=[],
            metavar="spark.KEY=VALUE",
            help="a Spark setting, repeatable; over our defaults and spark-submit's",
        )
        # Before or after the subcommand, as docs/pipeline.md promises; SUPPRESS
        # keeps a subcommand that was not given -q from undoing a -q before it.
        _verbosity(p, default=argparse.SUPPRESS)

    def curve(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--curve-secret",
            default=None,
            metavar="FILE",
            help="this client's secret certificate NAME.key_secret, to connect with CURVE "
            "(default: $CLONE_CURVE_SECRET); needs --server-key",
        )
        p.add_argument(
            "--server-key",
            default=None,
            metavar="FILE",
            help="the pair's public certificate (default: $CLONE_SERVER_KEY); "
            "needs --curve-secret",
        )

    load = sub.add_parser("load", help="write a table into a running Clone pair")
    load.add_argument(
        "--servers", required=True, help="[tcp://]host:port[,[tcp://]host:port] of the pair"
    )
    load.add_argument("--input", required=True, help="table to load (file or directory)")
    load.add_argument("--format", default="parquet", choices=("parquet", "csv", "json"))
    load.add_argument("--key-col", default="key", help="column holding the key (default key)")
    load.add_argument("--value-col", default="value", help="column holding the value")
    load.add_argument("--ttl-col", default=None, help="column holding a ttl in seconds")
    load.add_argument("--subtree", default="", help="every key must start with this prefix")
    load.add_argument(
        "--rejects",
        default=DEFAULT_REJECTS,
        help="directory for rejected rows and their reasons, as JSON lines, replaced "
        f"(default ./{DEFAULT_REJECTS}, under the results/ output directory; written "
        "only when rows are rejected)",
    )
    load.add_argument(
        "--manifest",
        default=DEFAULT_MANIFEST,
        metavar="FILE",
        help="where to record what each partition confirmed, as JSON, replaced "
        f"(default ./{DEFAULT_MANIFEST})",
    )
    load.add_argument(
        "--resume",
        default=None,
        metavar="MANIFEST",
        help="the manifest of an earlier load of the same input: write only the rows it "
        "does not record as confirmed (and bring it up to date)",
    )
    load.add_argument(
        "--max-in-flight",
        type=positive_int,
        default=256,
        help="unconfirmed writes per partition (default 256)",
    )
    load.add_argument(
        "--confirm-timeout",
        type=positive_float,
        default=30.0,
        help="seconds to wait for a partition's writes to be confirmed, failovers included",
    )
    load.add_argument(
        "--heartbeat",
        type=positive_float,
        default=1.0,
        help="heartbeat in seconds to assume of servers that do not advertise theirs "
        "(default 1.0), for failover detection",
    )
    curve(load)
    common(load)

    export = sub.add_parser("export", help="write a consistent snapshot of the store as Parquet")
    export.add_argument(
        "--servers", required=True, help="[tcp://]host:port[,[tcp://]host:port] of the pair"
    )
    export.add_argument("--output", required=True, help="directory to write (replaced)")
    export.add_argument("--subtree", default="", help="export only keys under /this/subtree/")
    export.add_argument(
        "--timeout", type=positive_float, default=5.0, help="seconds to wait for a server"
    )
    curve(export)
    common(export)

    history = sub.add_parser(
        "history", help="write the servers' update history after a sequence as Parquet"
    )
    history.add_argument(
        "--servers", required=True, help="[tcp://]host:port[,[tcp://]host:port] of the pair"
    )
    history.add_argument(
        "--since", type=int, default=0, help="the updates after this sequence (default 0: all)"
    )
    history.add_argument("--output", required=True, help="directory to write (replaced)")
    history.add_argument(
        "--timeout", type=positive_float, default=3.0, help="seconds of silence before "
        "trying the next server (default 3)"
    )
    curve(history)
    common(history)

    audit = sub.add_parser(
        "audit", help="states, changes, write rates and differences from the update history"
    )
    audit.add_argument(
        "--input", required=True, nargs="+",
        help="data directories (DIR with clone.db) and/or history exports",
    )  # fmt: skip
    audit.add_argument("--output", required=True, help="directory for the tables and report.md")
    audit.add_argument(
        "--at", type=int, default=None, help="write the state at this sequence to state_at/ "
        "(default: the newest sequence held, if it can be reconstructed)"
    )
    audit.add_argument("--from", dest="from_seq", type=int, default=None,
                       help="diff/: the state at this sequence ...")  # fmt: skip
    audit.add_argument("--to", dest="to_seq", type=int, default=None,
                       help="... against the state at this one")  # fmt: skip
    audit.add_argument(
        "--prefix-depth", type=int, default=1, help="key prefix depth of rates/ (default 1: /a/)"
    )
    audit.add_argument(
        "--bucket", type=positive_int, default=1000,
        help="sequences per row of blocks/ (default 1000)",
    )  # fmt: skip
    audit.add_argument(
        "--rate-window", type=positive_float, default=60.0, metavar="SECONDS",
        help="rates/: writes per second per prefix over windows of this many seconds "
        "(default 60); needs the times a data directory's log records",
    )  # fmt: skip
    common(audit)

    package = sub.add_parser(
        "package", help="write clone.zip (for spark-submit --py-files) and the driver script"
    )
    package.add_argument("--output", required=True, help="directory to write them to")
    _verbosity(package, default=argparse.SUPPRESS)

    report = sub.add_parser("drill-report", help="analyse the event logs of drill runs")
    report.add_argument("--input", required=True, nargs="+", help="drill run directories")
    report.add_argument("--output", required=True, help="directory for report.md and report.png")
    common(report)
    return parser


def _verbosity(p: argparse.ArgumentParser, *, default: object) -> None:
    p.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging")
    p.add_argument(
        "-q", "--quiet", action="store_true", default=default, help="warnings and errors only"
    )


def _spark_conf(item: str) -> tuple[str, str]:
    from clone.pipeline.session import parse_conf

    try:
        return parse_conf(item)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _configure_logging(args: argparse.Namespace) -> None:
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    # py4j logs every gateway call at INFO.
    logging.getLogger("py4j").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark.*")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="pyspark.*")


def _drill_report(args: argparse.Namespace) -> int:
    from clone.pipeline import jobs
    from clone.pipeline.chaos import chaos_report, is_chaos_run
    from clone.pipeline.session import spark_session
    from clone.pipeline.sources import read_drill_summaries

    started = time.monotonic()
    # Chaos runs (scripts/drill --scenario chaos) keep a history.jsonl instead.
    chaos = [p for p in args.input if is_chaos_run(p)]
    inputs = [p for p in args.input if p not in chaos]
    runs = read_drill_summaries(inputs) if inputs else []  # fails fast, before Spark starts
    with spark_session(args.master, "clone-pipeline drill-report", dict(args.conf)) as spark:
        if chaos:
            got = chaos_report(spark, chaos, args.output)
            print(f"{got.runs} chaos run(s): {got.markdown}")
            if got.failed:
                print("chaos runs whose verdict failed: " + ", ".join(got.failed))
            for line in got.mismatches:
                print(f"differs from the checker's figures: {line}")
        if not runs:
            return EXIT_OK
        result = jobs.drill_report(spark, runs, args.output)
    print(f"{result.runs} run(s) analysed in {time.monotonic() - started:.1f}s")
    print(f"report: {result.markdown}")
    print(f"plot:   {result.plot}")
    if result.problems:
        print(
            "runs with lost/duplicate/out-of-order writes or no convergence: "
            + ", ".join(result.problems)
        )
    if result.mismatches:
        print(f"{result.mismatches} number(s) differ from the drills' summary.json (see report)")
    return EXIT_OK


def _curve_files(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The flags, else the environment, as ``clone`` does: never one of each."""
    from clone.client.frontend import default_curve_files

    if args.curve_secret is not None or args.server_key is not None:
        return args.curve_secret, args.server_key
    return default_curve_files()


def _history(args: argparse.Namespace) -> int:
    from clone.pipeline import jobs
    from clone.pipeline.session import spark_session
    from clone.pipeline.snapshot import parse_servers

    if args.since < 0:
        raise InputError(f"--since must be >= 0, not {args.since}")
    started = time.monotonic()
    servers = parse_servers(args.servers)
    curve = jobs.curve_keys(*_curve_files(args))
    with spark_session(args.master, "clone-pipeline history", dict(args.conf)) as spark:
        meta = jobs.export_history(
            spark, servers, args.since, args.output, silence=args.timeout, curve=curve
        )
    print(
        f"exported {meta['rows']} updates {args.since + 1}..{meta['until']} "
        f"to {args.output} in {time.monotonic() - started:.1f}s"
    )
    return EXIT_OK


def _audit(args: argparse.Namespace) -> int:
    from clone.pipeline import jobs
    from clone.pipeline.session import spark_session
    from clone.pipeline.sources import require_exists

    if (args.from_seq is None) != (args.to_seq is None):
        raise InputError("--from and --to go together")
    if args.prefix_depth < 0:
        raise InputError(f"--prefix-depth must be >= 0, not {args.prefix_depth}")
    for path in args.input:
        require_exists(path, "input")
    diff = None if args.from_seq is None else (args.from_seq, args.to_seq)
    with spark_session(args.master, "clone-pipeline audit", dict(args.conf)) as spark:
        result = jobs.audit(
            spark, args.input, args.output, at=args.at, diff=diff,
            depth=args.prefix_depth, bucket=args.bucket, rate_window=args.rate_window,
        )  # fmt: skip
    print(f"held:    {result.coverage} ({result.updates} updates)")
    if result.state_at is not None:
        print(f"state:   {result.state_keys} keys at sequence {result.state_at}")
    for note in result.notes:
        print(f"note:    {note}")
    if not result.timed:
        print("rates:   unknown (no update held has a time: history exported over the network)")
    elif result.timed < result.updates:
        print(f"rates:   from the {result.timed} of {result.updates} updates with a time")
    if diff is not None:
        print("diff:    " + ", ".join(f"{result.diff.get(k, 0)} {k}"
                                       for k in ("added", "removed", "changed")))  # fmt: skip
    if result.slowest is not None:
        name, secs = result.slowest
        total = sum(t for _, t in result.stages)
        print(f"time:    {total:.1f} s; slowest stage {name}, {secs:.1f} s ("
              + ", ".join(f"{n} {t:.1f}" for n, t in result.stages) + ")")  # fmt: skip
    print(f"report:  {result.markdown}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    from clone.pipeline import jobs
    from clone.pipeline.session import spark_session
    from clone.pipeline.snapshot import parse_servers

    started = time.monotonic()
    servers = parse_servers(args.servers)
    curve = jobs.curve_keys(*_curve_files(args))
    with spark_session(args.master, "clone-pipeline export", dict(args.conf)) as spark:
        meta = jobs.export_snapshot(
            spark, servers, args.output, subtree=args.subtree, timeout=args.timeout, curve=curve
        )
    print(
        f"exported {meta.rows} keys at sequence {meta.sequence} from {meta.server} "
        f"to {args.output} in {time.monotonic() - started:.1f}s"
    )
    return EXIT_OK


def _load(args: argparse.Namespace) -> int:
    from clone.pipeline import jobs
    from clone.pipeline.session import spark_session
    from clone.pipeline.snapshot import find_active, parse_servers
    from clone.pipeline.sources import require_exists, resolve_output
    from clone.pipeline.transforms import LoadColumns

    started = time.monotonic()
    servers = parse_servers(args.servers)
    require_exists(args.input, "input")
    if args.resume is not None:
        require_exists(args.resume, "manifest")  # fail fast, before Spark starts
    curve_files = _curve_files(args)
    find_active(servers, timeout=max(1.0, 3 * args.heartbeat), curve=jobs.curve_keys(*curve_files))
    with spark_session(args.master, "clone-pipeline load", dict(args.conf)) as spark:
        result = jobs.load_table(
            spark,
            servers,
            args.input,
            fmt=args.format,
            columns=LoadColumns(args.key_col, args.value_col, args.ttl_col, args.subtree),
            rejects=args.rejects,
            max_in_flight=args.max_in_flight,
            confirm_timeout=args.confirm_timeout,
            heartbeat=args.heartbeat,
            curve_files=curve_files,
            manifest=None if args.resume else resolve_output(args.manifest),
            resume=args.resume,
        )
    elapsed = time.monotonic() - started
    print(f"rows written:  {result.written}")
    if result.skipped:
        print(f"rows skipped:  {result.skipped} (confirmed by the load resumed)")
    print(f"rows rejected: {result.rejected}")
    for reason, count in result.reasons:
        line = result.first_lines.get(reason)
        print(f"  {count:>10}  {reason}" + ("" if line is None else f" (first at line {line})"))
    if result.rejected:
        print(f"rejected rows and reasons: {result.rejects_path}")
    rate = result.written / max(result.write_seconds, 1e-9)
    print(
        f"time taken:    {elapsed:.1f}s (writing {result.write_seconds:.1f}s, {rate:.0f} rows/s, "
        f"{result.partitions} partitions, {result.retries} retries)"
    )
    if result.manifest:
        print(f"manifest:      {result.manifest}")
    return EXIT_REJECTED if result.rejected else EXIT_OK


def _package(args: argparse.Namespace) -> int:
    from clone.pipeline.packaging import write_package

    built = write_package(args.output)
    print(f"package: {built.zip_path} ({built.modules} modules)")
    print(f"driver:  {built.driver_path}")
    print(
        "run:     spark-submit --master URL --py-files "
        f"{built.zip_path} {built.driver_path} {'|'.join(SPARK_COMMANDS)} ..."
    )
    return EXIT_OK


_COMMANDS = {
    "load": _load,
    "export": _export,
    "history": _history,
    "audit": _audit,
    "drill-report": _drill_report,
    "package": _package,
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args)
    try:
        # Spark and the jobs are imported only now: --help and usage errors are instant.
        return _COMMANDS[args.command](args)
    except PipelineError as exc:
        print(f"clone-pipeline {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"clone-pipeline {args.command}: interrupted", file=sys.stderr)
        return EXIT_FAILED
    except Exception as exc:  # a bug or an unforeseen Spark error: still one line
        log.debug("unexpected error", exc_info=True)
        if is_spark_error(exc):  # Spark's or Java's: its reason, as the docs promise
            text = f"Spark: {one_line(exc)}"
        else:
            text = f"{type(exc).__name__}: {one_line(exc)}"
        print(
            f"clone-pipeline {args.command}: error: {text} (run with -v for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
