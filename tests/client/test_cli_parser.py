"""The ``clone`` command's parsing and local rules, without servers:
flags after the subcommand, ``-w json``, usage errors in shell words, exact
value bytes, lease ownership as ``lease list`` matches it, and a CLI module
that does not import the client library."""

from __future__ import annotations

import argparse
import ast
import hashlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clone.client import cli
from clone.client.commands import kv, leases
from clone.client.locked import DEFAULT_KILL_GRACE
from clone.layered import resolve
from tests.support.servers import ROOT


def parse(*argv: str) -> argparse.Namespace:
    args = resolve(cli._parser(), list(argv), env_prefix=cli.ENV_PREFIX, environ={}).args
    return args


@pytest.mark.parametrize(
    "argv",
    [
        ["--servers", "h:1", "--timeout", "7", "--json", "get", "/k"],
        ["get", "/k", "--servers", "h:1", "--timeout", "7", "--json"],
        ["get", "--servers", "h:1", "/k", "-w", "json", "--timeout", "7"],
        ["--timeout", "7", "get", "/k", "--servers", "h:1", "--json"],
    ],
)
def test_connection_flags_before_or_after_the_subcommand(argv: list[str]) -> None:
    args = parse(*argv)
    assert args.servers == "h:1" and args.timeout == 7.0 and args.key == "/k"
    assert args.json or getattr(args, "write_out", None) == "json"


def test_a_flag_before_the_subcommand_is_not_reset_by_its_default() -> None:
    args = parse("--servers", "h:1", "--heartbeat", "0.2", "-v", "set", "/k", "v")
    assert (args.servers, args.heartbeat, args.verbose) == ("h:1", 0.2, True)
    assert args.timeout == 5.0 and args.json is False


def test_curve_flags_after_the_subcommand_still_go_together() -> None:
    args = parse("status", "--curve-secret", "/a.key_secret", "--server-key", "/s.key")
    assert (args.curve_secret, args.server_key) == ("/a.key_secret", "/s.key")


def test_status_and_backup_keep_their_own_timeout() -> None:
    assert parse("status", "--timeout", "3").status_timeout == 3.0
    assert parse("backup", "f", "--timeout", "9").backup_timeout == 9.0


def test_lease_verbs_and_elect_parse() -> None:
    args = parse("lease", "grant", "30", "--lease-secret", "ab" * 16, "--servers", "h:1")
    assert (args.lease_command, args.ttl, args.servers) == ("grant", 30.0, "h:1")
    assert args.handler is leases.run_grant
    assert parse("lease", "keep-alive", "0" * 32).handler is leases.run_keep_alive
    assert parse("lease", "revoke", "0" * 32).handler is leases.run_revoke
    assert parse("lease", "list").handler is leases.run_list
    args = parse("elect", "--listen", "/el/x")
    assert args.listen and args.proposal is None and leases.check(args) is None
    assert leases.check(parse("elect", "/el/x")) == "elect takes NAME PROPOSAL, or --listen NAME"
    assert leases.check(parse("elect", "/el/x", "me")) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["set", "/k", ""], "an empty value would delete the key; use 'clone del /k' to delete"),
        (["set", "/k"], "set needs a VALUE (or - for stdin, or --file PATH)"),
        (["set", "/k", "v", "--file", "f"], "set takes a VALUE or --file PATH, not both"),
        (["del"], "del takes a KEY or --prefix P (not both)"),
        (["del", "/k", "--prefix", "/p"], "del takes a KEY or --prefix P (not both)"),
        (["del", "--prefix", ""], "--prefix '' would delete every key; name a prefix"),
        (["del", "/k", "--dry-run"], "--dry-run is for --prefix"),
        (["del", "--prefix", "/p", "--if-seq", "3"], "--if-seq is for one key, not with --prefix"),
    ],
)
def test_usage_errors_in_shell_words(argv: list[str], message: str) -> None:
    assert kv.check(parse(*argv)) == message


def test_usage_errors_exit_2_before_connecting(capsys: pytest.CaptureFixture[str]) -> None:
    # No server anywhere: a usage error must not wait for one.
    assert cli.main(["--servers", "127.0.0.1:1", "set", "/k", ""]) == cli.EXIT_UNREACHABLE
    assert "use 'clone del /k' to delete" in capsys.readouterr().err


def test_if_seq_and_if_absent_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        parse("set", "/k", "v", "--if-seq", "3", "--if-absent")
    assert parse("set", "/k", "v", "--if-absent").if_absent


def test_value_bytes_are_kept_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # What Python makes of argv bytes that are not UTF-8: surrogate escapes.
    arg = os.fsdecode(b"\xff\x00ok")
    assert kv.read_value(parse("set", "/k", arg)) == b"\xff\x00ok"
    blob = bytes(range(256))
    (tmp_path / "v").write_bytes(blob)
    assert kv.read_value(parse("set", "/k", "--file", str(tmp_path / "v"))) == blob

    class Stdin:
        buffer = io.BytesIO(blob)

    monkeypatch.setattr(sys, "stdin", Stdin)
    assert kv.read_value(parse("set", "/k", "-")) == blob


def test_lease_list_matches_the_owner_the_server_records() -> None:
    secret = "ab" * 16
    # clone.server.ownership.secret_owner, recomputed on the client side.
    assert leases.owner_of(secret, None) == "secret:" + hashlib.sha256(secret.encode()).hexdigest()
    assert leases.owner_of("", "/keys/alice.key_secret") == "name:alice"
    assert leases.owner_of("", None) is None


def test_owner_of_agrees_with_the_server() -> None:
    from clone.server.ownership import secret_owner

    assert leases.owner_of("cd" * 16, None) == secret_owner("cd" * 16)


def test_kill_grace_default_is_the_lock_runners() -> None:
    assert cli.KILL_GRACE == DEFAULT_KILL_GRACE


def _imported(setup: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has imported after ``setup``."""
    code = f"import sys; {setup}; print(sorted(m for m in {modules!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return ast.literal_eval(out.stdout.strip())


def test_the_cli_module_imports_neither_zmq_nor_the_client() -> None:
    setup = "import clone.client.cli as c; c._parser()"
    modules = ("zmq", "clone.client.frontend", "clone.client.agent", "tornado")
    assert _imported(setup, modules) == []


def test_the_client_imports_no_event_loop_and_no_server_security() -> None:
    # asyncio came with zmq.utils.monitor and zmq.auth.thread (the Gatekeeper's),
    # tomllib with the ACL: 20-30 ms of every clone command's start, for nothing a
    # client runs.
    modules = ("asyncio", "zmq.asyncio", "zmq.auth.thread", "tomllib", "clone.security.zap",
               "clone.security.acl", "tornado")  # fmt: skip
    setup = "import clone.client.frontend, clone.client.cli, clone.client.commands.diagnose"
    assert _imported(setup, modules) == []


def test_clone_still_exports_the_api_lazily() -> None:
    import clone

    assert clone.Clone.__name__ == "Clone"
    assert issubclass(clone.NotOwner, clone.WriteRefused)
    assert clone.errors.CloneError is clone.CloneError
    with pytest.raises(AttributeError):
        _ = clone.NoSuchThing  # type: ignore[attr-defined]
