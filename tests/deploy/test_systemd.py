"""deploy/systemd: the units pass ``systemd-analyze verify`` and say what the issue asks.

``systemd-analyze`` is Debian's ``systemd`` package; scripts/test installs it as
root with apt-get, and without it the verify test is skipped, saying why.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.files import DEPLOY, ROLES, example_config, unit_settings

SYSTEMD = DEPLOY / "systemd"
SERVER_UNIT = SYSTEMD / "clone-server@.service"
UNITS = ("clone-server@.service", "clone-backup.service", "clone-backup.timer")
INSTALLED = "/opt/clone/bin/"  # where the units expect the venv (docs/deploy.md)


def _bin_dir(tmp_path: Path) -> Path:
    """The installed commands, or stand-ins: verify checks that ExecStart is executable."""
    here = Path(sys.executable).parent
    if (here / "clone-server").exists() and (here / "clone").exists():
        return here
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("clone-server", "clone"):
        stub = stubs / name
        stub.write_text("#!/bin/sh\nexit 0\n")
        stub.chmod(0o755)
    return stubs


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is missing (Debian's systemd package; scripts/test installs it"
    " as root)",
)
def test_the_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    bin_dir = _bin_dir(tmp_path)
    units = tmp_path / "units"
    units.mkdir()
    for name in UNITS:
        text = (SYSTEMD / name).read_text().replace(INSTALLED, f"{bin_dir}/")
        (units / name).write_text(text)
    # A template is verified through an instance of it; the backup timer with its service.
    for role in ROLES:
        (units / f"clone-server@{role}.service").symlink_to(units / "clone-server@.service")
    targets = [str(units / f"clone-server@{role}.service") for role in ROLES]
    targets += [str(units / "clone-backup.service"), str(units / "clone-backup.timer")]
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *targets],
        capture_output=True, text=True, timeout=120, cwd=units,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # Warnings (an unknown key, a bad value) leave the exit status 0: none may name our units.
    ours = [line for line in result.stderr.splitlines() if "clone" in line]
    assert ours == [], "\n".join(ours)


def test_the_server_unit_restarts_hardens_and_stops_gracefully() -> None:
    unit = unit_settings(SERVER_UNIT)
    assert unit["ExecStart"] == [f"{INSTALLED}clone-server --config /etc/clone/%i.toml"]
    assert unit["User"] == ["clone"] and unit["StateDirectory"] == ["clone/%i"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["RestartPreventExitStatus"] == ["2"]  # a bad config is not retried
    assert int(unit["LimitNOFILE"][0]) >= 65536
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "yes"), ("PrivateTmp", "yes"), ("KillSignal", "SIGTERM")]:
        assert unit[key] == [value], key
    assert unit["TimeoutStopSec"] == ["30s"]


@pytest.mark.parametrize("role", ROLES)
def test_each_example_config_keeps_its_state_in_its_units_state_directory(role: str) -> None:
    config = example_config(role)
    assert config[role] is True
    # StateDirectory=clone/%i is /var/lib/clone/<role>: the only writable place.
    assert config["data-dir"] == f"/var/lib/clone/{role}"
    other = "backup" if role == "primary" else "primary"
    peer = example_config(other)
    assert config["peer"] == f"{peer['bind']}:{peer['port']}"
    assert config["peer-ha"] == f"{peer['bind']}:{peer['ha-port']}"
