"""clone-pipeline history and audit, and load/export/history over CURVE, on local Spark.

A real durable server takes a known sequence of writes and deletes; the audit
of its data directory, and of a history export taken over the network,
reconstructs the state at a sequence exactly.  The coverage rules (what can be
reconstructed from a bounded history) are checked without a network.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from clone import Clone
from clone.pipeline.audit import (
    Coverage,
    coverage,
    distinct_updates,
    plan_state,
    prefix_write_rates,
    state_at,
)
from clone.pipeline.cli import main
from clone.pipeline.errors import HistoryIncomplete
from clone.pipeline.history import HistorySpan, history_arrow_schema, state_arrow_schema
from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.history_exports import (
    TIMED,
    TIMED_RATES,
    rate_rows,
    untimed,
    update,
    write_history_export,
)
from tests.support.servers import ServerProcess, Servers

HB = 0.1

# (key, value or None for a delete): sequence i + 1 on a fresh server.
OPS: list[tuple[str, bytes | None]] = [
    ("/app/a", b"1"),
    ("/app/b", b"2"),
    ("/cfg/x", b"x1"),
    ("/app/a", b"3"),
    ("/app/b", None),
    ("/cfg/y", b"y1"),
    ("/cfg/x", b"x2"),
    ("/app/c", b"4"),
    ("/cfg/y", None),
    ("/app/b", b"5"),
]


def expected_state(n: int) -> dict[str, bytes]:
    state: dict[str, bytes] = {}
    for key, value in OPS[:n]:
        if value is None:
            state.pop(key, None)
        else:
            state[key] = value
    return state


def endpoint(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def read_state(path: Path) -> dict[str, bytes]:
    table = pq.read_table(path)
    keys, values = table.column("key").to_pylist(), table.column("value").to_pylist()
    return dict(zip(keys, values, strict=True))


# -- coverage rules, no Spark ----------------------------------------------


def test_coverage_merges_spans_and_keeps_the_newest_run() -> None:
    spans = [HistorySpan("a", 5, 20, 20), HistorySpan("b", 1, 6), HistorySpan("c", 30, 40)]
    # 21..29 are missing: only 30..40 is held without a hole, and no state in it.
    assert coverage(spans) == Coverage(30, 40, None)
    assert coverage(spans[:2]) == Coverage(1, 20, 20)


@pytest.mark.parametrize(
    ("cov", "at", "base"),
    [
        (Coverage(1, 10, None), 0, 0),
        (Coverage(1, 10, 10), 7, 0),
        (Coverage(6, 10, 10), 5, 10),
        (Coverage(6, 10, 10), 10, 10),
        (Coverage(11, 10, 10), 10, 10),  # an empty log: the state only
    ],
)
def test_plan_state_starts_from_what_is_held(cov: Coverage, at: int, base: int) -> None:
    assert plan_state(cov, at) == base


@pytest.mark.parametrize(
    ("cov", "at", "says"),
    [
        (Coverage(6, 10, 10), 4, "oldest update held is 6"),
        (Coverage(6, 10, None), 8, "oldest update held is 6"),
        (Coverage(1, 10, None), 11, "after the newest update held (10"),
    ],
)
def test_plan_state_refuses_what_the_history_cannot_tell(
    cov: Coverage, at: int, says: str
) -> None:
    with pytest.raises(HistoryIncomplete, match=says.replace("(", r"\(")):
        plan_state(cov, at)


# -- going back from a state, on Spark -------------------------------------


@pytest.mark.spark
def test_state_at_undoes_from_the_kv_state_or_names_the_unknown_keys(spark: Any) -> None:
    # Updates 4..6 held; the state at 6.  /a was written at 2 (not held).
    log = pa.Table.from_pylist(
        [
            {"seq": 4, "key": "/b", "value": b"b4", "uuid": None, "props": "", "deleted": False},
            {"seq": 5, "key": "/a", "value": b"a5", "uuid": None, "props": "", "deleted": False},
            {"seq": 6, "key": "/b", "value": None, "uuid": None, "props": "", "deleted": True},
        ],
        schema=history_arrow_schema(),
    )
    kv = pa.Table.from_pylist(
        [
            {"key": "/a", "seq": 5, "value": b"a5", "uuid": None, "props": ""},
            {"key": "/c", "seq": 1, "value": b"c1", "uuid": None, "props": ""},
        ],
        schema=state_arrow_schema(),
    )
    updates, base = spark.createDataFrame(log), spark.createDataFrame(kv)

    def at(n: int) -> tuple[dict[str, bytes], list[str]]:
        state, unknown = state_at(updates, base, 6, n, 4)
        return (
            {r["key"]: bytes(r["value"]) for r in state.collect()},
            sorted(r["key"] for r in unknown.collect()),
        )

    assert at(6) == ({"/a": b"a5", "/c": b"c1"}, [])
    assert at(5) == ({"/a": b"a5", "/b": b"b4", "/c": b"c1"}, [])
    assert at(4)[1] == ["/a"]  # its value before 5 was written at 2: not held


# -- write rates over time, from times the test chose -------------------------

def markdown_table(text: str, headers: list[str]) -> list[list[str]]:
    """The body rows of the markdown table with these headers."""

    def cells(line: str) -> list[str]:
        return [cell.strip() for cell in line.strip().strip("|").split("|")]

    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if line.startswith("|") and cells(line) == headers)  # fmt: skip
    body = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        body.append(cells(line))
    return body


@pytest.mark.spark
def test_write_rates_per_second_per_prefix_per_window(spark: Any) -> None:
    updates = spark.createDataFrame(pa.Table.from_pylist(TIMED, schema=history_arrow_schema()))
    got = [r.asDict() for r in prefix_write_rates(updates, 1, 10.0).collect()]
    assert rate_rows(got) == TIMED_RATES
    # Depth 0, one window over everything: 8 writes (1 delete) of 4 keys in 40 s.
    wide = [r.asDict() for r in prefix_write_rates(updates, 0, 40.0).collect()]
    assert rate_rows(wide) == [("/", 1000.0, 1040.0, 8, 1, 4, 0.2)]
    # Updates without a time are left out, not counted at time zero.
    half = spark.createDataFrame(
        pa.Table.from_pylist(TIMED[:4] + untimed(TIMED[4:]), schema=history_arrow_schema())
    )
    got = [r.asDict() for r in prefix_write_rates(half, 1, 10.0).collect()]
    assert rate_rows(got) == [("/app/", 1000.0, 1010.0, 3, 0, 2, 0.3),
                              ("/cfg/", 1000.0, 1010.0, 1, 0, 1, 0.1)]  # fmt: skip
    with pytest.raises(ValueError, match="rate window must be > 0"):
        prefix_write_rates(updates, 1, 0.0)


@pytest.mark.spark
def test_distinct_updates_keeps_the_copy_that_has_a_time(spark: Any) -> None:
    # The same updates from an export over the network (no times) and a log.
    for rows in (untimed(TIMED) + TIMED, TIMED + untimed(TIMED)):
        both = spark.createDataFrame(pa.Table.from_pylist(rows, schema=history_arrow_schema()))
        got = sorted((r["seq"], r["key"], r["at"]) for r in distinct_updates(both).collect())
        assert got == [(r["seq"], r["key"], r["at"]) for r in TIMED]


@pytest.mark.spark
def test_audit_reports_rates_from_known_times_and_says_when_they_are_unknown(
    spark: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    timed = write_history_export(tmp_path / "timed", TIMED, 0, 8)
    # The same 1..8 again without times (over the network), and 9..10 only so.
    again = write_history_export(tmp_path / "again", untimed(TIMED), 0, 8)
    later = write_history_export(
        tmp_path / "later", [update(9, "/cfg/y", b"y", None), update(10, "/app/c", None, None)],
        8, 10,
    )  # fmt: skip
    out = tmp_path / "mixed"
    code = main(["audit", "--input", str(timed), str(again), str(later), "--output", str(out),
                 "--rate-window", "10", "--bucket", "5", "-q"])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    assert "rates:   from the 8 of 10 updates with a time\n" in printed
    # Each stage's time, the slowest named (the audit's time at a million rows, and
    # the stage that dominates it).
    timing = re.search(r"^time:    ([\d.]+) s; slowest stage (\w+), ([\d.]+) s \((.*)\)$",
                       printed, re.MULTILINE)  # fmt: skip
    assert timing is not None, printed
    stages = [part.split() for part in timing.group(4).split(", ")]
    assert [name for name, _ in stages] == STAGES
    assert timing.group(2) in STAGES
    assert float(timing.group(3)) == max(float(t) for _, t in stages)
    assert rate_rows(pq.read_table(out / "rates").to_pylist()) == TIMED_RATES
    blocks = {(r["prefix"], r["bucket"]): r["writes"]
              for r in pq.read_table(out / "blocks").to_pylist()}  # fmt: skip
    assert blocks == {("/app/", 0): 3, ("/cfg/", 0): 1, ("/app/", 5): 3, ("/cfg/", 5): 2,
                      ("/app/", 10): 1}  # fmt: skip
    report = (out / "report.md").read_text()
    assert "2 of 10 updates have no time" in report
    # 40 s of windows, 1000..1040: /app/ 6 writes, 0.15/s, peak 0.3/s in its first window.
    assert markdown_table(report, ["prefix", "writes", "mean writes/s", "peak writes/s",
                                   "peak window (start)"]) == [
        ["/app/", "6", "0.15", "0.3", "1970-01-01 00:16:40 UTC"],
        ["/cfg/", "2", "0.05", "0.1", "1970-01-01 00:16:40 UTC"],
    ]
    assert (out / "report.png").stat().st_size > 0
    assert [row[0] for row in markdown_table(report, ["stage", "seconds"])] == STAGES
    assert f"Slowest stage: {timing.group(2)} (" in report

    # Network exports only: no rate is made up, and the report says why.
    out = tmp_path / "network"
    code = main(["audit", "--input", str(again), str(later), "--output", str(out),
                 "--rate-window", "10", "-q"])  # fmt: skip
    assert code == 0
    assert "rates:   unknown (no update held has a time" in capsys.readouterr().out
    assert pq.read_table(out / "rates").num_rows == 0
    report = (out / "report.md").read_text()
    assert "**Unknown: no update held has a time.**" in report
    assert "mean writes/s" not in report
    assert markdown_table(report, ["prefix", "writes", "deletes"]) == [
        ["/app/", "7", "2"], ["/cfg/", "3", "0"],
    ]  # fmt: skip


STAGES = ["bounds", "read", "state_at", "changes", "rates", "blocks", "report"]


def test_stopwatch_times_stages_one_after_the_other() -> None:
    from clone.pipeline.jobs import _Stopwatch

    ticks = iter([10.0, 10.5, 12.0, 12.25])
    watch = _Stopwatch(clock=lambda: next(ticks))
    for name in ("bounds", "read", "report"):
        watch.done(name)
    assert watch.stages == [("bounds", 0.5), ("read", 1.5), ("report", 0.25)]


# -- a real server ------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_audit_reconstructs_a_known_state_at_a_sequence_exactly(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = servers.standalone()
    ep = endpoint(server)
    with Clone([ep], heartbeat=HB, server_timeout=1.0) as client:
        client.wait_synced(10)
        written = (time.time(), time.time())
        for key, value in OPS:
            if value is None:
                client.delete(key, wait=True, timeout=10)
            else:
                client.set(key, value, wait=True, timeout=10)
        written = (written[0], time.time())

    hist, late = tmp_path / "hist", tmp_path / "late"
    assert main(["history", "--servers", ep, "--since", "0", "--output", str(hist), "-q"]) == 0
    assert main(["history", "--servers", ep, "--since", "6", "--output", str(late), "-q"]) == 0
    meta = json.loads((hist / "_clone_history.json").read_text())
    assert (meta["since"], meta["until"], meta["rows"]) == (0, len(OPS), len(OPS))
    exported = pq.read_table(hist).sort_by("seq").to_pylist()
    assert [(r["key"], r["value"], r["deleted"]) for r in exported] == [
        (k, v, v is None) for k, v in OPS
    ]
    assert all(len(r["uuid"]) == 32 and r["at"] is None for r in exported)
    assert pq.read_table(late).column("seq").to_pylist() == [7, 8, 9, 10]

    assert server.terminate() == 0  # its database is complete and closed
    data = servers.data_dir("standalone")
    for source, name in ((data, "dd"), (hist, "ex")):
        out = tmp_path / f"audit-{name}"
        code = main(["audit", "--input", str(source), "--output", str(out), "--at", "6",
                     "--from", "3", "--to", "9", "--prefix-depth", "1", "--bucket", "5", "-q"])
        assert code == 0, capsys.readouterr().err
        assert read_state(out / "state_at") == expected_state(6)
        changes = pq.read_table(out / "changes").to_pylist()
        changes.sort(key=lambda c: c["seq"])
        assert [(c["seq"], c["key"], c["deleted"]) for c in changes] == [
            (i + 1, k, v is None) for i, (k, v) in enumerate(OPS)
        ]
        diff = {r["key"]: r["status"] for r in pq.read_table(out / "diff").to_pylist()}
        assert diff == {"/app/b": "removed", "/app/a": "changed", "/cfg/x": "changed",
                        "/app/c": "added"}  # fmt: skip
        blocks = {(r["prefix"], r["bucket"]): r["writes"]
                  for r in pq.read_table(out / "blocks").to_pylist()}  # fmt: skip
        # Blocks of 5 sequences: 1..4, 5..9, 10.
        assert blocks == {("/app/", 0): 3, ("/cfg/", 0): 1, ("/app/", 5): 2, ("/cfg/", 5): 3,
                          ("/app/", 10): 1}  # fmt: skip
        rates = pq.read_table(out / "rates").to_pylist()
        report = (out / "report.md").read_text()
        if source is data:  # the log records when each update was applied
            assert sum(r["writes"] for r in rates) == len(OPS)
            assert all(written[0] - 60 <= r["window_start"] <= written[1] for r in rates)
            assert "mean writes/s" in report
        else:  # over the network, no times: no rates, and the report says so
            assert rates == []
            assert "**Unknown: no update held has a time.**" in report
        assert "report.png" in report and (out / "report.png").stat().st_size > 0
    # The ends, from the data directory (6 is above; any point of the same
    # rebuild, from the same base, is test_pipeline_transforms.py's): each is
    # a whole audit, some seconds of Spark jobs on the suite's one session.
    for n in (0, 10):
        out = tmp_path / f"at-{n}"
        assert main(["audit", "--input", str(data), "--output", str(out), "--at", str(n),
                     "-q"]) == 0  # fmt: skip
        assert read_state(out / "state_at") == expected_state(n), n

    # An export after 6 cannot tell the state at 3: refused, naming the oldest held.
    capsys.readouterr()
    code = main(["audit", "--input", str(late), "--output", str(tmp_path / "x"), "--at", "3"])
    assert code == 2
    assert "oldest update held is 7" in capsys.readouterr().err


@pytest.mark.spark
@pytest.mark.slow
def test_history_compacted_exits_non_zero_with_the_message(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = servers.standalone("--history", "2")
    with Clone([endpoint(server)], heartbeat=HB, server_timeout=1.0) as client:
        client.wait_synced(10)
        for i in range(6):
            client.set(f"/k{i}", b"v", wait=True, timeout=10)
    code = main(["history", "--servers", endpoint(server), "--since", "1",
                 "--output", str(tmp_path / "h")])  # fmt: skip
    assert code == 2
    assert "cannot replay the changes after sequence 1" in capsys.readouterr().err


# -- CURVE --------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_load_export_and_history_against_a_curve_server(
    spark: Any, servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = CurveKeys.make(tmp_path / "keys", admitted=("loader",))
    server = servers.standalone(*keys.server_args(acl=False), wait=False)
    wait_serving_curve(server, keys, "loader")
    ep = endpoint(server)
    flags = ["--curve-secret", str(keys.secret("loader")), "--server-key", str(keys.pair_public)]
    rows = {f"/sec/k{i:03d}": f"v{i}".encode() for i in range(200)}
    table = pa.table({"key": list(rows), "value": pa.array(list(rows.values()), pa.binary())})
    pq.write_table(table, tmp_path / "t.parquet")

    code = main(["load", "--servers", ep, "--input", str(tmp_path / "t.parquet"),
                 "--heartbeat", str(HB), "-q", *flags])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    assert main(["export", "--servers", ep, "--output", str(tmp_path / "e"), "-q", *flags]) == 0
    assert read_state(tmp_path / "e") == rows
    assert main(["history", "--servers", ep, "--output", str(tmp_path / "h"), "-q", *flags]) == 0
    assert pq.read_table(tmp_path / "h").num_rows == len(rows)

    # Without the keys the handshake never completes: a clear failure, not a hang.
    capsys.readouterr()
    code = main(["export", "--servers", ep, "--output", str(tmp_path / "x"), "--timeout", "1"])
    assert code == 2
    assert "delivered a snapshot" in capsys.readouterr().err


def test_audit_refuses_from_the_bounds_before_any_bulk_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A state the history cannot rebuild is refused from the inputs' bounds:
    no update is read (the bulk reader must not even be called) and Spark is
    not touched (``spark`` is None here)."""
    from clone.pipeline import jobs

    export = tmp_path / "h"
    export.mkdir()
    (export / "_clone_history.json").write_text(json.dumps({"since": 6, "until": 10, "rows": 4}))

    def no_bulk_read(*_args: object) -> None:
        raise AssertionError("the audit read the history before refusing")

    monkeypatch.setattr(jobs, "_audit_inputs", no_bulk_read)
    for at, diff in [(3, None), (None, (2, 10)), (11, None)]:
        with pytest.raises(HistoryIncomplete):
            jobs.audit(None, [str(export)], str(tmp_path / "out"), at=at, diff=diff)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="before refusing"):  # a state it can rebuild
        jobs.audit(None, [str(export)], str(tmp_path / "out"), at=None)  # type: ignore[arg-type]
