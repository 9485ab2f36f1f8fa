"""The servers fixture's forked servers (tests/support/zygote.py) behave as
exec'd ones do: their own pid, log, signals and exit codes."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from clone.tools.procs import ProcessGroup, python_module_argv
from tests.support.ports import free_base_port
from tests.support.servers import FORK_SERVERS_ENV, ROOT, Servers, _fork_applies
from tests.support.zygote import ForkedChild

pytestmark = pytest.mark.skipif(
    os.environ.get(FORK_SERVERS_ENV, "1") == "0", reason=f"{FORK_SERVERS_ENV}=0: nothing is forked"
)


def _status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.slow
def test_a_forked_server_serves_and_exits_as_an_execd_one(servers: Servers) -> None:
    solo = servers.standalone("--in-memory")
    proc = solo.proc
    assert isinstance(proc, ForkedChild) and proc.poll() is None
    # A process of its own, a child of the zygote, nothing blocked, its own log.
    assert solo.pid != os.getpid() and int(_status(proc.pid, "PPid")) != os.getpid()
    assert int(_status(proc.pid, "SigBlk"), 16) == 0
    assert "=== " in solo.log_text() and "standalone" in solo.log_text()
    # SIGTERM: a clean stop, exit code 0, as the console script.
    assert solo.terminate() == 0
    assert proc.returncode == 0 and not solo.alive
    # Restarted on the same ports: forked again, a new pid; SIGKILL is -9.
    solo.start()
    solo.wait_serving()
    again = solo.proc
    assert isinstance(again, ForkedChild) and again.pid != proc.pid
    solo.kill9()
    assert again.wait(10) == -signal.SIGKILL


@pytest.mark.slow
def test_a_forked_server_refuses_a_bad_flag_with_the_parsers_exit_code(servers: Servers) -> None:
    port = free_base_port()
    bad = servers.spawn("bad", ["--standalone", "--port", str(port), "--heartbeat", "x"], port,
                        None)  # fmt: skip
    assert isinstance(bad.proc, ForkedChild)
    assert bad.proc.wait(30) == 2
    assert "--heartbeat" in bad.log_text()
    with pytest.raises(subprocess.TimeoutExpired):
        ForkedChild(bad.proc._zygote, 2**22 + 12345, ["none"]).wait(0.01)


@pytest.mark.slow
def test_a_server_with_an_environment_of_its_own_is_execd(servers: Servers) -> None:
    solo = servers.standalone("--in-memory", env={"CLONE_TEST_MARK": "1"})
    assert solo.proc is not None and not isinstance(solo.proc, ForkedChild)
    assert b"CLONE_TEST_MARK=1" in Path(f"/proc/{solo.pid}/environ").read_bytes()


@pytest.mark.slow
def test_a_server_left_running_dies_with_its_zygote(tmp_path: Path) -> None:
    from tests.support.servers import ROOT
    from tests.support.waiting import eventually
    from tests.support.zygote import Zygote

    zygote = Zygote(ROOT, os.environ)
    port = free_base_port()
    child = zygote.spawn(["--standalone", "--in-memory", "--port", str(port), "--bind",
                          "127.0.0.1"], tmp_path / "left.log", dict(os.environ), ROOT)  # fmt: skip
    log = tmp_path / "left.log"  # the child opens it
    eventually(lambda: log.exists() and "standalone: active" in log.read_text(), 60,
               "the server up")  # fmt: skip
    zygote.close()  # as at the session's end, or when the pytest process dies

    def gone() -> bool:
        try:
            return _status(child.pid, "State").startswith("Z")  # reaped by init soon
        except FileNotFoundError:
            return True

    eventually(gone, 30, "the left server gone")


# -- the drills' processes: ManagedProcess forked when it can be -------------


def test_a_drill_client_is_forked_and_exits_with_its_mains_code(tmp_path: Path) -> None:
    group = ProcessGroup(tmp_path / "logs")
    with group:
        proc = group.add("client", python_module_argv("clone.tools.drill.client", "--help"))
        assert proc.popen is not None
        assert proc.popen.wait(30) == 0
    assert isinstance(proc.popen, ForkedChild)
    assert "--rate" in proc.log_text()  # its parser's help, in its own log
    # A module the zygote does not hold, and a process of its own session: exec'd.
    with ProcessGroup(tmp_path / "logs2") as other:
        plain = other.add("true", ["true"])
        session = other.add(
            "own", python_module_argv("clone.tools.drill.client", "--help"), own_session=True
        )
        for p in (plain, session):
            assert p.popen is not None and p.popen.wait(30) == 0
            assert not isinstance(p.popen, ForkedChild)


@pytest.mark.parametrize(
    ("change", "forkable"),
    [
        ({}, True),
        ({"PYTHONUNBUFFERED": "1"}, True),  # applied by the child itself
        ({"LD_PRELOAD": "/usr/lib/faketime/libfaketime.so.1"}, False),
        ({"PYTHONHASHSEED": "7"}, False),
        ({"PYTHONPATH": str(ROOT)}, True),
        ({"PYTHONPATH": "/elsewhere"}, False),  # another release's code
    ],
)
def test_a_fork_applies_only_to_what_the_zygote_started_with(
    change: dict[str, str], forkable: bool
) -> None:
    zygote_env = {"PATH": "/usr/bin", "PYTHONPATH": ""}
    assert _fork_applies({**zygote_env, **change}, zygote_env) is forkable
