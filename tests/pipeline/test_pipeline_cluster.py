"""Spark beyond one JVM: --master, --conf, spark-submit and clone.zip.

The settings logic is tested as tables, without Spark.  The end-to-end tests
run ``load`` (through ``spark-submit --py-files clone.zip``) on
``local-cluster[2,1,1024]``: two executor JVMs running our Python, each
partition with its own client, as on a real cluster.  ``export`` and ``audit``
(through ``python -m clone.pipeline --master``) run on a local cluster of one
executor JVM: their executors run no Python of ours, only Spark's own file
writing and SQL, so what they check (the master reaches the CLI, the tasks run
and write in a JVM other than the driver's) needs one; each executor JVM is
seconds of CPU on a two-core machine, where the suite must end in minutes
(issue 24).  Every JVM of these jobs gets the shared session's JIT and
collector flags (``child_conf``): they are mostly starting, and the flags
halved their time.  Local mode is covered by test_pipeline_e2e.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clone import Clone
from clone.pipeline.cli import SPARK_COMMANDS, build_parser, main
from clone.pipeline.packaging import DRIVER_SCRIPT, ZIP_NAME, write_package
from clone.pipeline.session import (
    DEFAULT_MASTER,
    DEFAULTS,
    parse_conf,
    resolve_master,
    session_settings,
)
from tests.support.history_exports import TIMED, TIMED_RATES, rate_rows, write_history_export
from tests.support.servers import ServerProcess, Servers
from tests.support.spark_session import CLUSTER_MASTER, child_conf, child_env, spark_script

# The shortest valid command line of every subcommand that starts Spark.
SPARK_COMMAND_LINES = [
    ["load", "--servers", "h:1", "--input", "x"],
    ["export", "--servers", "h:1", "--output", "o"],
    ["history", "--servers", "h:1", "--since", "3", "--output", "o"],
    ["audit", "--input", "d", "--output", "o"],
    ["drill-report", "--input", "r", "--output", "o"],
]
# A job on local-cluster: about 30 s to start the cluster on 2 cores, then the job.
CHILD_TIMEOUT = 600  # a local cluster's three JVMs took over 240 s on a busy machine
# One executor JVM beside the driver's (see the module's docstring).
ONE_EXECUTOR = "local-cluster[1,1,1024]"


# --------------------------------------------------------------------------
# --conf and --master, no Spark


@pytest.mark.parametrize(
    ("item", "expected"),
    [
        ("spark.executor.memory=2g", ("spark.executor.memory", "2g")),
        ("spark.executorEnv.CLONE_X=a=b", ("spark.executorEnv.CLONE_X", "a=b")),
        (" spark.sql.shuffle.partitions =8", ("spark.sql.shuffle.partitions", "8")),
        ("spark.hadoop.fs.s3a.endpoint=", ("spark.hadoop.fs.s3a.endpoint", "")),
    ],
)
def test_conf_takes_spark_settings(item: str, expected: tuple[str, str]) -> None:
    assert parse_conf(item) == expected


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("executor.memory=2g", "'executor.memory' is not a Spark setting"),
        ("fs.s3a.endpoint=x", "Hadoop settings with 'spark.hadoop.'"),
        ("spark.executor.memory", "is not of the form spark.key=value"),
        ("=2g", "is not of the form spark.key=value"),
        ("spark.=x", "is not a Spark setting"),
        ("spark.master=yarn", "spark.master is set with --master"),
    ],
)
def test_conf_rejects_anything_else(item: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace(".", r"\.")):
        parse_conf(item)


@pytest.mark.parametrize(
    ("requested", "submitted", "expected"),
    [
        (None, None, DEFAULT_MASTER),
        ("local-cluster[2,1,1024]", None, "local-cluster[2,1,1024]"),
        (None, "yarn", "yarn"),
        ("yarn", "yarn", "yarn"),
        ("local[1]", "spark://m:7077", "spark://m:7077"),  # spark-submit's wins
    ],
)
def test_master_precedence(
    requested: str | None,
    submitted: str | None,
    expected: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert resolve_master(requested, submitted) == expected
    ignored = bool(requested and submitted and requested != submitted)
    assert ("ignoring --master" in caplog.text) == ignored


def test_settings_precedence() -> None:
    # Ours, unless spark-submit set them; --conf over both.
    submitted = {"spark.master": "yarn", "spark.sql.shuffle.partitions": "200"}
    conf = {"spark.ui.enabled": "true", "spark.executor.memory": "2g"}
    settings = session_settings("yarn", submitted, conf)
    assert "spark.sql.shuffle.partitions" not in settings
    assert settings["spark.ui.enabled"] == "true"
    assert settings["spark.executor.memory"] == "2g"
    assert settings["spark.sql.session.timeZone"] == DEFAULTS["spark.sql.session.timeZone"]
    # The driver JVM is running already; the log4j file is not on the cluster's nodes.
    assert not any(k.endswith("extraJavaOptions") for k in settings)

    local = session_settings(CLUSTER_MASTER, {}, {})
    assert local["spark.driver.extraJavaOptions"].startswith("-Dlog4j2.configurationFile=")
    assert local["spark.executor.extraJavaOptions"] == local["spark.driver.extraJavaOptions"]
    assert session_settings("spark://m:7077", {}, {}).keys() == {
        *DEFAULTS,
        "spark.driver.extraJavaOptions",
    }


def test_every_subcommand_but_package_starts_spark() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == {*SPARK_COMMANDS, "package"}
    assert [line[0] for line in SPARK_COMMAND_LINES] == list(SPARK_COMMANDS)


def test_package_takes_no_spark_flags(capsys: pytest.CaptureFixture[str]) -> None:
    # It starts no Spark: --master would be silently meaningless, so it is refused.
    with pytest.raises(SystemExit) as exc:
        main(["package", "--output", "o", "--master", "yarn"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --master yarn" in capsys.readouterr().err


@pytest.mark.parametrize("command", SPARK_COMMAND_LINES, ids=lambda c: c[0])
def test_every_spark_command_takes_master_and_conf(command: list[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(command)
    assert (args.master, args.conf) == (None, [])
    args = parser.parse_args(
        [*command, "--master", "yarn", "--conf", "spark.a=1", "--conf", "spark.b=x=y"]
    )
    assert args.master == "yarn"
    assert args.conf == [("spark.a", "1"), ("spark.b", "x=y")]


def test_bad_conf_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*SPARK_COMMAND_LINES[1], "--conf", "executor.memory=2g"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        "clone-pipeline export: error: argument --conf: 'executor.memory' is not a Spark "
        "setting: keys start with 'spark.' (Hadoop settings with 'spark.hadoop.')\n"
    ) in err
    assert "Traceback" not in err


# --------------------------------------------------------------------------
# clone.zip


def test_package_holds_what_executors_import(tmp_path: Path) -> None:
    built = write_package(tmp_path / "dist")
    assert Path(built.zip_path) == tmp_path / "dist" / ZIP_NAME
    assert Path(built.driver_path) == tmp_path / "dist" / DRIVER_SCRIPT
    names = zipfile.ZipFile(built.zip_path).namelist()
    assert "clone/pipeline/writer.py" in names and "uuid6/__init__.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    # Imported from the zip, ahead of the installed package, as --py-files does.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import clone.pipeline.writer, clone.client.frontend, uuid6; "
        "print(clone.pipeline.writer.__file__, uuid6.__file__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, built.zip_path],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    assert all(path.startswith(built.zip_path + os.sep) for path in out.split()), out


def test_package_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["package", "--output", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"package: {tmp_path / ZIP_NAME} (" in out
    assert (
        f"run:     spark-submit --master URL --py-files {tmp_path / ZIP_NAME} "
        f"{tmp_path / DRIVER_SCRIPT} load|export|history|audit|drill-report ...\n"
    ) in out


# --------------------------------------------------------------------------
# local-cluster: separate executor JVMs


def _endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def _run_child(argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            argv, cwd=cwd, env=child_env(), capture_output=True, text=True,
            timeout=CHILD_TIMEOUT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        # run() killed the driver; its local-cluster master and workers exit with it.
        pytest.fail(f"{argv[:3]} still running after {CHILD_TIMEOUT}s:\n{exc.stderr!r}")


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(CHILD_TIMEOUT + 60)
def test_spark_submit_load_on_local_cluster(servers: Servers, tmp_path: Path) -> None:
    solo = servers.standalone()
    rows = {f"/sub/k{i:04d}": f"value {i}" for i in range(500)}
    pq.write_table(
        pa.table({"key": [*rows, "HUGZ"], "value": [*rows.values(), "reserved"]}),
        tmp_path / "t.parquet",
    )
    built = write_package(tmp_path / "dist")
    proc = _run_child(
        [spark_script("spark-submit"), "--master", CLUSTER_MASTER, *child_conf(),
         "--conf", "spark.executor.memory=1g", "--py-files", built.zip_path, built.driver_path,
         "load", "--master", "local[1]",  # ignored: spark-submit's master wins
         "--conf", "spark.sql.shuffle.partitions=2",
         "--servers", _endpoint(solo), "--input", str(tmp_path / "t.parquet"),
         "--rejects", str(tmp_path / "rejects"), "--heartbeat", "0.1"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the reserved key
    assert "rows written:  500" in proc.stdout
    assert "rows rejected: 1" in proc.stdout
    # spark-submit merges the Python driver's stderr into its stdout.
    assert (
        f"WARNING clone.pipeline.session: ignoring --master local[1]: spark-submit set the "
        f"master to {CLUSTER_MASTER}\n" in proc.stdout
    )
    assert f"session on {CLUSTER_MASTER}\n" in proc.stdout
    with Clone([_endpoint(solo)], heartbeat=0.1, server_timeout=1.0) as c:
        c.wait_synced(10)
        assert {e.key: e.value for e in c.entries("/sub/")} == {
            k: v.encode() for k, v in rows.items()
        }


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(CHILD_TIMEOUT + 60)
def test_export_on_local_cluster(servers: Servers, tmp_path: Path) -> None:
    primary, backup = servers.pair()
    eps = [_endpoint(primary), _endpoint(backup)]
    with Clone(eps, heartbeat=0.1, server_timeout=1.0) as c:
        c.wait_synced(10)
        # Every write confirmed: a fire-and-forget one may be lost (on a busy
        # machine 87 of 300 were), and the test is about the export.
        for i in range(300):
            c.set(f"/exp/k{i:04d}", f"value {i}".encode(), wait=True, timeout=60)
        live = {e.key: (e.value, e.sequence) for e in c.entries()}
        sequence = c.status().sequence

    out = tmp_path / "export"
    proc = _run_child(
        [sys.executable, "-m", "clone.pipeline", "export", "--master", ONE_EXECUTOR, *child_conf(),
         "--conf", "spark.executor.memory=1g", "--servers", ",".join(eps), "--output", str(out)],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"session on {ONE_EXECUTOR}" in proc.stderr
    assert f"exported 300 keys at sequence {sequence}" in proc.stdout
    meta = json.loads((out / "_clone_snapshot.json").read_text())
    assert (meta["sequence"], meta["rows"]) == (sequence, 300)
    table = pq.read_table(out, columns=["key", "value", "sequence"]).to_pylist()
    assert {r["key"]: (r["value"], r["sequence"]) for r in table} == live


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(CHILD_TIMEOUT + 60)
def test_audit_on_local_cluster(tmp_path: Path) -> None:
    # A history export with chosen times: no servers needed, exact answers known.
    hist = write_history_export(tmp_path / "hist", TIMED, 0, 8)
    out = tmp_path / "audit"
    proc = _run_child(
        [sys.executable, "-m", "clone.pipeline", "audit", "--master", ONE_EXECUTOR, *child_conf(),
         "--conf", "spark.executor.memory=1g", "--input", str(hist), "--output", str(out),
         "--at", "5", "--from", "2", "--to", "8", "--rate-window", "10"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"session on {ONE_EXECUTOR}" in proc.stderr
    assert "state:   2 keys at sequence 5\n" in proc.stdout
    state = pq.read_table(out / "state_at").to_pylist()
    assert {r["key"]: (r["seq"], r["value"]) for r in state} == {
        "/app/a": (4, b"3"), "/cfg/x": (3, b"x1"),
    }  # fmt: skip
    diff = {r["key"]: r["status"] for r in pq.read_table(out / "diff").to_pylist()}
    assert diff == {"/app/a": "changed", "/app/b": "removed", "/cfg/x": "added",
                    "/app/c": "added"}  # fmt: skip
    assert rate_rows(pq.read_table(out / "rates").to_pylist()) == TIMED_RATES
