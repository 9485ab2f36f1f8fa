"""The threaded client as a library should behave: reads that say how fresh
they are, callbacks that unregister, a close() that says what it dropped, no
output of its own, JSON values, typed timeouts."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest

import clone
import clone.client.frontend as client_mod
from clone import AgentTimeout, Clone, Entry, NotJSON, NotSynced
from clone.client.events import Subscription
from tests.support.fake_server import FakeServer
from tests.support.ports import free_base_port
from tests.support.waiting import eventually

HB = 0.1


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer(heartbeat=HB) as srv:
        yield srv


def test_reads_say_whether_they_are_synced(server: FakeServer) -> None:
    nowhere = f"tcp://127.0.0.1:{free_base_port()}"
    with Clone(nowhere, heartbeat=HB) as c:
        assert c.get("/k", b"d") == b"d"
        value, fresh = c.get("/k", with_status=True)
        assert value is None and not fresh.synced and fresh.state != "active"
        with pytest.raises(NotSynced, match=r"not synced .*'/k'"):
            c.get("/k", require_synced=True)
    with Clone(server.endpoint, heartbeat=HB) as c:
        c.wait_synced(10)
        c.set("/k", b"v", wait=True, timeout=10)
        value, fresh = c.get("/k", with_status=True, require_synced=True)
        assert value == b"v" and fresh.synced
        assert fresh.silent_for is not None and 0 <= fresh.silent_for < 10
        entry = c.entry("/k")
        assert entry is not None and entry.freshness is not None and entry.freshness.synced
        assert entry == Entry("/k", b"v", entry.sequence, entry.properties)  # not compared


def test_on_change_returns_a_handle_that_unregisters(server: FakeServer) -> None:
    seen: list[str] = []
    with Clone(server.endpoint, heartbeat=HB) as c:
        c.wait_synced(10)
        handle = c.on_change(lambda e: seen.append(e.key))
        assert isinstance(handle, Subscription) and handle.active
        c.set("/a", b"1", wait=True, timeout=10)
        eventually(lambda: seen == ["/a"], 10, "the callback ran")
        handle.cancel()
        assert not handle.active
        with c.on_change(lambda e: seen.append("scoped:" + e.key)):
            c.set("/b", b"1", wait=True, timeout=10)
            eventually(lambda: "scoped:/b" in seen, 10, "the scoped callback ran")
        c.set("/c", b"1", wait=True, timeout=10)
        c.on_change(lambda e: seen.append("last:" + e.key))
        c.set("/d", b"1", wait=True, timeout=10)
        eventually(lambda: "last:/d" in seen, 10, "a later callback ran")
    assert "/b" not in seen and "/c" not in seen and "scoped:/c" not in seen


def test_close_says_what_it_dropped(caplog: pytest.LogCaptureFixture) -> None:
    nowhere = f"tcp://127.0.0.1:{free_base_port()}"
    c = Clone(nowhere, heartbeat=HB)
    c.set("/k", b"never sent")  # held: no server has answered
    pending = c.set_async("/k2", b"v", timeout=30)
    with caplog.at_level(logging.WARNING, logger="clone"):
        c.close()
    report = c.close_report
    assert report is not None and report.dropped
    assert report.unsent_writes == 2 and report.waiting == 1
    assert "closing dropped 2 unsent write(s)" in caplog.text
    assert pending.exception(1) is not None
    clean = Clone(nowhere, heartbeat=HB)
    clean.close()
    assert clean.close_report is not None and not clean.close_report.dropped


def test_clients_left_open_are_closed_at_exit(server: FakeServer) -> None:
    c = Clone(server.endpoint, heartbeat=HB)
    assert c in client_mod._live
    client_mod._close_live()
    assert c.closed and c not in client_mod._live


def test_json_values(server: FakeServer) -> None:
    with Clone(server.endpoint, heartbeat=HB) as c:
        c.wait_synced(10)
        c.set_json("/cfg", {"a": [1, 2.5, None], "b": "é"}, wait=True, timeout=10)
        assert c.get("/cfg") == '{"a":[1,2.5,null],"b":"é"}'.encode()
        assert c.get_json("/cfg") == {"a": [1, 2.5, None], "b": "é"}
        assert c.get_json("/none", []) == []
        with pytest.raises(NotJSON, match="not JSON-serialisable"):
            c.set_json("/bad", object())
        with pytest.raises(NotJSON):
            c.set_json("/bad", float("nan"))
        c.set("/raw", b"\xff", wait=True, timeout=10)
        with pytest.raises(NotJSON, match="'/raw' is not a JSON document"):
            c.get_json("/raw")
        assert issubclass(NotJSON, ValueError)


def test_agent_timeouts_are_timeout_errors() -> None:
    assert issubclass(AgentTimeout, TimeoutError) and issubclass(AgentTimeout, clone.CloneError)


@pytest.mark.parametrize("name", ["NotJSON", "errors", "ConfirmTimeout"])
def test_an_error_type_imports_first_in_a_fresh_process(name: str) -> None:
    """``from clone import NotJSON`` as a program's first import of clone
    (scripts/examples/fastapi_service.py does): once a RecursionError."""
    code = f"from clone import {name}\nprint({name}.__name__)\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().split(".")[-1] == name


def test_the_library_prints_nothing_by_itself() -> None:
    """No handler of the application's: our warnings go nowhere (NullHandler),
    not to stderr through Python's last-resort handler."""
    code = (
        "import logging, clone\n"
        "logging.getLogger('clone.client').warning('should not be printed')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stderr == "" and out.stdout == ""
    assert any(isinstance(h, logging.NullHandler) for h in logging.getLogger("clone").handlers)
