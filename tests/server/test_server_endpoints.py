"""clone-server's endpoint flags take both spellings, and a server that cannot
start exits 3."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from clone.server.cli import EXIT_START_FAILED, build_parser, config_from_args
from tests.support.servers import ROOT


def test_upstream_takes_the_tcp_form_clients_take() -> None:
    args = build_parser().parse_args(
        ["--relay", "--upstream", "tcp://127.0.0.1:5556, 127.0.0.1:5566", "--port", "7556"]
    )
    assert config_from_args(args).upstream == ("127.0.0.1:5556", "127.0.0.1:5566")


def test_peer_and_peer_ha_take_the_tcp_form() -> None:
    args = build_parser().parse_args(
        ["--primary", "--peer", "tcp://localhost:5566", "--peer-ha", "tcp://localhost:5004"]
    )
    config = config_from_args(args)
    assert (config.peer, config.peer_ha) == ("localhost:5566", "localhost:5004")


@pytest.mark.parametrize("bad", ["tcp://", "tcp://host", "udp://h:1", "tcp://tcp://h:1"])
def test_bad_endpoints_are_still_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--relay", "--upstream", bad])


@pytest.mark.slow
def test_a_port_in_use_exits_3(tmp_path: object) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "clone.server.cli", "--standalone", "--in-memory",
             "--bind", "127.0.0.1", "--port", str(port)],
            capture_output=True, text=True, timeout=60, cwd=ROOT,
        )  # fmt: skip
    assert proc.returncode == EXIT_START_FAILED, proc.stderr
    assert "Address already in use" in proc.stderr or "in use" in proc.stderr, proc.stderr
