"""The README's run command: scripts/run keeps a local primary+backup pair serving.

Every test moves the pair with ``--port`` onto free loopback ports (P..P+13),
so nothing here fights over the Guide's fixed ports.  Each run's output goes to
a log file that a failing assertion shows; the script runs in its own session
and the whole group is SIGKILLed at teardown whatever happened.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from clone import Clone
from clone.tools.procs import wait_listening
from tests.support.ports import free_base_port
from tests.support.servers import answers_icanhaz

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SPAN = 14  # P..P+13: primary P..P+3, backup P+10..P+13


class RunScript:
    """One ``scripts/run`` process, its log and the servers it supervises."""

    def __init__(self, log_path: Path, *args: str) -> None:
        self.log_path = log_path
        self._log = log_path.open("wb")
        env = dict(os.environ, CLONE_VENV=str(Path(sys.executable).parent.parent))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [str(ROOT / "scripts" / "run"), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self.seen: set[int] = set()  # every server pid ever seen, for the leftover check

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def server(self, role: str, timeout: float = 30) -> psutil.Process:
        """The live ``--primary`` or ``--backup`` child."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.text()
            for child in psutil.Process(self.proc.pid).children():
                try:
                    if f"--{role}" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                        self.seen.add(child.pid)
                        return child
                except psutil.NoSuchProcess:
                    pass
            assert time.monotonic() < deadline, f"no {role} child\n{self.text()}"
            time.sleep(0.05)

    def wait_log_count(self, text: str, count: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while self.text().count(text) < count:
            assert self.proc.poll() is None, self.text()
            assert time.monotonic() < deadline, f"{count} x {text!r} never logged\n{self.text()}"
            time.sleep(0.05)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM to the script; its exit status once every server is gone."""
        for role in ("primary", "backup"):
            self.server(role)
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        left = [p for p in self.seen if psutil.pid_exists(p) and _not_zombie(p)]
        assert not left, f"servers left behind: {left}\n{self.text()}"
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.seen:  # a restarted server outlives a killed script only by a bug
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._log.close()


def _not_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def base_port() -> int:
    return free_base_port(SPAN)


@pytest.fixture
def run_factory() -> Iterator[list[RunScript]]:
    runs: list[RunScript] = []
    yield runs
    for run in runs:
        run.close()


def _start(runs: list[RunScript], tmp_path: Path, *args: str) -> RunScript:
    """scripts/run with its state under ``tmp_path/data`` (not the checkout's clone-data/)."""
    run = RunScript(tmp_path / f"run{len(runs)}.log", "--data-root", str(tmp_path / "data"), *args)
    runs.append(run)
    return run


def _answers_snapshot(port: int, timeout: float) -> None:
    """A raw ICANHAZ? to ``port`` is answered with KTHXBAI within ``timeout`` s."""
    if not answers_icanhaz(port, timeout, b"/run-script/"):
        raise AssertionError(f"no KTHXBAI from port {port} within {timeout} s")


@pytest.mark.timeout(120)
def test_run_serves_on_the_ports_it_names_and_stops_on_sigterm(
    tmp_path: Path, base_port: int, run_factory: list[RunScript]
) -> None:
    p = base_port
    run = _start(
        run_factory, tmp_path, "--port", str(p), "--bind", "127.0.0.1", "--heartbeat", "200"
    )
    primary, backup = f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 10}"
    deadline = time.monotonic() + 90
    with Clone([primary, backup], heartbeat=0.2) as client:
        while True:
            try:
                client.wait_synced(1)
                break
            except Exception:
                assert run.proc.poll() is None, run.text()
                assert time.monotonic() < deadline, f"the pair never served\n{run.text()}"
        client.set("/run/check", b"ok", wait=True, timeout=10)
        assert client.get("/run/check") == b"ok"
        assert client.status().server == primary  # the primary serves
    text = run.text()
    assert (
        f"on tcp://127.0.0.1:{p}-{p + 2}, Binary Star {p + 3}; backup" in text
        and f"on tcp://127.0.0.1:{p + 10}-{p + 12}, Binary Star {p + 13};" in text
    ), text
    assert f"--servers {primary},{backup}" in text
    for port in (p, p + 1, p + 2, p + 3, p + 10, p + 11, p + 12, p + 13):
        assert wait_listening(port, time.monotonic() + 5), f"nothing on {port}\n{text}"
    # The backup follows once it hears the primary's state: on an idle machine
    # the client is done before that (0.2 s after the start), so wait for it.
    run.wait_log_count("now PASSIVE", 1)
    assert run.stop() == 0
    text = run.text()
    assert text.count("server stopped") == 2, text
    assert "now ACTIVE" in text and "now PASSIVE" in text
    assert "restarted: pid" not in text and "Traceback" not in text, text


@pytest.mark.timeout(150)
def test_run_restarts_a_killed_server_while_the_other_keeps_serving(
    tmp_path: Path, base_port: int, run_factory: list[RunScript]
) -> None:
    p = base_port
    run = _start(
        run_factory, tmp_path, "--port", str(p), "--bind", "127.0.0.1", "--heartbeat", "100"
    )
    _answers_snapshot(p, 60)  # the primary serves
    run.wait_log_count("now PASSIVE", 1)  # the backup follows it
    # ...and has synced: until then a durable passive takes no vote.
    run.wait_log_count("synced from", 1)

    # kill -9 the primary: the backup takes the vote and serves; the primary comes back.
    first = run.server("primary")
    first.kill()
    _answers_snapshot(p + 10, 20)
    run.wait_log_count("primary restarted: pid", 1)
    again = run.server("primary")
    assert again.pid != first.pid
    assert wait_listening(p, time.monotonic() + 20), run.text()
    run.wait_log_count("now PASSIVE", 2)  # it came back as the passive one
    # ...and has synced: until then a durable passive takes no vote (its data
    # may be older than what the active confirmed), so killing the active
    # before it would leave the pair without a server to vote for.
    run.wait_log_count("synced from", 2)

    # kill -9 the backup, active now: the restarted primary takes over; the backup comes back.
    victim = run.server("backup")
    victim.kill()
    _answers_snapshot(p, 20)
    run.wait_log_count("backup restarted: pid", 1)
    assert run.server("backup").pid != victim.pid
    assert wait_listening(p + 10, time.monotonic() + 20), run.text()
    run.wait_log_count("now PASSIVE", 3)

    text = run.text()
    assert f"primary (pid {first.pid}) died (killed by SIGKILL)" in text, text
    assert f"backup (pid {victim.pid}) died (killed by SIGKILL)" in text, text
    assert "restarting it in 0.5 s" in text, text
    assert run.stop() == 0


@pytest.mark.timeout(150)
def test_the_pair_keeps_its_keys_across_a_restart_of_the_script(
    tmp_path: Path, base_port: int, run_factory: list[RunScript]
) -> None:
    """The README's run command is durable: stop it, start it again, the keys are there."""
    p = base_port
    args = ("--port", str(p), "--bind", "127.0.0.1", "--heartbeat", "100")
    servers = [f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{p + 10}"]
    run = _start(run_factory, tmp_path, *args)
    with Clone(servers, heartbeat=0.1) as client:
        client.wait_synced(60)
        for i in range(50):
            client.set(f"/kept/{i}", b"v%d" % i, wait=True, timeout=10)
    assert run.stop() == 0
    assert (tmp_path / "data" / f"primary-{p}" / "clone.db").exists()
    assert (tmp_path / "data" / f"backup-{p + 10}" / "clone.db").exists()
    again = _start(run_factory, tmp_path, *args)
    with Clone(servers, heartbeat=0.1) as client:
        client.wait_synced(60)
        assert {k: client.get(k) for k in (f"/kept/{i}" for i in range(50))} == {
            f"/kept/{i}": b"v%d" % i for i in range(50)
        }
    assert again.stop() == 0
