"""The failover history in the data directory: kept across a
restart, garbage ignored, never fatal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clone.server.rolelog import FILE_NAME, load_role_changes, save_role_changes
from tests.server.test_http_e2e import http_pair, json_get
from tests.support.servers import Servers
from tests.support.waiting import eventually


def test_round_trip_keeps_the_newest(tmp_path: Path) -> None:
    changes = [(1.0 + i, "passive", "active") for i in range(5)]
    save_role_changes(tmp_path, changes)
    assert load_role_changes(tmp_path, 3) == changes[-3:]
    assert not (tmp_path / (FILE_NAME + ".tmp")).exists()


@pytest.mark.parametrize(
    "text",
    ["not json", '{"a": 1}', '[[1, "a"], ["x", "a", "b"], [true, "a", "b"]]', "[[1, 2, 3]]"],
)
def test_garbage_is_ignored(tmp_path: Path, text: str) -> None:
    (tmp_path / FILE_NAME).write_text(text)
    assert load_role_changes(tmp_path, 20) == []


def test_a_valid_row_among_garbage_is_kept(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).write_text(json.dumps([[5, "starting", "active"], "junk"]))
    assert load_role_changes(tmp_path, 20) == [(5.0, "starting", "active")]


def test_missing_or_unwritable_is_not_fatal(tmp_path: Path) -> None:
    assert load_role_changes(tmp_path / "nowhere", 20) == []
    save_role_changes(tmp_path / "nowhere", [(1.0, "a", "b")])  # logged, not raised


@pytest.mark.slow
def test_a_restarted_server_shows_its_earlier_role_changes(servers: Servers) -> None:
    _, backup = http_pair(servers)
    code, first = json_get(backup, "/status.json")
    assert code == 200 and first["role_changes"], first
    assert first["role_changes"][0]["to"] == "passive"
    backup.terminate()
    mark = backup.log_size()
    backup.start()
    backup.wait_log("synced from", timeout=30, after=mark)

    def shown() -> bool:
        code, second = json_get(backup, "/status.json")
        return code == 200 and len(second["role_changes"]) == len(first["role_changes"]) + 1

    eventually(shown, timeout=30)
    _, second = json_get(backup, "/status.json")
    # newest first: this start's, then the ones before the restart
    assert second["role_changes"][1:] == first["role_changes"]
