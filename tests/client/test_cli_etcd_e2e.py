"""The ``clone`` command at etcdctl's level, through the real
command (``python -m clone.client.cli``, as the console script runs it) in
subprocesses against a real pair: get/set with sequences and bytes, del
--prefix, leases, elections, flags after the subcommand, errors that name
their cause, and watch ending when its reader goes away."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.ports import free_base_port
from tests.support.servers import ROOT, ServerProcess, Servers
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

CLONE_CLI = (sys.executable, "-m", "clone.client.cli")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    for name in [n for n in env if n.startswith("CLONE_")]:
        del env[name]
    env.update(extra)
    return env


class Pair:
    def __init__(self, primary: ServerProcess, backup: ServerProcess) -> None:
        self.primary, self.backup = primary, backup
        self.servers = f"tcp://127.0.0.1:{primary.port},127.0.0.1:{backup.port}"

    def run(
        self, *args: str | bytes, stdin: bytes | None = None, timeout: float = 30,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[bytes]:
        """``clone ARGS --servers ...``: the connection flags after the subcommand."""
        return subprocess.run(
            [*CLONE_CLI, *args, "--servers", self.servers, "--heartbeat", "0.1"],
            input=stdin, capture_output=True, timeout=timeout, env=env or _env(), cwd=ROOT,
        )  # fmt: skip

    def ok(self, *args: str | bytes, **kw: object) -> str:
        r = self.run(*args, **kw)  # type: ignore[arg-type]
        assert r.returncode == 0, (args, r.returncode, r.stderr.decode())
        return r.stdout.decode()

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [*CLONE_CLI, *args, "--servers", self.servers, "--heartbeat", "0.1"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or _env(), cwd=ROOT,
        )  # fmt: skip


@pytest.fixture
def pair(servers: Servers) -> Iterator[Pair]:
    yield Pair(*servers.pair())


def test_set_prints_the_sequence_and_get_json_shows_it(pair: Pair) -> None:
    seq = int(pair.ok("set", "/e/k", "v1", "--ttl", "600"))
    got = json.loads(pair.ok("get", "/e/k", "--json"))
    assert got["key"] == "/e/k" and got["value"] == "v1"
    assert got["sequence"] == seq
    assert 0 < got["ttl"] <= 600
    assert got["lease"] is None
    assert len(got["uuid"]) == 32
    # -w json (etcdctl's spelling) and set --json
    assert json.loads(pair.ok("get", "-w", "json", "/e/k"))["sequence"] == seq
    out = json.loads(pair.ok("--json", "set", "/e/k", "v2"))
    assert out == {"key": "/e/k", "sequence": out["sequence"]} and out["sequence"] > seq
    # the global flags before the subcommand still work
    r = subprocess.run([*CLONE_CLI, "--servers", pair.servers, "--timeout", "10", "get", "/e/k"],
                       capture_output=True, env=_env(), cwd=ROOT, timeout=30)  # fmt: skip
    assert (r.returncode, r.stdout) == (0, b"v2\n")


def test_bytes_that_are_not_utf8_round_trip(pair: Pair, tmp_path: Path) -> None:
    blob = bytes(range(256)) + b"\xff\x00\n"
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(blob)
    pair.ok("set", "/bin/file", "--file", str(src))
    pair.ok("get", "/bin/file", "-o", str(dst))
    assert dst.read_bytes() == blob
    got = json.loads(pair.ok("get", "/bin/file", "--json"))
    assert got["base64"] is True
    # stdin, and raw bytes to a pipe
    pair.ok("set", "/bin/stdin", "-", stdin=blob)
    assert pair.run("get", "/bin/stdin", "--raw").stdout == blob
    # a value argument that is not UTF-8 (the shell's "$(cat nul.dat)")
    pair.ok("set", "/bin/argv", b"\xff\xfeok")
    assert pair.run("get", "/bin/argv", "--raw").stdout == b"\xff\xfeok"


def test_if_absent_and_if_seq(pair: Pair) -> None:
    first = int(pair.ok("set", "/cas/k", "1", "--if-absent"))
    r = pair.run("set", "/cas/k", "2", "--if-absent")
    assert r.returncode == 5 and int(r.stdout) == first
    assert b"not absent" in r.stderr
    r = pair.run("set", "/cas/k", "2", "--if-seq", str(first + 1000))
    assert r.returncode == 5
    assert int(pair.ok("set", "/cas/k", "2", "--if-seq", str(first))) > first


# The value and the sequence of ``clone get --json``, in one helper process.
FIELDS = "import json,sys; d=json.load(sys.stdin); print(d['value'], d['sequence'])"


# 5 shells contend for every increment (each try is two CLI processes and a
# helper, about 0.3 CPU-seconds: CPU-bound, 82 s idle for 100 increments, the
# suite's costliest test in CPU at 40); 4 each still make every shell lose
# races to the others, which is what the loop is here to survive.
@pytest.mark.timeout(900)  # 20 increments and their conflicts: a hundred processes
def test_a_shell_cas_loop_of_5_processes_x_4_increments_ends_at_20(
    pair: Pair, tmp_path: Path
) -> None:
    pair.ok("set", "/cas/n", "0")
    # --timeout: a ceiling for a starved command, not a pace (the default 5 s
    # ran out at load average 25 and ended a shell with exit 9).
    flags = f"--servers {pair.servers} --heartbeat 0.1 --timeout 60"
    script = tmp_path / "inc.sh"
    script.write_text(textwrap.dedent(f"""\
        set -u
        clone() {{ {" ".join(CLONE_CLI)} "$@" {flags}; }}
        fields() {{ {sys.executable} -c "{FIELDS}"; }}
        done=0
        while [ $done -lt 4 ]; do
            got=$(clone get /cas/n --json) || exit 9
            # Value and sequence in one helper process: hundreds of tries.
            set -- $(printf '%s' "$got" | fields)
            n=$1 s=$2
            if clone set /cas/n $((n + 1)) --if-seq "$s" >/dev/null 2>&1; then
                done=$((done + 1))
            else
                rc=$?; [ $rc -eq 5 ] || exit $rc
            fi
        done
        """))  # fmt: skip
    procs = [subprocess.Popen(["sh", str(script)], env=_env(), cwd=ROOT,
                              start_new_session=True) for _ in range(5)]  # fmt: skip
    try:
        for proc in procs:
            assert proc.wait(timeout=840) == 0
    finally:
        for proc in procs:  # the shells and whatever clone they run now
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    assert pair.ok("get", "/cas/n") == "20\n"


def test_del_prefix_lists_then_deletes_with_a_count(pair: Pair) -> None:
    for i in range(3):
        pair.ok("set", f"/gone/{i}", "x")
    pair.ok("set", "/gonex", "stays")
    assert pair.ok("del", "--prefix", "/gone/", "--dry-run").split() == [
        "/gone/0", "/gone/1", "/gone/2",
    ]  # fmt: skip
    assert pair.ok("dump", "/gone/").count("\n") == 3  # --dry-run deleted nothing
    assert pair.ok("del", "--prefix", "/gone/") == "deleted 3 keys under /gone/\n"
    assert pair.ok("dump", "/gone") == "/gonex=stays\n"
    r = pair.run("del", "--prefix", "")
    assert r.returncode == 2 and b"every key" in r.stderr


class _Lines:
    """A process's stdout lines as they come (a thread reads them), for
    waiting on one with a ceiling instead of blocking in ``readline``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        out = proc.stdout
        threading.Thread(target=self._read, args=(out,), daemon=True).start()

    def _read(self, out: IO[bytes]) -> None:
        for line in iter(out.readline, b""):
            self.lines.append(line.decode().rstrip("\n"))

    def wait_for(self, line: str, timeout: float) -> None:
        eventually(lambda: line in self.lines, timeout=timeout, what=f"{line!r} in {self.lines}")


def _grant_bind_list_revoke(pair: Pair) -> None:
    out = pair.ok("lease", "grant", "60").splitlines()
    lease_id = out[0].split()[1]
    assert out[1].startswith("CLONE_LEASE_SECRET=")
    env = _env(CLONE_LEASE_SECRET=out[1].split("=", 1)[1])
    pair.ok("set", "/svc/a", "10.0.0.1", "--lease", lease_id, env=env)
    assert json.loads(pair.ok("get", "/svc/a", "--json"))["lease"] == lease_id
    assert pair.ok("lease", "list", env=env) == f"{lease_id} ttl=60s keys=1\n"
    assert pair.ok("lease", "list", "--lease-secret", "0" * 32) == ""  # not ours
    # Without the secret the lease is not ours to use.
    r = pair.run("set", "/svc/b", "x", "--lease", lease_id)
    assert r.returncode == 4 and b"owner" in r.stderr, r.stderr
    r = pair.run("lease", "revoke", lease_id)
    assert r.returncode == 4
    pair.ok("lease", "revoke", lease_id, env=env)
    assert pair.run("get", "/svc/a").returncode == 1  # deleted with its lease


def test_lease_grant_bind_list_keep_alive_revoke(pair: Pair) -> None:
    # One watch from the start of the history says when a lease's key is
    # deleted (polling ``get`` started a process after a process: CPU the
    # other tests of the run need).
    watch = pair.popen("watch", "/svc/", "--since", "0")
    deleted = _Lines(watch)
    try:
        # A short lease kept alive by keep-alive outlives its ttl; it ends after.
        # The keeper is another process, started after the grant: the ttl must
        # cover its start, sync and first keepalive on a busy machine (3 s and 5 s
        # did not, beside stress-ng at load average 20).  The secret is another
        # than the grant-and-list part's, so that its lease list is its own.
        env = _env(CLONE_LEASE_SECRET=secrets.token_hex(16))
        granted = json.loads(pair.ok("lease", "grant", "10", "--json", env=env))
        assert granted["secret"] is None  # given by the environment: not repeated
        keeper = pair.popen("lease", "keep-alive", granted["id"], env=env)
        try:
            assert keeper.stdout is not None
            held = keeper.stdout.readline()
            assert held.startswith(b"lease " + granted["id"].encode() + b" kept alive"), held
            pair.ok("set", "/svc/c", "x", "--lease", granted["id"], env=env)
            # The control: a lease of the same ttl granted after the kept one,
            # and never kept alive.  Once its key is gone, the kept lease would
            # be too without its keeper (it is older), however late the server
            # expires leases; where the test waited twice the ttl instead.
            control = json.loads(pair.ok("lease", "grant", "10", "--json", env=env))
            pair.ok("set", "/svc/d", "x", "--lease", control["id"], env=env)
            _grant_bind_list_revoke(pair)  # meanwhile, with a lease of its own
            deleted.wait_for("/svc/d (deleted)", timeout=60)
            assert keeper.poll() is None, keeper.stderr  # a keeper that exits early fails
            assert pair.run("get", "/svc/c").returncode == 0
            keeper.send_signal(signal.SIGINT)
            assert keeper.wait(timeout=30) == 0
        finally:
            keeper.kill()
            keeper.wait()
        deleted.wait_for("/svc/c (deleted)", timeout=30)  # it ends a ttl after the keeper
    finally:
        watch.kill()
        watch.wait()


def test_elect_prints_the_leader_and_listen_follows_it(pair: Pair) -> None:
    first = pair.popen("elect", "/el/sched", "node-a", "--ttl", "1")
    listener = second = None
    try:
        assert first.stdout is not None
        assert first.stdout.readline() == b"node-a\n"
        second = pair.popen("elect", "/el/sched", "node-b", "--ttl", "1")
        listener = pair.popen("elect", "--listen", "/el/sched")
        assert listener.stdout is not None and second.stdout is not None
        assert listener.stdout.readline() == b"node-a\n"
        assert second.stdout.readline() == b"node-a\n"
        first.kill()  # its lease runs out: node-b leads
        assert listener.stdout.readline() == b"node-b\n"
        assert second.stdout.readline() == b"node-b\n"
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=30) == 0
    finally:
        for proc in (first, second, listener):
            if proc is not None:
                proc.kill()
                proc.wait()


def test_only_the_passive_or_nothing_listening_says_so(pair: Pair) -> None:
    passive = f"tcp://127.0.0.1:{pair.backup.port}"
    r = subprocess.run([*CLONE_CLI, "get", "/x", "--servers", passive, "--timeout", "2"],
                       capture_output=True, env=_env(), cwd=ROOT, timeout=30)  # fmt: skip
    assert r.returncode == 2
    assert f"{passive} is passive; list the active too".encode() in r.stderr, r.stderr
    nobody = f"tcp://127.0.0.1:{free_base_port()}"
    r = subprocess.run([*CLONE_CLI, "get", "/x", "--servers", nobody, "--timeout", "1"],
                       capture_output=True, env=_env(), cwd=ROOT, timeout=30)  # fmt: skip
    assert r.returncode == 2
    assert f"nothing listening at {nobody}".encode() in r.stderr, r.stderr


def test_a_refused_key_and_an_acl_refusal_say_so(servers: Servers, tmp_path: Path) -> None:
    keys = CurveKeys.make(tmp_path / "sec", admitted=("alice",), strangers=("mallory",))
    keys.write_acl({"alice": ([""], ["/mine/"])})
    primary, backup = servers.pair(*keys.server_args(), wait=False)
    primary.wait_log("now ACTIVE")
    backup.wait_log("synced from")
    wait_serving_curve(primary, keys, "alice")
    where = f"tcp://127.0.0.1:{primary.port},tcp://127.0.0.1:{backup.port}"

    def clone(name: str, *args: str) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [*CLONE_CLI, *args, "--servers", where, "--timeout", "2",
             "--curve-secret", str(keys.secret(name)), "--server-key", str(keys.pair_public)],
            capture_output=True, env=_env(), cwd=ROOT, timeout=30,
        )  # fmt: skip

    r = clone("mallory", "get", "/x")
    assert r.returncode == 2
    assert f"tcp://127.0.0.1:{primary.port} refused our key".encode() in r.stderr, r.stderr
    assert clone("alice", "set", "/mine/k", "v").returncode == 0
    r = clone("alice", "set", "/theirs/k", "v")
    assert r.returncode == 4
    assert b"ACL does not let this client write '/theirs/k'" in r.stderr, r.stderr


def test_watch_into_a_closed_pipe_exits_without_a_change(pair: Pair) -> None:
    # `clone watch /x | true`: the reader is gone before any change comes.
    shell = (f"{' '.join(CLONE_CLI)} watch /quiet/ --servers {pair.servers} --heartbeat 0.1;"
             " echo rc=$? >&2")  # fmt: skip
    started = time.monotonic()
    r = subprocess.run(["sh", "-c", f"({shell}) | true"], capture_output=True, env=_env(),
                       cwd=ROOT, timeout=60)  # fmt: skip
    assert b"rc=141" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr
    assert time.monotonic() - started < 30


@pytest.mark.timeout(180)
def test_watch_piped_into_head_stops_after_the_first_line(pair: Pair) -> None:
    # The same value again and again: every write is a change to a watcher,
    # also a rewrite of the value its snapshot already holds (it once was
    # not, and a first write that landed before the watch had synced left
    # the watch waiting for ever).
    shell = f"{' '.join(CLONE_CLI)} watch /w/ --servers {pair.servers} --heartbeat 0.1"
    proc = subprocess.Popen(["sh", "-c", f"{shell} | head -1"], stdout=subprocess.PIPE,
                            env=_env(), cwd=ROOT, start_new_session=True)  # fmt: skip
    try:
        def written() -> bool:
            pair.ok("set", "/w/a", "1")
            return proc.poll() is not None

        eventually(written, timeout=120)  # a write after the watch registered ends it
        assert proc.stdout is not None and proc.stdout.read() == b"/w/a=1\n"
    finally:
        try:  # the shell, the watch and head, whichever still run
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def test_an_empty_value_is_refused_in_shell_words(pair: Pair) -> None:
    r = pair.run("set", "/e/k", "")
    assert r.returncode == 2
    assert b"use 'clone del /e/k' to delete" in r.stderr
    assert b"delete()" not in r.stderr


def test_watch_since_piped_into_head_stops_after_the_first_line(pair: Pair) -> None:
    # The first line comes from the history (--since), so it does not depend on
    # when the watch registered; head then exits and the watch must follow.
    first = int(pair.ok("set", "/ws/a", "1"))
    pair.ok("set", "/ws/b", "2")
    shell = (f"{' '.join(CLONE_CLI)} watch /ws/ --since {first - 1} --servers {pair.servers}"
             " --heartbeat 0.1; echo rc=$? >&2")  # fmt: skip
    r = subprocess.run(["sh", "-c", f"({shell}) | head -1"], capture_output=True, env=_env(),
                       cwd=ROOT, timeout=60)  # fmt: skip
    assert r.stdout == b"/ws/a=1\n"
    assert b"rc=141" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr
