"""STATUS? under CURVE: an admitted client gets the status, with
``curve: true``, even a reader with no rights beyond /public/; a key the pair
does not know gets no answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from clone.client.cli import EXIT_OK, EXIT_UNREACHABLE, main
from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.servers import Servers

pytestmark = pytest.mark.slow


def test_admitted_clients_may_ask_strangers_may_not(
    servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = CurveKeys.make(tmp_path / "sec", admitted=("admin", "reader"), strangers=("mallory",))
    keys.write_acl({"admin": ([""], [""]), "reader": (["/public/"], [])})
    primary, backup = servers.pair(*keys.server_args(), wait=False)
    primary.wait_log("now ACTIVE")
    backup.wait_log("synced from")
    wait_serving_curve(primary, keys)
    servers_arg = f"tcp://127.0.0.1:{primary.port},tcp://127.0.0.1:{backup.port}"
    for name in ("admin", "reader"):
        argv = ["--servers", servers_arg, "--curve-secret", str(keys.secret(name)),
                "--server-key", str(keys.pair_public), "status", "--json"]  # fmt: skip
        assert main(argv) == EXIT_OK, name
        p, b = json.loads(capsys.readouterr().out)
        assert (p["role"], b["role"]) == ("active", "passive")
        assert p["curve"] is True and b["curve"] is True
    stranger = [
        "--curve-secret",
        str(keys.secret("mallory")),
        "--server-key",
        str(keys.pair_public),
    ]
    argv = ["--servers", servers_arg, *stranger, "status", "--json", "--timeout", "1"]
    assert main(argv) == EXIT_UNREACHABLE
    assert [s["reachable"] for s in json.loads(capsys.readouterr().out)] == [False, False]
    # Without keys at all: no answer either (the handshake never completes).
    assert main(["--servers", servers_arg, "status", "--timeout", "1"]) == EXIT_UNREACHABLE
