"""Settings in layers (clone/layered.py): flags > environment > file > default.

The server's and the clone command's real parsers are used, so a flag another
change adds is checked here too: every option must be a key and a variable.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from clone.client import cli as client_cli
from clone.errors import ConfigError
from clone.layered import (
    Source,
    add_config_flags,
    env_name,
    option_keys,
    resolve,
    unsupported_options,
)
from clone.server import cli as server_cli
from clone.server.config import ServerMode


def _server(
    argv: list[str], env: dict[str, str] | None = None
) -> tuple[argparse.Namespace, dict[str, str]]:
    layered = resolve(
        server_cli.build_parser(), argv, env_prefix=server_cli.ENV_PREFIX, environ=env or {}
    )
    return layered.args, {k: str(v) for k, v in layered.origins.items()}


def _toml(tmp_path: Path, text: str, name: str = "clone-server.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _rows(out: str) -> dict[str, str]:
    """``--print-config``'s lines as {setting: origin}; the padding between them dropped."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("# ") and " is unset" not in line:
            continue  # the title
        setting, _, origin = line.rpartition("  # ")
        rows[setting.strip()] = origin
    return rows


def test_every_server_flag_is_a_key_and_a_variable() -> None:
    keys = option_keys(server_cli.build_parser())
    for key in ("primary", "port", "peer", "ha-port", "peer-ha", "data-dir", "curve-secret",
                "clients", "acl", "http-port", "max-keys", "log-file", "verbose"):
        assert key in keys
    assert "config" not in keys and "print-config" not in keys and "help" not in keys
    assert env_name("CLONE_SERVER_", "data-dir") == "CLONE_SERVER_DATA_DIR"


def test_the_file_sets_what_no_flag_or_variable_sets(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'primary = true\nport = 7000\ndata-dir = "/srv/clone"\n'
                 'fsync = "always"\nheartbeat = 500\n')
    args, origins = _server(["--config", path])
    config = server_cli.config_from_args(args)
    assert config.mode is ServerMode.PRIMARY
    assert (config.port, config.data_dir, config.fsync, config.heartbeat) == (
        7000, "/srv/clone", "always", 0.5)
    assert origins["port"] == f"file {path}"
    assert origins["hwm"] == "default"


def test_the_environment_overrides_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "primary = true\nport = 7000\nheartbeat = 500\n")
    args, origins = _server(["--config", path], {"CLONE_SERVER_PORT": "7100"})
    assert (args.port, args.heartbeat) == (7100, 500)
    assert origins["port"] == "environment CLONE_SERVER_PORT"
    assert origins["heartbeat"] == f"file {path}"


def test_a_flag_overrides_the_environment_and_the_file(tmp_path: Path) -> None:
    path = _toml(tmp_path, "primary = true\nport = 7000\n")
    args, origins = _server(["--config", path, "--port", "7200"], {"CLONE_SERVER_PORT": "7100"})
    assert args.port == 7200
    assert origins["port"] == "flag --port"


def test_the_config_file_may_be_named_by_the_environment(tmp_path: Path) -> None:
    path = _toml(tmp_path, "backup = true\n")
    args, origins = _server([], {"CLONE_SERVER_CONFIG": path})
    assert args.backup and args.config == path
    assert origins["config"] == "environment CLONE_SERVER_CONFIG"


def test_a_role_flag_replaces_the_files_role_instead_of_colliding(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'primary = true\ndata-dir = "/srv/clone"\n')
    args, origins = _server(["--config", path, "--backup"])
    assert (args.primary, args.backup) == (False, True)
    assert origins["primary"] == "default"
    # The durability group the same way: --in-memory from the environment wins.
    args, _ = _server(["--config", path], {"CLONE_SERVER_IN_MEMORY": "yes"})
    assert (args.in_memory, args.data_dir) == (True, None)


def test_two_roles_in_one_layer_are_refused_naming_both(tmp_path: Path) -> None:
    path = _toml(tmp_path, "primary = true\nbackup = true\n")
    with pytest.raises(ConfigError, match=r"primary \(file .*\), backup \(file .*\)"):
        _server(["--config", path])


def test_no_role_anywhere_is_refused() -> None:
    with pytest.raises(ConfigError, match="--primary --backup --standalone --relay is required"):
        _server([])


def test_unknown_keys_are_an_error_naming_each(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'primary = true\ndata_dir = "/x"\nhartbeat = 5\nzzz = 1\n')
    with pytest.raises(ConfigError) as exc:
        _server(["--config", path])
    message = str(exc.value)
    assert "unknown keys" in message and path in message
    assert "data_dir (spelled data-dir, as the flag)" in message
    assert "hartbeat (did you mean heartbeat?)" in message
    assert "zzz" in message


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('primary = "yes"', r"primary: expected true or false, got str 'yes'"),
        ("primary = true\nport = true", r"port: expected a string or a number, got a boolean"),
        ('primary = true\nport = "abc"', r"port: expected a port number, got 'abc'"),
        ("primary = true\nport = 0", r"port: must be a port in 1\.\."),
        ("primary = true\nheartbeat = 0.5", r"heartbeat: .*0\.5"),
        ("primary = true\ndata-dir = 5", r"data-dir: expected a string, got int 5"),
        ('primary = true\nfsync = "sometimes"', r"fsync: invalid choice 'sometimes'"),
        ("primary = true\n[limits]\nmax-keys = 5", r"unknown key limits"),
        ("primary = true\npeer = [1]", r"peer: expected a string or a number, got list"),
    ],
)
def test_a_wrong_type_is_an_error_naming_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = _toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match=message):
        _server(["--config", path])


def test_bad_files_and_variables_are_errors_naming_them(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read the config file .*missing\.toml"):
        _server(["--config", str(tmp_path / "missing.toml")])
    with pytest.raises(ConfigError, match="is not valid TOML"):
        _server(["--config", _toml(tmp_path, "primary = \n")])
    with pytest.raises(ConfigError, match="environment CLONE_SERVER_PRIMARY: expected 1/true"):
        _server([], {"CLONE_SERVER_PRIMARY": "maybe"})
    with pytest.raises(ConfigError, match="environment CLONE_SERVER_MISSED: "):
        _server(["--primary"], {"CLONE_SERVER_MISSED": "-1"})


def test_unknown_and_empty_variables_are_ignored() -> None:
    # $CLONE_SERVER_KEY is the clone command's; a stray one must not stop a server.
    args, origins = _server(
        ["--primary"], {"CLONE_SERVER_KEY": "/etc/clone/pair.key", "CLONE_SERVER_PORT": ""}
    )
    assert args.port is None and origins["port"] == "default"


def test_a_false_variable_overrides_a_true_key(tmp_path: Path) -> None:
    path = _toml(tmp_path, "primary = true\nverbose = true\n")
    args, origins = _server(["--config", path], {"CLONE_SERVER_VERBOSE": "0"})
    assert args.verbose is False
    assert origins["verbose"] == "environment CLONE_SERVER_VERBOSE"


def test_print_config_shows_each_setting_and_its_origin_and_no_secret(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = tmp_path / "pair.key_secret"
    secret.write_text("SECRET-KEY-MATERIAL\n")
    path = _toml(tmp_path, f'primary = true\ncurve-secret = "{secret}"\nport = 7000\n'
                 f'clients = "{tmp_path}"\n')
    code = server_cli.main(["--config", path, "--print-config", "--http-port", "9100"])
    out = capsys.readouterr().out
    assert code == 0
    lines = _rows(out)
    assert lines["primary = true"] == f"file {path}"
    assert lines[f'curve-secret = "{secret}"'] == f"file {path}"
    assert lines["http-port = 9100"] == "flag --http-port"
    assert lines['fsync = "batch"'] == "default"
    assert "# peer-wait is unset" in out
    assert "SECRET-KEY-MATERIAL" not in out
    assert out.startswith("# clone-server settings: flag > environment (CLONE_SERVER_*)")


def test_print_config_still_reports_an_invalid_combination(
    capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        server_cli.main(["--relay", "--print-config"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert "relay = true" in captured.out
    assert "--relay needs --upstream" in captured.err


def test_every_flag_of_both_commands_can_come_from_a_file() -> None:
    # A flag of a kind no file value stands for would be left to the command line.
    assert unsupported_options(server_cli.build_parser()) == []
    assert unsupported_options(client_cli._parser()) == []


def test_lists_switches_and_flags_left_to_the_command_line(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-q", "--quiet", action="count")
    parser.add_argument("--name", action="append")
    parser.add_argument("--relay", nargs="+", type=int)
    parser.add_argument("--color", action=argparse.BooleanOptionalAction)
    add_config_flags(parser, env_prefix="T_")
    assert option_keys(parser) == ["name", "relay", "color"]
    assert unsupported_options(parser) == ["--quiet"]
    path = _toml(tmp_path, 'name = ["a", "b"]\nrelay = ["1", "2"]\ncolor = false\n')
    layered = resolve(parser, ["--config", path], env_prefix="T_", environ={"T_NAME": "c, d"})
    assert (layered.args.name, layered.args.relay, layered.args.color) == (["c", "d"], [1, 2],
                                                                          False)
    layered = resolve(parser, ["--config", path, "--name", "e", "--no-color"], env_prefix="T_",
                      environ={})
    assert (layered.args.name, layered.args.color) == (["e"], False)
    with pytest.raises(ConfigError, match=r"quiet \(--quiet is a flag only\)"):
        resolve(parser, ["--config", _toml(tmp_path, "quiet = 1\n")], env_prefix="T_",
                environ={})
    with pytest.raises(ConfigError, match=r"relay: expected a list of strings, got int 5"):
        resolve(parser, ["--config", _toml(tmp_path, "relay = 5\n")], env_prefix="T_",
                environ={})


# The clone command: its connection settings (the options before COMMAND).


def test_clone_reads_servers_and_timeout_from_a_file_under_its_variables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _toml(tmp_path, 'servers = "tcp://10.0.0.1:5556,tcp://10.0.0.2:5556"\ntimeout = 3\n',
                 name="clone.toml")
    monkeypatch.setenv("CLONE_CONFIG", path)
    monkeypatch.setenv("CLONE_TIMEOUT", "4.5")
    monkeypatch.delenv("CLONE_SERVERS", raising=False)
    assert client_cli.main(["--print-config"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows['servers = "tcp://10.0.0.1:5556,tcp://10.0.0.2:5556"'] == f"file {path}"
    assert rows["timeout = 4.5"] == "environment CLONE_TIMEOUT"
    assert rows["# subtree is unset"] == "default"
    monkeypatch.setenv("CLONE_SERVERS", "tcp://10.9.9.9:5556")
    assert client_cli.main(["--servers", "tcp://127.0.0.1:1", "--print-config"]) == 0
    assert _rows(capsys.readouterr().out)['servers = "tcp://127.0.0.1:1"'] == "flag --servers"


def test_clone_takes_the_curve_pair_from_one_layer(tmp_path: Path) -> None:
    path = _toml(tmp_path, 'curve-secret = "/f/app.key_secret"\nserver-key = "/f/pair.key"\n')
    layered = resolve(
        client_cli._parser(), ["--config", path, "--curve-secret", "/x", "get", "/k"],
        env_prefix=client_cli.ENV_PREFIX, environ={"CLONE_SERVER_KEY": "/env/pair.key"},
        together=[("curve-secret", "server-key")],
    )
    # The flag's layer gives the pair: its missing half is not filled from below.
    assert (layered.args.curve_secret, layered.args.server_key) == ("/x", None)
    assert layered.origins["server-key"].source is Source.DEFAULT
    layered = resolve(
        client_cli._parser(), ["--config", path, "get", "/k"],
        env_prefix=client_cli.ENV_PREFIX, environ={}, together=[("curve-secret", "server-key")],
    )
    assert (layered.args.curve_secret, layered.args.server_key) == (
        "/f/app.key_secret", "/f/pair.key")


def test_clone_refuses_unknown_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _toml(tmp_path, 'server = "tcp://a:1"\n', name="clone.toml")
    with pytest.raises(SystemExit) as exc:
        client_cli.main(["--config", path, "get", "/k"])
    assert exc.value.code == 2
    assert "unknown key server (did you mean servers?)" in capsys.readouterr().err


def test_a_timeout_from_the_file_counts_as_given_for_status(tmp_path: Path) -> None:
    path = _toml(tmp_path, "timeout = 7\n")
    layered = resolve(client_cli._parser(), ["--config", path, "status"],
                      env_prefix=client_cli.ENV_PREFIX, environ={})
    assert layered.given("timeout") and layered.args.timeout == 7.0
    layered = resolve(client_cli._parser(), ["status"], env_prefix=client_cli.ENV_PREFIX,
                      environ={})
    assert not layered.given("timeout")


def test_the_sources_are_logged_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _toml(tmp_path, "primary = true\n")
    layered = resolve(server_cli.build_parser(), ["--config", path],
                      env_prefix=server_cli.ENV_PREFIX, environ={"CLONE_SERVER_MISSED": "3"})
    with caplog.at_level(logging.INFO):
        layered.log_sources(logging.getLogger("clone.server.cli"))
    assert caplog.messages == [
        f"settings from {path}, under flags and CLONE_SERVER_* variables",
        "settings from the environment: CLONE_SERVER_MISSED",
    ]
