"""The server's flags become the config we document in docs/operations.md."""

from __future__ import annotations

import pytest

from clone.server.cli import build_parser, config_from_args
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import ServerCore


def _config(*argv: str) -> ServerConfig:
    return config_from_args(build_parser().parse_args(list(argv)))


def test_liveness_defaults_notice_a_silent_peer_in_one_second() -> None:
    cfg = _config("--primary")
    assert cfg.mode is ServerMode.PRIMARY
    assert (cfg.heartbeat, cfg.ha_missed) == (0.25, 4)
    assert cfg.heartbeat * cfg.ha_missed == pytest.approx(1.0)
    # The library's defaults are the CLI's.
    assert (ServerConfig(port=5556).heartbeat, ServerConfig(port=5556).ha_missed) == (0.25, 4)


def test_heartbeat_and_missed_flags() -> None:
    cfg = _config("--backup", "--heartbeat", "1000", "--missed", "2")
    assert (cfg.heartbeat, cfg.ha_missed) == (1.0, 2)
    assert cfg.effective_deferred_vote_max_age == pytest.approx(4.0)


@pytest.mark.parametrize("flag", ["--heartbeat", "--missed"])
def test_liveness_flags_must_be_positive(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--primary", flag, "0"])
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--port", "0", "0, an ephemeral port, is not supported"),
        ("--port", "65534", "must be a port in 1..65533"),
        ("--port", "x", "expected a port number"),
        ("--ha-port", "0", "0, an ephemeral port, is not supported"),
        ("--ha-port", "65536", "must be a port in 1..65535"),
    ],
)
def test_port_zero_and_out_of_range_are_usage_errors(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--port 0`` once silently became the default port."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--primary", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err


@pytest.mark.parametrize("mode", ["--primary", "--backup", "--standalone"])
def test_explicit_ports_are_used(mode: str) -> None:
    cfg = _config(mode, "--port", "7000", "--ha-port", "7100")
    assert cfg.port == 7000
    if mode != "--standalone":
        assert cfg.ha_port == 7100


def test_lease_ownership_flags() -> None:
    """--max-leases-per-client (default 1000) and --trusted-relay (needs CURVE)."""
    assert _config("--standalone").core.max_leases_per_client == 1000
    assert _config("--standalone", "--max-leases-per-client", "7").core.max_leases_per_client == 7
    with pytest.raises(ValueError, match="--trusted-relay needs --curve-secret"):
        _config("--standalone", "--trusted-relay", "relay1")


def test_max_conflict_bytes_flag() -> None:
    """--max-conflict-bytes: 64 MiB by default, 0 for no bound, the core's book uses it."""
    assert _config("--standalone").core.max_conflict_bytes == 64 * 1024 * 1024
    cfg = _config("--standalone", "--max-conflict-bytes", "0")
    assert cfg.core.max_conflict_bytes == 0
    assert ServerCore(_config("--standalone", "--max-conflict-bytes", "4096").core
                      ).conflicts.max_bytes == 4096


def test_snapshot_slot_idle_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """--snapshot-slot-idle: 0.25 s by default (a quarter of the default
    heartbeat, our client's re-ask interval), positive, and the library's
    default is the CLI's."""
    assert _config("--standalone").snapshot_slot_idle == 0.25
    assert ServerConfig(port=5556).snapshot_slot_idle == 0.25
    assert _config("--standalone", "--snapshot-slot-idle", "5").snapshot_slot_idle == 5.0
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--standalone", "--snapshot-slot-idle", "0"])
    assert "--snapshot-slot-idle" in capsys.readouterr().err
    with pytest.raises(ValueError, match="snapshot_slot_idle must be positive"):
        ServerConfig(port=5556, snapshot_slot_idle=0)
