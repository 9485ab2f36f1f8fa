"""Upgrades in place: ``--upgrade-from``, and a pair of two releases serving together.

The older release is release 0.1.0 (commit 67c3288), built once into a virtual
environment under the release cache (clone.tools.drill.upgrade.default_cache,
``$CLONE_RELEASE_CACHE``), so only the first run pays for the build.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clone import Clone
from clone.client.status import query_status
from clone.release import RELEASE
from clone.storage import DATA_FILE, FORMAT_VERSION
from clone.tools.drill import DrillConfig, run_drill
from clone.tools.drill.upgrade import (
    ReleaseEnv,
    UpgradeError,
    default_cache,
    old_server_env,
    prepare_release,
    repo_root,
)
from clone.tools.procs import ServerAddress, server_argv
from clone.wire.calls import CALL, Reply, decode_reply
from clone.wire.protocol import SNAPSHOT_OFFSET
from tests.support.ports import free_base_port, free_port
from tests.support.servers import ServerProcess, Servers
from tests.support.waiting import eventually

OLD_REF = "67c3288"  # release 0.1.0
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "format1"


def _quiet(line: str) -> None:
    pass


# -- the pure parts ------------------------------------------------------------


def test_upgrade_from_is_for_a_durable_rolling_restart(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rolling-restart only"):
        DrillConfig(scenario="kill-active", out=tmp_path, upgrade_from=OLD_REF)
    with pytest.raises(ValueError, match="data directories"):
        DrillConfig(scenario="rolling-restart", out=tmp_path, upgrade_from=OLD_REF,
                    in_memory=True)
    assert DrillConfig(scenario="rolling-restart", out=tmp_path,
                       upgrade_from=OLD_REF).upgrade_from == OLD_REF


def test_server_argv_runs_the_command_given() -> None:
    me, peer = ServerAddress("primary", 5556, 5003), ServerAddress("backup", 5566, 5004)
    argv = server_argv("primary", me, peer, data_dir=Path("/d"), command=["/old/clone-server"])
    assert argv[:2] == ["/old/clone-server", "--primary"]
    assert argv[-2:] == ["--data-dir", "/d"]
    assert server_argv("primary", me, peer)[0] != "/old/clone-server"


def test_an_old_server_does_not_see_our_checkout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/some/checkout")
    assert "PYTHONPATH" not in old_server_env()


def test_a_bad_ref_or_wheel_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(UpgradeError, match=r"no-such-ref.*not a commit"):
        prepare_release("no-such-ref", tmp_path, _quiet)
    with pytest.raises(UpgradeError, match="no such wheel file"):
        prepare_release(str(tmp_path / "clone_kv-0.1.0-py3-none-any.whl"), tmp_path, _quiet)
    assert not any(tmp_path.iterdir())  # nothing built


def test_a_finished_build_is_reused_by_commit(tmp_path: Path) -> None:
    sha = subprocess.run(["git", "-C", str(repo_root()), "rev-parse", f"{OLD_REF}^{{commit}}"],
                         capture_output=True, text=True, check=True, timeout=30).stdout.strip()
    home = tmp_path / sha
    (home / "venv" / "bin").mkdir(parents=True)
    (home / "venv" / "bin" / "clone-server").write_text("#!/bin/sh\n")
    python = home / "venv" / "bin" / "python"  # what the release's metadata says
    python.write_text("#!/bin/sh\necho 0.1.0\n")
    python.chmod(0o755)
    (home / "ready").write_text(json.dumps({"ref": OLD_REF, "version": "0.1.0"}))
    said: list[str] = []
    env = prepare_release(OLD_REF, tmp_path, said.append)
    assert (env.key, env.version, env.cached, env.build_s) == (sha, "0.1.0", True, 0.0)
    assert env.server == home / "venv" / "bin" / "clone-server"
    assert "cached" in said[0]
    # A build that recorded the checkout's version (run from it, before the
    # version was read isolated): the environment's own answer wins, and is kept.
    (home / "ready").write_text(json.dumps({"ref": OLD_REF, "version": "0.2.0"}))
    assert prepare_release(OLD_REF, tmp_path, said.append).version == "0.1.0"
    assert json.loads((home / "ready").read_text())["version"] == "0.1.0"


@pytest.mark.slow  # asks git whether the ref exists: a process
def test_the_drill_command_refuses_a_bad_upgrade_before_any_server_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from clone.tools.drill.cli import main

    assert main(["--scenario", "kill-active", "--upgrade-from", OLD_REF,
                 "--out", str(tmp_path / "a")]) == 2
    assert "rolling-restart only" in capsys.readouterr().err
    assert main(["--scenario", "rolling-restart", "--upgrade-from", "no-such-ref",
                 "--release-cache", str(tmp_path / "cache"), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "--upgrade-from: " in err and "no-such-ref" in err and "not a commit" in err
    assert not (tmp_path / "b" / "logs").exists()  # no server was started


# -- real processes ------------------------------------------------------------


@pytest.fixture(scope="module")
def release() -> ReleaseEnv:
    """Release 0.1.0 installed in its own environment (built once, then cached)."""
    return prepare_release(OLD_REF, default_cache(), _quiet)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_drill_rolling_restart_upgrade_from_the_previous_release(
    tmp_path: Path, release: ReleaseEnv
) -> None:
    from clone.tools import report

    cfg = DrillConfig(scenario="rolling-restart", out=tmp_path, clients=2, duration=6.0,
                      rate=20.0, heartbeat_ms=200, upgrade_from=OLD_REF,
                      release_cache=default_cache())
    summary = run_drill(cfg)
    failed = {k: v for k, v in summary["checks"].items() if not v["ok"]}
    assert not failed, report.drill_text(summary)
    assert summary["confirmed_lost"] == 0 and summary["reverted_keys"] == 0
    assert summary["confirmed_writes"] > 0
    up = summary["upgrade"]
    assert up["version"] == "0.1.0" and up["new_version"] == RELEASE
    assert {v["version"] for v in up["start"].values()} == {"0.1.0"}
    # The mixed phase was real: the new backup followed the old primary.
    assert up["mixed"]["backup"]["version"] == RELEASE
    assert up["mixed"]["primary"]["version"] == "0.1.0"
    assert {(v["version"], v["data_format"]) for v in up["end"].values()} == {
        (RELEASE, FORMAT_VERSION)}
    assert up["order"][:2] == ["backup", "primary"]
    for name in ("primary", "backup"):
        assert (tmp_path / "data" / name / f"{DATA_FILE}.v1").exists()


class _OldServer(ServerProcess):
    """A server of the older release: its environment's clone-server, without our
    checkout on the path."""

    def __init__(self, release: ReleaseEnv, name: str, args: list[str], port: int,
                 ha_port: int, log_dir: Path) -> None:
        self.release = release
        super().__init__(name, args, port, ha_port, log_dir)
        self.process.env = old_server_env()

    def _argv(self) -> list[str]:
        return [str(self.release.server), *self.args]


@pytest.fixture
def mixed_pair(
    tmp_path: Path, servers: Servers, release: ReleaseEnv
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A new primary on a copy of the 0.1.0 data directory, an old backup beside it."""
    data = tmp_path / "primary.data"
    shutil.copytree(FIXTURE / "data", data)
    p_port, b_port, p_ha, b_ha = free_base_port(), free_base_port(), free_port(), free_port()

    def args(role: str, port: int, ha: int, peer: int, peer_ha: int, data_dir: Path) -> list[str]:
        return [f"--{role}", "--port", str(port), "--peer", f"127.0.0.1:{peer}",
                "--ha-port", str(ha), "--peer-ha", f"127.0.0.1:{peer_ha}",
                "--bind", "127.0.0.1", "--heartbeat", str(servers.heartbeat_ms), "--verbose",
                "--data-dir", str(data_dir), "--peer-wait", "0.5"]

    primary = servers.spawn("primary", args("primary", p_port, p_ha, b_port, b_ha, data),
                            p_port, p_ha)
    backup = _OldServer(release, "backup",
                        args("backup", b_port, b_ha, p_port, p_ha, tmp_path / "backup.data"),
                        b_port, b_ha, servers.log_dir)
    servers.started.append(backup)  # stopped at teardown with the others
    backup.start()
    yield primary, backup


def _endpoints(*servers: ServerProcess) -> list[str]:
    return [f"tcp://127.0.0.1:{s.port}" for s in servers]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_old_data_directory_served_by_a_new_server_with_an_old_peer(
    mixed_pair: tuple[ServerProcess, ServerProcess],
) -> None:
    primary, backup = mixed_pair
    expected: dict[str, Any] = json.loads((FIXTURE / "expected.json").read_text())
    primary.wait_log(f"{DATA_FILE}.v1")  # migrated, the 0.1.0 file kept
    primary.wait_log("now ACTIVE", timeout=20)
    backup.wait_log("synced from", timeout=20)  # the old passive follows the new active
    by_name = dict(zip(("primary", "backup"), query_status(_endpoints(primary, backup), 5.0),
                       strict=True))
    assert (by_name["primary"]["version"], by_name["primary"]["data_format"]) == (
        RELEASE, FORMAT_VERSION)
    assert by_name["backup"]["version"] == "0.1.0" and "data_format" not in by_name["backup"]

    client = Clone(servers=_endpoints(primary, backup), heartbeat=0.2)
    try:
        client.wait_synced(timeout=30)
        assert {k for k, _ in client.items()} >= set(expected["keys"]) - {"/ephemeral/session"}
        # Writes and calls (a lease and a compare-and-set) on the new active,
        # replicated to the old passive.
        assert client.set("/mixed/one", "new-active", wait=True) == 54
        lease = client.lease(ttl=30.0)
        seq = client.set("/mixed/leader", "me", lease=lease)
        assert seq is not None and seq > 54
        client.set("/mixed/cas", "0", if_sequence=0)
        offset = backup.log_size()
        # The new server dies: the old one takes over with everything.
        primary.kill9()
        backup.wait_log("now ACTIVE", after=offset, timeout=20)
        eventually(lambda: client.status().server == _endpoints(backup)[0], timeout=20,
                   what="the client on the old server")
        assert client.set("/mixed/two", "old-active", wait=True) is not None
        for key in ("/mixed/one", "/mixed/leader", "/mixed/cas", "/config/binary"):
            assert client.get(key) is not None, key
        # The new server comes back passive and catches up from the old active.
        offset = primary.log_size()
        primary.start()
        primary.wait_log("synced from", after=offset, timeout=30)
        assert client.set("/mixed/three", "both", wait=True) is not None
        eventually(lambda: client.get("/mixed/three") == b"both", timeout=10)
    finally:
        client.close()
    statuses = query_status(_endpoints(primary, backup), 5.0)
    assert statuses[0]["sequence"] == statuses[1]["sequence"]
    assert [s["role"] for s in statuses] == ["passive", "active"]


def _old_standalone(release: ReleaseEnv, servers: Servers, name: str,
                    *extra: str) -> ServerProcess:
    port = free_base_port()
    server = _OldServer(release, name,
                        ["--standalone", "--port", str(port), "--bind", "127.0.0.1",
                         "--verbose", *extra], port, 0, servers.log_dir)
    servers.started.append(server)
    server.start()
    return server


def _exits_refusing(server: ServerProcess) -> str:
    code = server.process.wait(30)
    assert code is not None and code != 0, f"{server.name} did not refuse: exit {code}"
    return server.log_text()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_old_release_refuses_what_it_cannot_read_and_the_kept_copy_rolls_back(
    tmp_path: Path, servers: Servers, release: ReleaseEnv
) -> None:
    from clone.storage import Storage, write_state_file

    data = tmp_path / "data"
    shutil.copytree(FIXTURE / "data", data)
    Storage.open(data).close()  # migrated by this release
    migrated = (data / DATA_FILE).read_bytes()

    # Rolled back without the copy: 0.1.0 refuses the format-2 file, naming it, and
    # leaves it as it was.
    log = _exits_refusing(_old_standalone(release, servers, "old-on-new", "--data-dir", str(data)))
    assert f"format version {FORMAT_VERSION}, this Clone reads version 1" in log, log[-2000:]
    assert (data / DATA_FILE).read_bytes() == migrated

    # A backup written by this release cannot be restored by 0.1.0 either.
    backup = tmp_path / "new-backup.db"
    write_state_file(backup, {}, sequence=0, term=0)
    log = _exits_refusing(_old_standalone(release, servers, "old-restore", "--restore",
                                          str(backup), "--data-dir", str(tmp_path / "empty")))
    assert f"format version {FORMAT_VERSION}" in log, log[-2000:]
    assert not (tmp_path / "empty" / DATA_FILE).exists()

    # The rollback the docs give: 0.1.0 restores the kept copy (the migrated file
    # is set aside as replaced-*.db, its WAL with it).
    old = _old_standalone(release, servers, "rolled-back", "--data-dir", str(data),
                          "--restore", str(data / f"{DATA_FILE}.v1"))
    old.wait_serving(timeout=20)
    client = Clone(servers=[f"tcp://127.0.0.1:{old.port}"])
    try:
        client.wait_synced(timeout=30)
        assert client.status().sequence == 53
        assert client.get("/locks/leader") == b"node-a"
    finally:
        client.close()
    aside = list(data.glob("replaced-*.db"))
    assert len(aside) == 1 and aside[0].read_bytes() == migrated


def _raw_call(ctx: zmq.Context[Any], server: ServerProcess, op: bytes) -> Reply:
    """A CALL? of operation ``op`` (frames built by hand: encode_call knows only ours)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{server.port + SNAPSHOT_OFFSET}")
        dealer.send_multipart([CALL, op, uuid.uuid4().bytes, b"/future/key", b"", b"value"])
        assert dealer.poll(10_000), f"{server.name} did not answer the call"
        return decode_reply(dealer.recv_multipart())
    finally:
        dealer.close(linger=0)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_call_only_a_newer_release_knows_is_refused_whole_by_either_release(
    servers: Servers, release: ReleaseEnv, ctx: zmq.Context[Any]
) -> None:
    # A feature a newer release adds as a call, sent to an older server: both 0.1.0
    # and this release refuse it before doing anything, naming the operation.
    old = _old_standalone(release, servers, "old", "--in-memory")
    new = servers.standalone("--in-memory", name="new")
    old.wait_serving(timeout=20)
    for server in (old, new):
        reply = _raw_call(ctx, server, b"x-newer-op")
        assert (reply.status, reply.reason) == ("refused", "malformed"), server.name
        assert "unknown CALL? operation 'x-newer-op'" in reply.detail, reply.detail
    statuses = query_status(_endpoints(old, new), 5.0)
    assert [s["sequence"] for s in statuses] == [0, 0]  # nothing applied, nothing half-done
    assert [s["keys"] for s in statuses] == [0, 0]
