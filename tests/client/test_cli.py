"""The ``clone`` command and the runnable example, as subprocesses against a real server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from clone import Clone
from clone.client.cli import main
from tests.support.ports import free_base_port
from tests.support.servers import ROOT, ServerProcess, Servers

# One worker runs the file's server tests, so its one server (``solo``) starts once.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("test_cli")]

#: How a user runs the ``clone`` command (without the console script).
CLONE_CLI = (sys.executable, "-m", "clone.client.cli")


def env_with(servers_list: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("CLONE_SERVERS", None)
    if servers_list:
        env["CLONE_SERVERS"] = servers_list
    return env


@pytest.fixture(scope="module")
def solo(module_servers: Servers) -> ServerProcess:
    """One server for the file: each test keeps to a key prefix of its own
    (/cli/, /d/, /env/, /bare/, /pipe/, /w/, /quiet/, /hello/) and none stops it."""
    return module_servers.standalone()


def ep(server: ServerProcess) -> str:
    return f"tcp://127.0.0.1:{server.port}"


def clone_cmd(
    server: ServerProcess | None, *args: str, timeout: float = 20
) -> subprocess.CompletedProcess[str]:
    head = ["--servers", ep(server), "--heartbeat", "0.1"] if server else []
    return subprocess.run(
        [*CLONE_CLI, *head, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env_with(),
        cwd=ROOT,
    )


def test_set_get_del(solo: ServerProcess) -> None:
    r = clone_cmd(solo, "set", "/cli/k", "héllo")
    assert r.returncode == 0, r.stderr
    r = clone_cmd(solo, "get", "/cli/k")
    assert (r.returncode, r.stdout) == (0, "héllo\n")
    r = clone_cmd(solo, "del", "/cli/k")
    assert r.returncode == 0, r.stderr
    r = clone_cmd(solo, "get", "/cli/k")
    assert r.returncode == 1
    assert "not found" in r.stderr and "Traceback" not in r.stderr


def test_dump_plain_and_json(solo: ServerProcess) -> None:
    with Clone([ep(solo)], heartbeat=0.1) as c:
        c.wait_synced(10)
        c.set("/d/text", "plain", wait=True)
        c.set("/d/bin", b"\xff\x00", wait=True)
        c.set("/other", "x", wait=True)
    assert clone_cmd(solo, "set", "/d/ttl", "t", "--ttl", "30").returncode == 0
    r = clone_cmd(solo, "dump", "/d/")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["/d/bin=\\xff\\x00", "/d/text=plain", "/d/ttl=t"]
    r = clone_cmd(solo, "dump", "--json", "/d/")
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [row["key"] for row in rows] == ["/d/bin", "/d/text", "/d/ttl"]
    assert rows[0]["value"] == "/wA=" and rows[0]["base64"] is True
    assert rows[1]["value"] == "plain" and "base64" not in rows[1]
    assert rows[2]["properties"]["ttl"] == "30" and "expires" in rows[2]["properties"]
    assert all(isinstance(row["sequence"], int) and row["sequence"] > 0 for row in rows)


def test_unreachable_servers_exit_2_without_a_traceback() -> None:
    dead = f"tcp://127.0.0.1:{free_base_port()}"
    t0 = time.monotonic()
    r = subprocess.run(
        [*CLONE_CLI, "--servers", dead, "--timeout", "0.5", "get", "k"],
        capture_output=True,
        text=True,
        timeout=20,
        env=env_with(),
        cwd=ROOT,
    )
    assert r.returncode == 2
    assert f"no server answered a snapshot request within 0.5 s: tried {dead}" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 10


def test_servers_default_to_the_environment(solo: ServerProcess) -> None:
    r = subprocess.run(
        [*CLONE_CLI, "--heartbeat", "0.1", "set", "/env/k", "v"],
        capture_output=True,
        text=True,
        timeout=20,
        env=env_with(ep(solo)),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert clone_cmd(solo, "get", "/env/k").stdout == "v\n"


def test_servers_may_be_given_without_the_scheme(solo: ServerProcess) -> None:
    # clone-pipeline always took host:port; clone takes both spellings too.
    bare = f"127.0.0.1:{solo.port}"
    r = clone_cmd(None, "--servers", bare, "--heartbeat", "0.1", "set", "/bare/k", "v")
    assert r.returncode == 0, r.stderr
    r = subprocess.run(
        [*CLONE_CLI, "--heartbeat", "0.1", "get", "/bare/k"],
        capture_output=True,
        text=True,
        timeout=20,
        env=env_with(f" {bare} ,"),  # $CLONE_SERVERS too, blanks and all
        cwd=ROOT,
    )
    assert (r.returncode, r.stdout) == (0, "v\n"), r.stderr


@pytest.mark.timeout(60)
def test_dump_into_a_closed_pipe_exits_141_quietly(solo: ServerProcess) -> None:
    """``clone dump | head -1``: the reader leaves long before the dump ends."""
    with Clone([ep(solo)], heartbeat=0.1) as c:
        c.wait_synced(10)
        for i in range(499):
            c.set(f"/pipe/{i:04d}", "x" * 1000)
        c.set("/pipe/9999", "x" * 1000, wait=True)  # applied in order: all 500 are in
    # ~0.5 MB of output, far more than a pipe buffers (64 KiB): the dump is still
    # writing when the reader closes its end.
    proc = subprocess.Popen(
        [*CLONE_CLI, "--servers", ep(solo), "--heartbeat", "0.1",
         "dump", "/pipe/"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env_with(),
        cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.readline()
        assert first.startswith(b"/pipe/0000=xxx"), first
        proc.stdout.close()
        assert proc.wait(30) == 141
        err = proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert err == "", err  # no traceback, no "Exception ignored" at exit


def _sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _signal_masks(pid: int) -> str:
    """The process's blocked, ignored and caught signals, as the kernel says."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return ", ".join(
                line.strip() for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt"))
            )
    except OSError as exc:
        return f"no /proc status: {exc}"


def test_watch_streams_changes_until_ctrl_c(solo: ServerProcess) -> None:
    proc = subprocess.Popen(
        [
            *(*CLONE_CLI, "--servers", ep(solo), "--heartbeat", "0.1"),
            *("watch", "--json", "/w/"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # A watch that outlives Ctrl-C is asked for its threads' stacks (SIGABRT).
        env={**env_with(), "PYTHONFAULTHANDLER": "1"},
        cwd=ROOT,
        # As a terminal's foreground job gets it: SIGINT at its default and not
        # blocked, whatever this worker's state (a disposition of SIG_IGN and
        # the signal mask are inherited across exec).
        preexec_fn=_sigint_as_in_a_terminal,
    )
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    lines: list[str] = []

    def read_until(text: str, write: Callable[[], None], timeout: float = 15) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in lines):
            assert time.monotonic() < deadline, f"watch never printed {text!r}: {lines}"
            write()
            time.sleep(0.05)
            lines.extend(proc.stdout.readlines())  # type: ignore[union-attr]

    try:
        with Clone([ep(solo)], heartbeat=0.1) as c:
            c.wait_synced(10)
            counter = iter(range(1_000_000))

            def write() -> None:
                # The watcher may still be starting: write until it reports something.
                i = next(counter)
                c.set("/x/ignored", f"v{i}", wait=True)
                c.set("/w/k", f"v{i}", wait=True)

            read_until('"/w/k"', write)
            c.delete("/w/k", wait=True)
            read_until('"deleted": true', lambda: None)
        proc.send_signal(signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            masks = _signal_masks(proc.pid)
            proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack
            _, stacks = proc.communicate(timeout=10)
            pytest.fail(f"clone watch still ran 10 s after SIGINT ({masks}):\n{stacks[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in [*lines, *out.splitlines()]]
    assert all(r["key"] == "/w/k" for r in rows)
    last = rows[-1]
    assert (last["key"], last["value"], last["deleted"], last["properties"]) == (
        "/w/k",
        None,
        True,
        {},
    )
    assert rows[0]["value"].startswith("v")


def test_watch_duration_ends_by_itself(solo: ServerProcess) -> None:
    # A prefix no other test writes: the server is shared (a ttl key of
    # another test may expire meanwhile).
    r = clone_cmd(solo, "watch", "--duration", "0.3", "/quiet/")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""


def test_main_in_process_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--timeout", "0", "get", "k"]) == 2
    assert "must be > 0" in capsys.readouterr().err
    assert main(["--servers", "nonsense", "get", "k"]) == 2
    assert "clone: server 'nonsense' is not of the form [tcp://]host:port" in (
        capsys.readouterr().err
    )
    assert main(["--servers", "ipc://x:1", "get", "k"]) == 2
    assert "only tcp:// endpoints are supported" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["frobnicate"])


def test_hello_example_runs(solo: ServerProcess) -> None:
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "examples" / "hello.py")],
        capture_output=True,
        text=True,
        timeout=30,
        env=env_with(ep(solo)),
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "Hello, World!"
    assert "/hello/world = b'Hello, World!'" in lines
    assert lines[-1] == "b'yes'"
