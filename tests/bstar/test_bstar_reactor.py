"""Binary Star reactor: real zmq sockets on 127.0.0.1, one tornado IOLoop per test.

Both servers of a pair live in this process on the same loop, which the test
creates (no global loop, no global context). Every wait has a deadline and, when
it expires, the failure names the state and counters of every server; the bstar
log is captured at DEBUG and shown by pytest on failure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import zmq
from tornado.ioloop import IOLoop
from zmq.eventloop.zmqstream import ZMQStream

import bstar.reactor as reactor_module
from bstar import MAX_EPOCH, BinaryStar, State, encode_state
from tests.support.ports import free_ports

HEARTBEAT = 0.1
# One more than the default, so that a briefly busy test machine does not fake a
# death; the rules under test are the same.
MISSED = 3
DEADLINE = 5.0

P, B, A, S = State.PRIMARY, State.BACKUP, State.ACTIVE, State.PASSIVE


def _endpoint(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def run(loop: IOLoop, scenario: Callable[[], Awaitable[None]], timeout: float = 20.0) -> None:
    loop.run_sync(scenario, timeout=timeout)


class Node:
    """A BinaryStar plus a log of the callbacks it fired, in order."""

    def __init__(
        self,
        ctx: zmq.Context,
        loop: IOLoop,
        primary: bool,
        local: str,
        peer: str,
        fast_failover: bool = True,
        **options: Any,
    ) -> None:
        self.name = "primary" if primary else "backup"
        self.star = BinaryStar(
            ctx,
            loop,
            primary,
            local,
            peer,
            heartbeat=HEARTBEAT,
            missed=MISSED,
            fast_failover=fast_failover,
            **options,
        )
        self.fired: list[str] = []
        self.star.on_active(lambda: self.fired.append("active"))
        self.star.on_passive(lambda: self.fired.append("passive"))
        self.star.on_split_brain(lambda: self.fired.append("split"))

    def describe(self) -> str:
        s = self.star
        return (
            f"{self.name}: state={s.state.name} peer={s.peer_state} fired={self.fired}"
            f" counters={s.counters}"
        )


class Cluster:
    """Tracks nodes and raw sockets so that every scenario closes all of them."""

    def __init__(self, ctx: zmq.Context, loop: IOLoop) -> None:
        self.ctx = ctx
        self.loop = loop
        self.nodes: list[Node] = []
        self.streams: list[ZMQStream] = []

    def node(
        self,
        primary: bool,
        local: str,
        peer: str,
        start: bool = True,
        fast_failover: bool = True,
        **options: Any,
    ) -> Node:
        node = Node(self.ctx, self.loop, primary, local, peer, fast_failover, **options)
        self.nodes.append(node)
        if start:
            node.star.start()
        return node

    def stream(self, socket_type: int) -> ZMQStream:
        sock = self.ctx.socket(socket_type)
        sock.setsockopt(zmq.LINGER, 0)
        stream = ZMQStream(sock, self.loop)
        self.streams.append(stream)
        return stream

    def close(self) -> None:
        for node in self.nodes:
            node.star.stop()
        for stream in self.streams:
            stream.close(linger=0)

    async def wait_until(
        self, predicate: Callable[[], bool], what: str, timeout: float = DEADLINE
    ) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                states = "\n  ".join(node.describe() for node in self.nodes)
                pytest.fail(f"timed out after {timeout} s waiting for {what}:\n  {states}")
            await asyncio.sleep(0.01)

    async def settle(self, heartbeats: int = 3) -> None:
        """Let a few heartbeats go by, to show that nothing more happens."""
        await asyncio.sleep(heartbeats * HEARTBEAT)


class Relay:
    """One direction of the network between the two servers, which a test can cut.

    It subscribes to a server's state publisher and republishes at another
    endpoint, dropping everything while ``up`` is False: a partition on demand.
    """

    def __init__(self, cluster: Cluster, source: str, out: str) -> None:
        self.up = True
        self.pub = cluster.stream(zmq.PUB)
        self.pub.bind(out)
        self.sub = cluster.stream(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.sub.on_recv(self._forward)

    def _forward(self, frames: list[bytes]) -> None:
        if self.up:
            self.pub.send_multipart(frames)


async def _send_until(
    cluster: Cluster,
    stream: ZMQStream,
    frames: list[bytes],
    predicate: Callable[[], bool],
    what: str,
) -> None:
    """Keep sending (a PUB may still be joining) until ``predicate`` holds."""
    deadline = time.monotonic() + DEADLINE
    while not predicate():
        if time.monotonic() > deadline:
            states = "\n  ".join(node.describe() for node in cluster.nodes)
            pytest.fail(f"timed out waiting for {what}:\n  {states}")
        stream.send_multipart(frames)
        await asyncio.sleep(0.02)


def _counter_above(node: Node, seen: int) -> Callable[[], bool]:
    return lambda: node.star.counters.malformed_peer_messages > seen


# -- scenarios ------------------------------------------------------------------


def test_pair_comes_up_primary_active_backup_passive(ctx: zmq.Context, loop: IOLoop) -> None:
    pa, pb = (_endpoint(p) for p in free_ports(2))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            backup = cluster.node(False, pb, pa)
            primary = cluster.node(True, pa, pb)
            await cluster.wait_until(
                lambda: (primary.star.state, backup.star.state) == (A, S),
                "primary ACTIVE, backup PASSIVE",
            )
            await cluster.settle()
            assert primary.fired == ["active"]
            assert backup.fired == ["passive"]
            for node in (primary, backup):
                counters = node.star.counters
                assert counters.state_messages_sent >= 2
                assert counters.state_messages_received >= 1
                assert counters.fsm.split_brain_count == 0
                assert counters.malformed_peer_messages == 0
                assert node.star.last_peer_contact is not None
            assert primary.star.peer_state is S and backup.star.peer_state is A
            assert (primary.star.epoch, backup.star.epoch) == (1, 0)
            assert (primary.star.peer_epoch, backup.star.peer_epoch) == (0, 1)
        finally:
            cluster.close()

    run(loop, scenario)


def test_cold_start_backup_with_newer_data_serves(ctx: zmq.Context, loop: IOLoop) -> None:
    """Both restart together from disk; the backup's data is newer, so it serves
    and the primary stands by, whatever the configured roles say."""
    pa, pb = (_endpoint(p) for p in free_ports(2))
    ranks = {"primary": (5, 120), "backup": (6, 3)}
    reads = {"primary": 0, "backup": 0}

    def source(name: str) -> Callable[[], tuple[int, int]]:
        def rank() -> tuple[int, int]:
            reads[name] += 1
            return ranks[name]

        return rank

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            primary = cluster.node(
                True, pa, pb, start=False, epoch=5, start_wait=2.0, rank=source("primary")
            )
            backup = cluster.node(
                False, pb, pa, start=False, epoch=6, start_wait=2.0, rank=source("backup")
            )
            primary.star.start()
            backup.star.start()
            await cluster.wait_until(
                lambda: (primary.star.state, backup.star.state) == (S, A),
                "backup ACTIVE, primary PASSIVE",
            )
            await cluster.settle()
            assert (primary.star.state, backup.star.state) == (S, A)
            assert primary.fired == ["passive"]
            assert backup.fired == ["active"]
            assert backup.star.epoch == 7, "the new election outbids the saved epochs"
            assert primary.star.peer_rank == (6, 3) and backup.star.peer_rank == (5, 120)
            assert primary.star.rank == (5, 120) and backup.star.rank == (6, 3)
            assert primary.star.heard_peer and backup.star.heard_peer
            assert reads["primary"] > 1 and reads["backup"] > 1, "read at every publication"
            for node in (primary, backup):
                assert node.star.counters.fsm.split_brain_count == 0
                assert node.star.counters.callback_errors == 0
        finally:
            cluster.close()

    run(loop, scenario)


def test_lone_primary_waits_out_the_start_wait_although_the_peer_is_down(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    """Nobody listens at the peer endpoint: the primary still refuses votes for
    the whole start wait (the peer may be booting with newer data), then serves."""
    pa, pb = (_endpoint(p) for p in free_ports(2))
    start_wait = 8 * HEARTBEAT  # well past the heartbeat expiry (3 heartbeats)

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            # Before the node: its start wait cannot begin earlier than this.
            started = time.monotonic()
            primary = cluster.node(True, pa, pb, start_wait=start_wait, rank=lambda: (2, 9))
            await asyncio.sleep(HEARTBEAT * MISSED * 2)
            accepted = primary.star.accept_vote()
            if time.monotonic() - started < start_wait:  # a busy machine may be past it
                assert not accepted, "accepted before the start wait ended"
                assert primary.star.state is P and not primary.star.heard_peer
            await cluster.wait_until(
                lambda: primary.star.accept_vote(), "a vote accepted after the start wait"
            )
            assert time.monotonic() - started >= start_wait
            assert primary.star.state is A and primary.fired == ["active"]
            assert not primary.star.heard_peer
        finally:
            cluster.close()

    run(loop, scenario)


def test_failover_through_voter_socket_then_failback_comes_up_passive(
    ctx: zmq.Context,
    loop: IOLoop,
) -> None:
    pa, pb, pv = (_endpoint(p) for p in free_ports(3))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            primary = cluster.node(True, pa, pb)
            # Heartbeat expiry only: the lost connection is tests/bstar/test_bstar_disconnect.py's.
            backup = cluster.node(False, pb, pa, fast_failover=False)
            served: list[list[bytes]] = []

            def serve(stream: ZMQStream, frames: list[bytes]) -> None:
                served.append(frames)
                stream.send_multipart([frames[0], b"served"])

            router = cluster.ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.bind(pv)
            backup.star.register_voter(router, serve)  # the backup now owns it
            client = cluster.stream(zmq.DEALER)
            client.connect(pv)
            replies: list[list[bytes]] = []
            client.on_recv(replies.append)

            await cluster.wait_until(
                lambda: (primary.star.state, backup.star.state) == (A, S), "pair up"
            )
            # While the primary lives, the backup drops votes unanswered.
            refused_before = backup.star.counters.fsm.votes_refused
            await _send_until(
                cluster,
                client,
                [b"snapshot?"],
                lambda: backup.star.counters.fsm.votes_refused > refused_before,
                "a refused vote",
            )
            assert served == [] and backup.star.state is S

            # The primary dies. The backup refuses votes until the primary has
            # expired, stays passive without votes, and fails over on the next one.
            primary.star.stop()
            now = time.monotonic()
            assert now < backup.star.peer_expiry
            assert not backup.star.accept_vote(now)
            await cluster.wait_until(
                lambda: backup.star.counters.fsm.peer_expirations == 1, "primary expiry"
            )
            await cluster.settle(2)
            assert backup.star.state is S, "expiry alone must not make the backup active"
            await _send_until(cluster, client, [b"snapshot?"], lambda: bool(replies), "a reply")
            assert backup.star.state is A
            assert served and served[0][-1] == b"snapshot?"
            assert replies[0] == [b"served"]
            assert backup.fired == ["passive", "active"]
            assert backup.star.epoch == 2

            # The old primary comes back: it must stand by behind the active backup.
            restarted = cluster.node(True, pa, pb)
            assert not restarted.star.accept_vote(), "a fresh primary must wait out expiry"
            await cluster.wait_until(lambda: restarted.star.state is S, "restarted primary PASSIVE")
            await cluster.settle()
            assert restarted.fired == ["passive"]
            assert restarted.star.state is S and backup.star.state is A
            assert restarted.star.peer_epoch == 2
            assert not restarted.star.accept_vote()
            assert backup.fired == ["passive", "active"]
            assert primary.fired == ["active"]
        finally:
            cluster.close()

    run(loop, scenario)


async def _split_pair(
    cluster: Cluster, pa: str, pb: str, pa_relayed: str, pb_relayed: str
) -> tuple[Node, Node, Relay, Relay]:
    """A settled pair talking through relays; then both relays cut and the backup,
    its peer expired, elected by a client vote: two actives, epochs 1 and 2."""
    to_backup = Relay(cluster, pa, pa_relayed)
    to_primary = Relay(cluster, pb, pb_relayed)
    primary = cluster.node(True, pa, pb_relayed)
    backup = cluster.node(False, pb, pa_relayed)
    await cluster.wait_until(lambda: (primary.star.state, backup.star.state) == (A, S), "pair up")
    to_backup.up = to_primary.up = False
    await cluster.wait_until(lambda: time.monotonic() >= backup.star.peer_expiry, "primary silent")
    assert backup.star.accept_vote()
    assert (primary.star.state, backup.star.state) == (A, A)
    assert (primary.star.epoch, backup.star.epoch) == (1, 2)
    return primary, backup, to_backup, to_primary


def test_split_brain_after_partition_later_elected_backup_wins(
    ctx: zmq.Context,
    loop: IOLoop,
) -> None:
    pa, pb, pa_relayed, pb_relayed = (_endpoint(p) for p in free_ports(4))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            primary, backup, to_backup, to_primary = await _split_pair(
                cluster, pa, pb, pa_relayed, pb_relayed
            )
            assert primary.star.accept_vote(), "clients on the primary's side still vote"

            # Heal one direction first, so that the backup sees an active primary.
            to_backup.up = True
            await cluster.wait_until(
                lambda: backup.star.counters.fsm.split_brain_count == 1, "backup detects"
            )
            await cluster.settle()
            assert backup.star.counters.fsm.split_brain_count == 1, "once per episode"
            assert backup.star.state is A, "epoch 2 beats epoch 1: the backup keeps serving"
            assert primary.star.state is A

            to_primary.up = True
            await cluster.wait_until(lambda: primary.star.state is S, "primary steps down")
            await cluster.settle()
            assert backup.star.counters.fsm.split_brain_count == 1
            assert primary.star.counters.fsm.split_brain_count == 1
            assert (primary.star.state, backup.star.state) == (S, A)
            assert (primary.star.epoch, backup.star.epoch) == (1, 2)
            assert primary.star.peer_epoch == 2
            assert primary.fired == ["active", "split", "passive"]
            assert backup.fired == ["passive", "active", "split"]
            assert not primary.star.accept_vote() and backup.star.accept_vote()
        finally:
            cluster.close()

    run(loop, scenario)


def test_frozen_primary_thaws_and_steps_down(ctx: zmq.Context, loop: IOLoop) -> None:
    """The drill ``freeze-active``: the thawed server must not go on serving.

    A frozen process neither sends nor reads; cutting both relays is what its
    peer sees. On thaw, both directions come back at once, as they would.
    """
    pa, pb, pa_relayed, pb_relayed = (_endpoint(p) for p in free_ports(4))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            heard: list[list[bytes]] = []
            listener = cluster.stream(zmq.SUB)
            listener.setsockopt(zmq.SUBSCRIBE, b"")
            listener.connect(pb)
            listener.on_recv(heard.append)
            primary, backup, to_backup, to_primary = await _split_pair(
                cluster, pa, pb, pa_relayed, pb_relayed
            )
            await cluster.wait_until(lambda: [b"3:2"] in heard, "backup announces ACTIVE:2")
            to_backup.up = to_primary.up = True  # thaw
            await cluster.wait_until(lambda: primary.star.state is S, "thawed primary steps down")
            await cluster.settle()
            assert (primary.star.state, backup.star.state) == (S, A)
            assert primary.fired == ["active", "split", "passive"]
            # The backup sees the stale ACTIVE:1 only if it arrives before the
            # primary's PASSIVE; either way it stays active and never re-elects.
            assert backup.fired in (["passive", "active", "split"], ["passive", "active"])
            assert backup.star.counters.fsm.split_brain_count == backup.fired.count("split")
            assert primary.star.counters.fsm.split_brain_count == 1
            assert (primary.star.epoch, primary.star.peer_epoch, backup.star.epoch) == (1, 2, 2)
        finally:
            cluster.close()

    run(loop, scenario)


def test_bad_peer_messages_are_counted_dropped_and_rate_limited(
    ctx: zmq.Context,
    loop: IOLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pa, pb = (_endpoint(p) for p in free_ports(2))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            rogue = cluster.stream(zmq.PUB)  # squats on the primary's endpoint
            rogue.bind(pa)
            backup = cluster.node(False, pb, pa)
            for frames in ([b"junk"], [b"9"], [b"3", b"3"], [b""], [b"3:-1"]):
                seen = backup.star.counters.malformed_peer_messages
                await _send_until(
                    cluster,
                    rogue,
                    frames,
                    _counter_above(backup, seen),
                    f"malformed {frames!r} counted",
                )
            # A peer claiming our own role is well formed but illegal.
            await _send_until(
                cluster,
                rogue,
                [b"2"],
                lambda: backup.star.counters.rejected_peer_events > 0,
                "role conflict rejected",
            )
            assert backup.star.state is B and backup.fired == []
            # The loop is alive and well: a proper message still works.
            await _send_until(cluster, rogue, [b"3"], lambda: backup.star.state is S, "PASSIVE")
            assert backup.fired == ["passive"]
        finally:
            cluster.close()

    run(loop, scenario)
    dropped = [r for r in caplog.records if "dropped state message" in r.getMessage()]
    assert len(dropped) == 1, "bad input must be rate-limited"
    assert dropped[0].levelno == logging.WARNING
    assert "from tcp://127.0.0.1" in dropped[0].getMessage()


def test_callback_failure_is_logged_and_the_loop_goes_on(
    ctx: zmq.Context,
    loop: IOLoop,
    caplog: pytest.LogCaptureFixture,
) -> None:
    pa, pb = (_endpoint(p) for p in free_ports(2))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            # A hand-made peer speaking the Guide's wire format, acting as backup.
            guide_backup = cluster.stream(zmq.PUB)
            guide_backup.bind(pb)
            heard: list[list[bytes]] = []
            listener = cluster.stream(zmq.SUB)
            listener.setsockopt(zmq.SUBSCRIBE, b"")
            listener.connect(pa)
            listener.on_recv(heard.append)

            primary = cluster.node(True, pa, pb, start=False)

            def broken() -> None:
                raise RuntimeError("application bug")

            primary.star.on_active(broken)
            primary.star.on_active(lambda: primary.fired.append("after"))
            primary.star.start()
            await _send_until(
                cluster, guide_backup, [b"2"], lambda: primary.star.state is A, "ACTIVE"
            )
            assert primary.fired == ["active", "after"]
            assert primary.star.counters.callback_errors == 1
            sent = primary.star.counters.state_messages_sent
            await cluster.wait_until(lambda: [b"3:1"] in heard, "ACTIVE announced as b'3:1'")
            await cluster.settle(2)
            assert primary.star.counters.state_messages_sent > sent, "heartbeat goes on"
            # One frame, state then epoch: a Guide peer's atoi still reads the state.
            assert all(frames in ([b"1:0"], [b"3:1"]) for frames in heard)
            assert primary.star.peer_epoch == 0, "the Guide peer sends no epoch"
        finally:
            cluster.close()

    run(loop, scenario)
    failures = [r for r in caplog.records if r.exc_info and "callback" in r.getMessage()]
    assert len(failures) == 1
    assert "application bug" in caplog.text


def test_stop_is_idempotent_and_closes_what_it_owns(ctx: zmq.Context, loop: IOLoop) -> None:
    pa, pb = (_endpoint(p) for p in free_ports(2))

    async def scenario() -> None:
        star = BinaryStar(ctx, loop, True, pa, pb, heartbeat=HEARTBEAT)
        star.stop()  # before start: harmless
        star = BinaryStar(ctx, loop, True, pa, pb, heartbeat=HEARTBEAT)
        assert not star.accept_vote(), "not started: no vote"
        voter = ctx.socket(zmq.ROUTER)
        voter.setsockopt(zmq.LINGER, 0)
        stream = star.register_voter(voter, lambda stream, frames: None)
        star.start()
        star.start()  # second start is a no-op
        assert star.running
        await asyncio.sleep(HEARTBEAT * 2)
        star.stop()
        star.stop()
        assert not star.running
        assert stream.closed() and voter.closed
        assert not star.accept_vote(), "stopped: no vote"
        sent = star.counters.state_messages_sent
        await asyncio.sleep(HEARTBEAT * 2)
        assert star.counters.state_messages_sent == sent, "no heartbeat after stop"
        with pytest.raises(RuntimeError):
            star.start()
        # The endpoint is free again at once (linger 0), as a restart needs.
        again = BinaryStar(ctx, loop, True, pa, pb, heartbeat=HEARTBEAT)
        again.start()
        again.stop()

    run(loop, scenario)


def test_constructor_rejects_misuse(ctx: zmq.Context, loop: IOLoop) -> None:
    ep = "tcp://127.0.0.1:5000"
    with pytest.raises(ValueError):
        BinaryStar(ctx, loop, True, ep, ep)
    with pytest.raises(ValueError):
        BinaryStar(ctx, loop, True, ep, "", heartbeat=0.1)
    with pytest.raises(ValueError):
        BinaryStar(ctx, loop, True, ep, "tcp://127.0.0.1:5001", heartbeat=0)
    with pytest.raises(ValueError):
        BinaryStar(ctx, loop, True, ep, "tcp://127.0.0.1:5001", missed=0)
    with pytest.raises(TypeError):
        BinaryStar(object(), loop, True, ep, "tcp://127.0.0.1:5001")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BinaryStar(ctx, object(), True, ep, "tcp://127.0.0.1:5001")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        BinaryStar(ctx, loop, True, ep, "tcp://127.0.0.1:5001", fast_failover=1)  # type: ignore[arg-type]
    star = BinaryStar(ctx, loop, False, ep, "tcp://127.0.0.1:5001")
    assert star.fast_failover and star.counters.peer_disconnects == 0
    with pytest.raises(TypeError):
        star.register_voter(object(), lambda stream, frames: None)  # type: ignore[arg-type]
    assert star.state is B and not star.running


def test_the_link_runs_over_curve_and_a_plain_peer_is_not_heard(
    ctx: zmq.Context, loop: IOLoop
) -> None:
    """secure_socket puts the Binary Star link on CURVE: the pair settles as
    usual, and a peer speaking plain ZMTP to a CURVE publisher hears nothing."""
    pa, pb, pc = (_endpoint(p) for p in free_ports(3))
    public, secret = zmq.curve_keypair()
    configured: list[bool] = []

    def secure(sock: zmq.Socket, bound: bool) -> None:
        configured.append(bound)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        if bound:
            sock.curve_server = True
        else:
            sock.curve_serverkey = public

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            primary = cluster.node(True, pa, pb, secure_socket=secure)
            backup = cluster.node(False, pb, pa, secure_socket=secure)
            await cluster.wait_until(
                lambda: (primary.star.state, backup.star.state) == (A, S), "primary ACTIVE"
            )
            assert sorted(configured) == [False, False, True, True]
            # A backup without CURVE pointed at the primary's publisher: never hears it.
            plain = cluster.node(False, pc, pa)
            await asyncio.sleep(5 * HEARTBEAT)
            assert plain.star.peer_state is None and plain.star.state is State.BACKUP
        finally:
            cluster.close()

    run(loop, scenario)


def test_a_peer_claiming_an_epoch_above_the_maximum_is_refused_and_counted(
    ctx: zmq.Context,
    loop: IOLoop,
) -> None:
    """A hostile peer: b"3:99999999999999999999" made a primary step down, and its
    next election an epoch the wire could not carry.  Refused now, whatever
    the field: epoch, term or sequence."""
    pa, pb = (_endpoint(p) for p in free_ports(2))

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            rogue = cluster.stream(zmq.PUB)  # squats on the backup's endpoint
            rogue.bind(pb)
            primary = cluster.node(True, pa, pb)
            await _send_until(cluster, rogue, [b"2:0"], lambda: primary.star.state is A, "ACTIVE")
            epoch = primary.star.epoch
            too_big = b"%d" % (MAX_EPOCH + 1)
            hostile = [b"3:99999999999999999999", b"3:" + too_big, b"4:0:" + too_big + b":1",
                       b"4:0:1:" + too_big]  # fmt: skip
            for frame in hostile:
                seen = primary.star.counters.out_of_range_peer_messages
                await _send_until(
                    cluster,
                    rogue,
                    [frame],
                    lambda s=seen: primary.star.counters.out_of_range_peer_messages > s,
                    f"{frame!r} refused",
                )
            counters = primary.star.counters
            assert counters.malformed_peer_messages >= len(hostile)
            assert (primary.star.state, primary.star.epoch) == (A, epoch)
            assert primary.star.peer_epoch == 0
            assert primary.fired == ["active"], "never obeyed"
            # At the bound itself: obeyed; our next election saturates there.
            await _send_until(
                cluster,
                rogue,
                [b"3:%d" % MAX_EPOCH],
                lambda: primary.star.peer_epoch == MAX_EPOCH,
                "the maximum epoch accepted",
            )
            assert counters.handler_errors == primary.star.counters.handler_errors == 0
        finally:
            cluster.close()

    run(loop, scenario)


def test_a_raising_heartbeat_tick_is_logged_and_the_tick_goes_on(
    ctx: zmq.Context,
    loop: IOLoop,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pa, pb = (_endpoint(p) for p in free_ports(2))
    failures = 3
    calls = {"failing": False, "failed": 0}

    def flaky_encode(*args: Any, **kwargs: Any) -> list[bytes]:
        if calls["failing"] and calls["failed"] < failures:
            calls["failed"] += 1
            raise ValueError("epoch out of range (simulated)")
        return encode_state(*args, **kwargs)

    monkeypatch.setattr(reactor_module, "encode_state", flaky_encode)

    async def scenario() -> None:
        cluster = Cluster(ctx, loop)
        try:
            heard: list[list[bytes]] = []
            listener = cluster.stream(zmq.SUB)
            listener.setsockopt(zmq.SUBSCRIBE, b"")
            listener.connect(pa)
            listener.on_recv(heard.append)
            node = cluster.node(True, pa, pb)
            await cluster.wait_until(lambda: len(heard) > 0, "the first heartbeat heard")
            calls["failing"] = True
            await cluster.wait_until(
                lambda: node.star.counters.handler_errors == failures, "three ticks failed"
            )
            after = len(heard)
            await cluster.wait_until(lambda: len(heard) > after + 2, "heartbeats after the errors")
            assert node.star.running
        finally:
            cluster.close()

    run(loop, scenario)
    failed = [r for r in caplog.records if "heartbeat tick failed" in r.getMessage()]
    assert len(failed) == 1, "logged once, rate-limited"
    assert failed[0].exc_info is not None, "with the traceback"
