"""The load's manifest (``--manifest``, ``--resume``): what it records, and
each manifest ``--resume`` refuses (an InputError: exit 2), with no Spark."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clone.pipeline.errors import InputError
from clone.pipeline.jobs import _resume_from, _write_manifest

RESULTS = [
    {"partition": 0, "confirmed_through": "/k/0099"},
    {"partition": 1, "confirmed_through": None},  # nothing confirmed: not recorded
    {"partition": 2, "confirmed_through": "/k/0250"},
]


def test_written_then_read_back(tmp_path: Path) -> None:
    source = str(tmp_path / "t.parquet")
    path = str(tmp_path / "sub" / "manifest.json")
    _write_manifest(path, source, 1_000, 8, RESULTS, complete=False)
    data = json.loads(Path(path).read_text())
    assert data["complete"] is False and data["rows"] == 1_000
    assert data["input"] == source
    assert not Path(f"{path}.tmp").exists()  # replaced whole, never half-written
    assert _resume_from(path, source, None) == (8, {0: "/k/0099", 2: "/k/0250"})
    assert _resume_from(path, source, 1_000) == (8, {0: "/k/0099", 2: "/k/0250"})


def _manifest(tmp_path: Path, **changes: object) -> str:
    data: dict[str, object] = {
        "format": 1, "input": str(tmp_path / "t.parquet"), "rows": 1_000, "partitions": 8,
        "complete": False, "confirmed_through": {"0": "/k/0099"},
    }  # fmt: skip
    data.update(changes)
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    ("changes", "source", "rows", "message"),
    [
        ({}, "other.parquet", None, "is for .*t.parquet with 1000 rows to write, not .*other"),
        ({}, "t.parquet", 999, "with 1000 rows to write, not .* with 999"),
        ({"format": 2}, "t.parquet", None, "is not a load manifest: format 2"),
        ({"partitions": "x"}, "t.parquet", None, "is not a load manifest"),
        ({"confirmed_through": {"8": "/k"}}, "t.parquet", None, "partitions out of range"),
        ({"partitions": 0}, "t.parquet", None, "partitions out of range"),
    ],
)
def test_refused(
    tmp_path: Path, changes: dict[str, object], source: str, rows: int | None, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        _resume_from(_manifest(tmp_path, **changes), str(tmp_path / source), rows)


def test_missing_or_not_json(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        _resume_from(str(tmp_path / "none.json"), "t.parquet", None)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InputError, match="is not a load manifest"):
        _resume_from(str(tmp_path / "bad.json"), "t.parquet", None)
