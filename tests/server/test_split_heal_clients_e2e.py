"""What clients see while a split brain heals (docs/failover.md, "Writes of a
split brain"): real processes, the Binary Star link cut and healed through
:class:`CuttableLink` on loopback, as in tests/server/test_split_heal_e2e.py.

* The winner answers no client's snapshot request while it holds for the
  heal and the loser's forwarded writes are coming: a client synced then
  would lack those still to come, and the island client that confirmed them
  on the loser would see its own writes vanish and come back (the drill's
  ``no duplicate applied`` / ``per-writer order kept`` failures).  The
  request is held and answered when the hold ends, with all of them.
* The loser drops the client updates that reached it alone after it stepped
  down (its pending list would otherwise apply them at a later promotion,
  over the winner's writes: the drill's ``passive in step with active``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tests.server.test_split_heal_e2e import HEARTBEAT_MS, _num, _Split, _write_to
from tests.support.servers import Servers, answers_icanhaz, server_pool
from tests.support.waiting import eventually

#: Enough for the forwarding to take a while (256 calls in flight at a time),
#: few enough to be judged well within the hold's 10 s ceiling.
SPLIT_WRITES = 3_000

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def servers(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Servers]:
    with server_pool(tmp_path, request, heartbeat_ms=HEARTBEAT_MS) as pool:
        yield pool


def _split(servers: Servers) -> _Split:
    """Cut the link and vote the backup active: both serve."""
    pair = _Split(servers, SPLIT_WRITES)
    pair.cut()
    assert answers_icanhaz(pair.backup.port, 30, b"/nothing/"), "backup not voted active"
    pair.backup.wait_log("now ACTIVE", 30)
    return pair


def _snapshot(port: int, subtree: bytes, timeout: float) -> dict[bytes, bytes]:
    """One ICANHAZ? on one DEALER, and the snapshot that answers it, whole."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"ICANHAZ?", subtree])
        out: dict[bytes, bytes] = {}
        while dealer.poll(int(timeout * 1000)):
            frames = dealer.recv_multipart()
            if frames[0] == b"KTHXBAI":
                return out
            out[frames[0]] = frames[4]
        raise AssertionError(f"no KTHXBAI within {timeout} s")
    finally:
        ctx.destroy(linger=0)


def test_a_client_that_syncs_from_the_winner_mid_heal_gets_every_forwarded_write(
    servers: Servers,
) -> None:
    pair = _split(servers)
    try:
        primary, backup = pair.primary, pair.backup
        _write_to(primary, SPLIT_WRITES)  # the island's writes, on the primary only
        offset = backup.log_size()
        pair.heal()
        backup.wait_log("holding client updates", 60, after=offset)
        eventually(
            lambda: _num(backup, "split_calls_received") > 0, 60, "forwarded writes arriving"
        )
        # Held while the forwarded writes come, answered when the hold ends.
        items = _snapshot(backup.port, b"/split/", 60)
        missing = [n for n in range(SPLIT_WRITES) if items.get(b"/split/%06d" % n) != b"v%d" % n]
        assert not missing, f"{len(missing)} forwarded writes not in the snapshot: {missing[:5]}"
        assert _num(backup, "snapshots_held_heal") >= 1, "the request came after the heal"
        assert _num(backup, "split_calls_applied") >= SPLIT_WRITES
    finally:
        pair.close()


def test_the_loser_drops_what_reached_it_alone_after_it_stepped_down(servers: Servers) -> None:
    pair = _split(servers)
    try:
        primary = pair.primary
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            # A client that still follows the primary, cut off from the backup.
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.connect(f"tcp://127.0.0.1:{primary.port + 2}")
            probe = 0

            def subscribed() -> bool:
                nonlocal probe
                probe += 1
                pub.send_multipart(
                    [b"/late/probe", bytes(8), (10**9 + probe).to_bytes(16, "big"), b"", b"p"]
                )
                return _num(primary, "kvset_received") > 0

            eventually(subscribed, 30, "the primary's collector to take a probe write")
            offset = primary.log_size()
            pair.heal()
            primary.wait_log("now PASSIVE", 60, after=offset)
            parked = _num(primary, "kvset_pending")
            for n in range(20):
                pub.send_multipart(
                    [b"/late/%02d" % n, bytes(8), (n + 1).to_bytes(16, "big"), b"", b"late"]
                )
            eventually(
                lambda: _num(primary, "kvset_pending") >= parked + 20, 30, "the late writes parked"
            )
            eventually(
                lambda: _num(primary, "pending") == 0, 60, "the late writes dropped from pending"
            )
            assert _num(primary, "pending_stepped_down") >= 20
            primary.wait_log("reached us after we stepped down", 10, after=offset)
        finally:
            ctx.destroy(linger=0)
    finally:
        pair.close()
