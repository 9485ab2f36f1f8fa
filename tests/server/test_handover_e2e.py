"""A graceful stop of the active hands its passive everything it applied
(clone.server.handover): a real pair, in this process (two servers on their
own threads and loops), real sockets on loopback, real data directories.

The case that used to lose updates is made certain instead of lucky: the
active's disk is held (its storage's ``append`` waits on a gate, a slow
disk), so the last writes are applied and their commit is in flight when
the stop comes.  Before the handover the stop waited for that commit and
exited without publishing it: the passive never had those writes, and the
rolling-restart drill saw them come back later as a split brain's heal.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import zmq

from bstar.fsm import NO_RANK
from bstar.fsm import State as BStarState
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import Role, SyncState
from clone.server.durability import STOP_WAIT
from clone.server.reactor import CloneServer
from tests.support.chp_peer import ChpPeer
from tests.support.ports import free_base_port, free_port
from tests.support.waiting import eventually

WAIT = 30.0  # generous: the machine is shared


class _Pair:
    def __init__(self, tmp_path: Path, **extra: Any) -> None:
        p, b = free_base_port(), free_base_port()
        p_ha, b_ha = free_port(), free_port()

        def config(mode: ServerMode, port: int, peer: int, ha: int, peer_ha: int) -> ServerConfig:
            return ServerConfig(
                port=port, mode=mode, bind="127.0.0.1", peer=f"127.0.0.1:{peer}",
                ha_port=ha, peer_ha=f"127.0.0.1:{peer_ha}", data_dir=str(tmp_path / mode.value),
                **extra,
            )  # fmt: skip

        self.primary = CloneServer(config(ServerMode.PRIMARY, p, b, p_ha, b_ha))
        self.backup = CloneServer(config(ServerMode.BACKUP, b, p, b_ha, p_ha))
        self.primary.start(WAIT)
        self.backup.start(WAIT)

    def in_step(self) -> bool:
        """The backup follows, and the primary has heard it say so with its rank."""
        primary, backup = self.primary, self.backup
        ha = primary._ha
        return (
            primary.core.role is Role.ACTIVE
            and backup.core.role is Role.PASSIVE
            and backup.core.sync_state is SyncState.SYNCED
            and ha is not None
            and ha.peer_state is BStarState.PASSIVE
            and ha.peer_rank != NO_RANK
        )

    def stop(self) -> None:
        self.primary.stop(WAIT)
        self.backup.stop(WAIT)


class _Disk:
    """The primary's storage ``append``, held until opened (a slow disk)."""

    def __init__(self, server: CloneServer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        storage = server.durability.storage
        assert storage is not None
        real = storage.append

        def append(*args: object, **kwargs: object) -> None:
            self.entered.set()
            assert self.open.wait(WAIT), "the test never opened the disk"
            real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(storage, "append", append)


def _writer(ctx: zmq.Context[Any], server: CloneServer) -> ChpPeer:
    """KVSETs to this server's collector only: the passive never parks them,
    so what it holds is what the active got to it."""
    peer = ChpPeer(ctx)
    port = server.config.port
    peer.connect(port, collectors=[port], timeout=WAIT)
    return peer


def test_stopping_the_active_mid_commit_hands_the_passive_every_write(
    tmp_path: Path,
    ctx: zmq.Context[Any],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="clone.server.reactor")
    pair = _Pair(tmp_path, heartbeat=0.1)
    try:
        eventually(pair.in_step, WAIT, "the pair in step")
        writer = _writer(ctx, pair.primary)
        for i in range(5):
            writer.kvset(b"/ho/before/%d" % i, b"v")
        eventually(lambda: pair.backup.core.store.sequence == 5, WAIT, "5 updates followed")
        disk = _Disk(pair.primary, monkeypatch)
        for i in range(10):
            writer.kvset(b"/ho/held/%d" % i, b"v")
        assert disk.entered.wait(WAIT), "no commit started"
        eventually(lambda: pair.primary.core.store.sequence == 15, WAIT, "all 10 applied")
        assert pair.backup.core.store.sequence < 15  # the commit holds some of them
        pair.primary.request_stop()
        handover = pair.primary.handover
        assert handover is not None
        eventually(lambda: handover.running, WAIT, "the handover under way")
        disk.open.set()
        # (A second stop request would end the handover at once: wait for it.)
        eventually(lambda: not handover.running, WAIT, "the handover done")
        pair.primary.stop(WAIT)
        assert pair.backup.core.store.sequence == 15
        for i in range(10):
            assert pair.backup.core.store.entry(b"/ho/held/%d" % i) is not None
        assert "handed over in" in caplog.text
        assert "without a complete handover" not in caplog.text
        writer.close()
    finally:
        pair.stop()


def test_a_passive_that_does_not_answer_costs_only_the_timeout(
    tmp_path: Path,
    ctx: zmq.Context[Any],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.INFO, logger="clone.server.reactor")
    # A 1 s heartbeat: the frozen passive stays alive to Binary Star (4 s)
    # for longer than the handover may wait.
    pair = _Pair(tmp_path, heartbeat=1.0, handover_timeout=0.2)
    release = threading.Event()
    try:
        eventually(pair.in_step, WAIT, "the pair in step")
        backup_loop = pair.backup.loop
        assert backup_loop is not None
        frozen = threading.Event()

        def freeze() -> None:
            frozen.set()
            release.wait(WAIT)

        backup_loop.add_callback(freeze)
        assert frozen.wait(WAIT)
        writer = _writer(ctx, pair.primary)
        writer.kvset(b"/ho/unseen", b"v")
        eventually(lambda: pair.primary.core.store.sequence == 1, WAIT, "the write applied")
        waits: list[float] = []
        real_close = pair.primary.durability.close

        def close(wait: float = STOP_WAIT) -> None:
            waits.append(wait)
            real_close(wait)

        monkeypatch.setattr(pair.primary.durability, "close", close)
        pair.primary.stop(WAIT)
        assert "server stopped" in caplog.text
        assert "without a complete handover (not done within --handover-timeout" in caplog.text
        # What the handover spent comes off the rest of the stop's waits.
        handover = pair.primary.handover
        assert handover is not None and handover.spent >= 0.2
        assert waits[0] == pytest.approx(STOP_WAIT - handover.spent)
        writer.close()
    finally:
        release.set()
        pair.stop()
