"""A pair started from the example configs alone serves, and fails over.

deploy/primary and deploy/backup's clone-server.toml.example, with only the
addresses, ports and paths a test machine needs substituted (each substituted
key must already be in the example: nothing is added), are the servers' whole
command line: ``clone-server --config FILE``.  The clone command reads its
connection settings from deploy/clone.toml.example, substituted the same way.
The pair runs with CURVE, as the examples do, on certificates made here.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from clone.tools.procs import free_base_port, free_port
from tests.deploy.files import (
    DEPLOY,
    ROLES,
    SCRAPE_SERIES,
    example_config,
    rule_exprs,
    rule_metrics,
    served_metrics,
    toml_text,
    unit_settings,
)
from tests.support.curve import CurveKeys, wait_serving_curve
from tests.support.servers import ROOT, ServerProcess, Servers

pytestmark = pytest.mark.slow


def _substituted(example: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    missing = set(values) - set(example)
    assert not missing, f"the example has no {sorted(missing)}: the test would add settings"
    return {**example, **values}


def _clone(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The clone command with its settings from ``config`` alone ($CLONE_CONFIG)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLONE_")}
    env["CLONE_CONFIG"] = str(config)
    # A busy test machine: a failover plus a confirmation may take longer than
    # the default 5 s (an environment variable over the file, as documented).
    env["CLONE_TIMEOUT"] = "30"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "clone.client.cli", *args],
        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT,
    )  # fmt: skip


def _backup_unit(client_config: Path, state_dir: Path) -> str:
    """ExecStart then ExecStartPost of clone-backup.service, as systemd runs them
    ($$ and %% unescaped, $STATE_DIRECTORY set), with this checkout's clone;
    ExecStart's output."""
    unit = unit_settings(DEPLOY / "systemd" / "clone-backup.service")
    assert unit["Environment"] == ["CLONE_CONFIG=/etc/clone/clone.toml"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLONE_")}
    env.update(CLONE_CONFIG=str(client_config), CLONE_TIMEOUT="30", STATE_DIRECTORY=str(state_dir))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    outputs = []
    for line in unit["ExecStart"] + unit["ExecStartPost"]:
        text = line.replace("$$", "$").replace("%%", "%")
        text = text.replace("/opt/clone/bin/clone", f"{sys.executable} -m clone.client.cli")
        text = text.replace("/var/lib/clone-backups", str(state_dir))
        done = subprocess.run(shlex.split(text), capture_output=True, text=True, timeout=60,
                              env=env, cwd=ROOT)
        assert done.returncode == 0, f"{text}: {done.stderr}"
        outputs.append(done.stdout)
    return outputs[0]


def _metrics(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return served_metrics(reply.read().decode())


@dataclass
class _Deployed:
    """A pair started from the examples, and the clone command's config."""

    primary: ServerProcess
    backup: ServerProcess
    client_config: Path
    http_ports: dict[str, int]


def _deploy(servers: Servers, tmp_path: Path) -> _Deployed:
    keys = CurveKeys.make(tmp_path / "curve", admitted=("ops",))
    ports = {role: (free_base_port(), free_port(), free_port()) for role in ROLES}
    started: dict[str, ServerProcess] = {}
    for role in ROLES:
        peer = "backup" if role == "primary" else "primary"
        port, ha_port, http_port = ports[role]
        config = _substituted(example_config(role), {
            "bind": "127.0.0.1",
            "port": port,
            "ha-port": ha_port,
            "peer": f"127.0.0.1:{ports[peer][0]}",
            "peer-ha": f"127.0.0.1:{ports[peer][1]}",
            "data-dir": str(tmp_path / f"{role}.data"),
            "curve-secret": str(keys.pair_secret),
            "clients": str(keys.clients),
            "http-port": http_port,
        })  # fmt: skip
        path = tmp_path / f"{role}.toml"
        path.write_text(toml_text(config))
        started[role] = servers.spawn(role, ["--config", str(path)], port, ha_port)
    primary, backup = started["primary"], started["backup"]
    # The first start: both servers wait to hear each other (peer-wait), and
    # the primary, with the data no older than the backup's, becomes active.
    primary.wait_log("now ACTIVE", timeout=30)
    backup.wait_log("synced from", timeout=30)
    wait_serving_curve(primary, keys, "ops")

    with open(DEPLOY / "clone.toml.example", "rb") as f:
        client = _substituted(tomllib.load(f), {
            "servers": ",".join(f"tcp://127.0.0.1:{ports[r][0]}" for r in ROLES),
            "curve-secret": str(keys.secret("ops")),
            "server-key": str(keys.pair_public),
        })  # fmt: skip
    client_config = tmp_path / "clone.toml"
    client_config.write_text(toml_text(client))
    return _Deployed(primary, backup, client_config, {r: ports[r][2] for r in ROLES})


def _ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, done.stderr
    return done.stdout


def _roles(client_config: Path) -> list[str | None]:
    statuses = json.loads(_ok(_clone(client_config, "status", "--json")))
    return [s.get("role") for s in statuses]


def test_a_pair_from_the_example_configs_serves_and_fails_over(
    servers: Servers, tmp_path: Path
) -> None:
    pair = _deploy(servers, tmp_path)
    primary, backup, client_config = pair.primary, pair.backup, pair.client_config
    ports = {role: (0, 0, pair.http_ports[role]) for role in ROLES}

    assert f"settings from {tmp_path / 'primary.toml'}" in primary.log_text()

    # It serves: a confirmed write and a read, over CURVE, from the config alone.
    done = _clone(client_config, "set", "/deploy/key", "before")
    assert done.returncode == 0, done.stderr
    done = _clone(client_config, "get", "/deploy/key")
    assert (done.returncode, done.stdout) == (0, "before\n"), done.stderr

    # Every metric the alert rules read is served by both servers.
    wanted = set().union(*(rule_metrics(e) for e in rule_exprs())) - SCRAPE_SERIES
    for role in ROLES:
        missing = wanted - _metrics(ports[role][2])
        assert not missing, f"{role}'s /metrics lacks {sorted(missing)}"

    # systemctl stop: SIGTERM, a clean exit well within the unit's stop timeout.
    stop_timeout = float(unit_settings(DEPLOY / "systemd" / "clone-server@.service")
                         ["TimeoutStopSec"][0].removesuffix("s"))
    began = time.monotonic()
    assert primary.terminate(timeout=stop_timeout) == 0
    assert time.monotonic() - began < stop_timeout / 3

    # It fails over: the clients' next request makes the backup active, nothing lost.
    done = _clone(client_config, "set", "/deploy/key", "after")
    assert done.returncode == 0, done.stderr
    backup.wait_log("now ACTIVE", timeout=30)
    done = _clone(client_config, "dump", "/deploy/")
    assert (done.returncode, done.stdout) == (0, "/deploy/key=after\n"), done.stderr


def test_the_life_of_deploy_md_backup_replace_a_machine_restore(
    servers: Servers, tmp_path: Path
) -> None:
    """docs/deploy.md's steps after the first start, each as the page gives it."""
    pair = _deploy(servers, tmp_path)
    primary, backup, client_config = pair.primary, pair.backup, pair.client_config
    _ok(_clone(client_config, "set", "/config/a", "1"))

    # Backups on a schedule: clone-backup.service's own command lines.
    backups = tmp_path / "clone-backups"
    backups.mkdir()
    stale = backups / "clone-20200101T000000Z.db"  # older than the 14 days kept
    stale.write_bytes(b"")
    os.utime(stale, (time.time() - 20 * 86400,) * 2)
    assert "wrote 1 keys" in _backup_unit(client_config, backups)
    (backup_file,) = backups.glob("clone-*.db")
    assert backup_file != stale
    _ok(_clone(client_config, "set", "/config/a", "2"))  # after the backup

    # Replacing a dead machine: it is gone with its disk; the other serves.
    primary.kill9()
    shutil.rmtree(tmp_path / "primary.data")
    _ok(_clone(client_config, "set", "/config/b", "1"))
    backup.wait_log("now ACTIVE", timeout=30)
    # The new machine: the same config, an empty state directory. It hears
    # the active peer, comes up passive and syncs everything from it.
    after = primary.log_size()
    primary.start()
    primary.wait_log("synced from", timeout=30, after=after)
    assert _roles(client_config) == ["passive", "active"]
    assert _ok(_clone(client_config, "dump", "/config/")) == "/config/a=2\n/config/b=1\n"

    # Restoring from a backup: both stopped, both started once with
    # CLONE_SERVER_RESTORE (systemctl set-environment), then without it.
    for server in (backup, primary):
        assert server.terminate(timeout=30) == 0
    offsets = {}
    for server, role in ((primary, "primary"), (backup, "backup")):
        restore = tmp_path / f"{role}.data" / "restore.db"
        shutil.copy(backup_file, restore)
        assert server.process.env is not None
        server.process.env["CLONE_SERVER_RESTORE"] = str(restore)
        offsets[role] = server.log_size()
        server.start()
    primary.wait_log("now ACTIVE", timeout=30, after=offsets["primary"])
    backup.wait_log("synced from", timeout=30, after=offsets["backup"])
    assert "restored" in primary.log_text()[offsets["primary"]:].lower()
    for server in (primary, backup):
        assert server.process.env is not None
        del server.process.env["CLONE_SERVER_RESTORE"]
    assert _ok(_clone(client_config, "dump", "/config/")) == "/config/a=1\n"
    assert _roles(client_config) == ["active", "passive"]
