"""clone-pipeline's failure modes: exit 2 with one line on stderr, no traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clone.pipeline import DEFAULT_REJECTS
from clone.pipeline.cli import build_parser, main
from clone.pipeline.sources import resolve_output
from tests.support.ports import free_base_port, free_port
from tests.support.servers import Servers


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if ": error: " in line]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    return errors[0]


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["load", "--input", "x"])
    assert exc.value.code == 2
    assert "--servers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["load", "--servers", "h:1", "--input", "x", "--max-in-flight", "0"])
    assert exc.value.code == 2


ROOT = Path(__file__).resolve().parents[2]

_COMMANDS = [
    ["load", "--servers", "h:1", "--input", "x"],
    ["export", "--servers", "h:1", "--output", "o"],
    ["drill-report", "--input", "r", "--output", "o"],
]


@pytest.mark.parametrize("command", _COMMANDS, ids=lambda c: c[0])
def test_quiet_and_verbose_before_or_after_the_subcommand(command: list[str]) -> None:
    parser = build_parser()
    name, rest = command[0], command[1:]
    for argv, quiet in [
        (command, False),
        (["-q", *command], True),
        ([name, "-q", *rest], True),
        ([*command, "--quiet"], True),
    ]:
        args = parser.parse_args(argv)
        assert (args.quiet, args.verbose) == (quiet, False), argv
    assert parser.parse_args([name, "-v", *rest]).verbose is True
    assert parser.parse_args(["-v", name, *rest]).verbose is True


def test_load_takes_q_after_the_subcommand(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.parquet"
    code, _, err = _run(capsys, "load", "-q", "--servers", "127.0.0.1:1", "--input", str(missing))
    assert code == 2  # the missing input, not a usage error
    assert _one_line_error(err) == f"clone-pipeline load: error: input {missing} does not exist"


def test_rejects_go_under_results_by_default() -> None:
    args = build_parser().parse_args(_COMMANDS[0])
    assert args.rejects == DEFAULT_REJECTS == "results/clone-pipeline-rejects"
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "/results/" in ignored  # so the default never shows up in git status
    assert "clone-pipeline-rejects/" in ignored  # nor what older versions left at the top


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("hdfs:///tmp/clone-rejects", "hdfs:///tmp/clone-rejects"),  # docs' YARN example
        ("s3a://bucket/rejects", "s3a://bucket/rejects"),
        ("file:///tmp/rejects", "file:///tmp/rejects"),
        ("/abs/rejects", "/abs/rejects"),
        ("rel/rejects", "{cwd}/rel/rejects"),
    ],
)
def test_rejects_urls_are_kept_and_plain_paths_made_absolute(
    given: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert resolve_output(given) == expected.format(cwd=tmp_path)


def test_missing_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.parquet"
    code, _, err = _run(capsys, "load", "--servers", "127.0.0.1:1", "--input", str(missing))
    assert code == 2
    assert _one_line_error(err) == f"clone-pipeline load: error: input {missing} does not exist"


def test_bad_servers_argument(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "export", "--servers", "nohost", "--output", str(tmp_path))
    assert code == 2
    assert "is not of the form [tcp://]host:port" in _one_line_error(err)


def test_unreachable_servers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"key": ["/a"], "value": ["1"]}), table)
    dead = f"127.0.0.1:{free_base_port()}"
    code, _, err = _run(
        capsys, "load", "--servers", dead, "--input", str(table), "--heartbeat", "0.1"
    )
    assert code == 2
    assert "no active Clone server at tcp://" in _one_line_error(err)


def _assert_unreachable_master_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """drill-report with --master on a port nobody listens on: exit 2, one line."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"ts": 1.0, "client": "c0", "event": "x"}) + "\n")
    master = f"spark://127.0.0.1:{free_port()}"
    code, _, err = _run(
        capsys, "drill-report", "--input", str(run), "--output", str(tmp_path / "o"),
        "--master", master,
    )  # fmt: skip
    assert code == 2
    assert _one_line_error(err) == (
        f"clone-pipeline drill-report: error: Spark master {master} is unreachable"
    )


def test_unreachable_spark_master(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _assert_unreachable_master_refused(tmp_path, capsys)


@pytest.mark.spark
def test_another_master_with_a_session_running_is_refused_not_ignored(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tests' shared session runs in this process: a command asking for
    another master must not run on the shared one instead."""
    _assert_unreachable_master_refused(tmp_path, capsys)


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_missing_column(
    spark: Any,
    servers: Servers,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    solo = servers.standalone()
    table = tmp_path / "t.csv"
    table.write_text("name,value\n/a,1\n")
    code, _, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input", str(table),
        "--format", "csv", "--heartbeat", "0.1",
    )  # fmt: skip
    assert code == 2
    assert _one_line_error(err) == (
        "clone-pipeline load: error: input has no column 'key' (columns: name, value)"
    )


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_rejects_default_to_results_under_the_working_directory(
    spark: Any,
    servers: Servers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    solo = servers.standalone()
    work = tmp_path / "work"
    work.mkdir()
    table = tmp_path / "t.csv"
    table.write_text("key,value\n/rejects/a,1\nHUGZ,2\n")  # the second key is reserved
    monkeypatch.chdir(work)  # the shared Spark JVM was started elsewhere
    code, out, err = _run(
        capsys, "load", "--servers", f"127.0.0.1:{solo.port}", "--input", str(table),
        "--format", "csv", "--heartbeat", "0.1", "-q",
    )  # fmt: skip
    assert code == 1, err
    where = work / "results" / "clone-pipeline-rejects"
    assert f"rejected rows and reasons: {where}\n" in out
    rows = [json.loads(line) for f in sorted(where.glob("*.json")) for line in f.open()]
    assert rows == [
        {
            "key": "HUGZ",
            "value": "2",
            "input_file": f"file:{table}",  # as Hadoop names it
            "input_line": 3,
            "reject_reason": "key 'HUGZ' is reserved",
        }
    ]
    assert sorted(p.name for p in work.iterdir()) == ["results"]  # nothing else left behind
