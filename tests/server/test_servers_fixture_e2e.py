"""The ``servers`` fixture itself (tests/support/servers.py), with real servers."""

from __future__ import annotations

import socket

import pytest

import tests.support.servers as servers_module
from tests.support.servers import Servers


@pytest.mark.slow
def test_a_server_whose_port_was_taken_meanwhile_starts_on_other_ports(
    servers: Servers, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A port drawn free may be bound by another process before the server
    binds it (seen under load: "cannot start: Address already in use")."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        draws = iter([port])
        real = servers_module.free_base_port
        monkeypatch.setattr(servers_module, "free_base_port", lambda: next(draws, None) or real())
        server = servers.standalone()
        assert server.port != port
        assert servers.started == [server]
        # The first try wrote to the same log, and said why it stopped.
        assert "Address already in use" in server.log_text()
        assert server.log_text().count("start #1") == 2
