"""A real server pair whose wall clocks are stepped with libfaketime: a
step of ±60 s on either server expires no lease early, and a TTL
key lives its ttl (at most about a heartbeat more) across a failover and a
restart.

Each server runs under libfaketime with its own timestamp file; rewriting the
file steps that process's ``time.time`` while ``CLOCK_MONOTONIC`` is left alone
(``DONT_FAKE_MONOTONIC=1``; the probe below checks that it really is).  A step
is confirmed by the server's own log timestamps before the test goes on.
Lifetimes are measured on the test's monotonic clock, which the servers share
(one machine, one CLOCK_MONOTONIC).
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import zmq

from clone.tools.chaos.faults import find_libfaketime, sweep_faketime_segments
from clone.wire.calls import OP_LEASE_GRANT, decode_reply, encode_call, lease_key
from tests.support.chp_peer import ChpPeer, Snapshot
from tests.support.servers import ServerProcess, Servers, log_line, read_stats
from tests.support.waiting import eventually

#: The rule's slack: "at most about one heartbeat more", with the default
#: heartbeat (1 s); the test servers beat every 100 ms, so this also covers
#: the housekeeping timer and a loaded machine's scheduling.
SLACK = 1.0
STEP = 60.0

class FakeClock:
    """One server's wall-clock offset, in a libfaketime timestamp file."""

    def __init__(self, lib: str, path: Path) -> None:
        self.lib = lib
        self.path = path
        self.offset = 0.0
        self._write()

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(f"{self.offset:+.0f}\n")
        os.replace(tmp, self.path)  # never a half-written file

    @property
    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": self.lib,
            "FAKETIME_TIMESTAMP_FILE": str(self.path),
            # Read again every second (at every call costs the server's loop):
            # _step() waits until the server's log shows the step.
            "FAKETIME_CACHE_DURATION": "1",
            "DONT_FAKE_MONOTONIC": "1",  # libfaketime 0.9.x
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # later versions
        }

    def step(self, seconds: float) -> None:
        self.offset += seconds
        self._write()


_PROBE = "import time; print(time.time(), time.monotonic())"


@pytest.fixture(scope="module")
def libfaketime() -> Iterator[str]:
    """The preload library, checked to step the wall clock and only it; once
    the module's servers have stopped, the shared memory libfaketime left for
    each of them is removed (clone.tools.chaos.faults.sweep_faketime_segments)."""
    lib = find_libfaketime()
    if lib is None:
        pytest.skip(
            "libfaketime is not installed (Debian: apt-get install faketime; scripts/test"
            " installs it when run as root): cannot step a real server's wall clock"
        )
    probe_file = Path(f"/tmp/clone-faketime-probe-{os.getpid()}")
    try:
        probe_file.write_text("+3600\n")
        env = {**os.environ, **FakeClock(lib, probe_file).env}
        probe_file.write_text("+3600\n")
        before = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=30
        )
        after = time.monotonic()
    finally:
        probe_file.unlink(missing_ok=True)
    if out.returncode != 0:
        pytest.skip(f"a process under libfaketime failed: {out.stderr[-500:]}")
    wall, mono = map(float, out.stdout.split())
    if abs(wall - time.time() - 3600) > 30:
        pytest.skip(f"libfaketime did not step the wall clock (offset {wall - time.time():.0f} s)")
    if not before <= mono <= after:
        pytest.skip("libfaketime here fakes CLOCK_MONOTONIC too (DONT_FAKE_MONOTONIC ignored)")
    yield lib
    sweep_faketime_segments()


def _server_wall_offset(server: ServerProcess) -> float:
    """The server's wall clock minus ours, from the timestamp of a log line."""
    mark = server.log_size()
    asked = time.time()
    read_stats(server)
    line = log_line(server, "stats: ", after=mark)
    shown = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    return shown - asked


def _step(server: ServerProcess, clock: FakeClock, seconds: float) -> None:
    """Step the server's wall clock and wait until its log shows it."""
    clock.step(seconds)
    eventually(
        lambda: abs(_server_wall_offset(server) - clock.offset) < 15,
        timeout=20,
        what=f"{server.name}'s wall clock to be {clock.offset:+.0f} s off",
    )


def _clocks(libfaketime: str, tmp_path: Path) -> dict[str, FakeClock]:
    roles = ("primary", "backup")
    return {role: FakeClock(libfaketime, tmp_path / f"{role}.faketime") for role in roles}


def _fake_pair(
    servers: Servers, libfaketime: str, tmp_path: Path
) -> tuple[ServerProcess, ServerProcess, dict[str, FakeClock]]:
    clocks = _clocks(libfaketime, tmp_path)
    primary, backup = servers.pair(env={role: c.env for role, c in clocks.items()})
    return primary, backup, clocks


def _delete_seen(peer: ChpPeer, key: bytes, timeout: float) -> float:
    """When (our monotonic clock) the delete of ``key`` arrives."""
    peer.wait_for(lambda m: m.key == key and not m.body and not m.is_hugz, timeout=timeout)
    return time.monotonic()


def _snapshot_with_retry(peer: ChpPeer, port: int, timeout: float) -> Snapshot:
    """Ask like a client failing over: short timeouts, repeated, a fresh socket."""
    deadline = time.monotonic() + timeout
    while True:
        peer.use_snapshot_server(port)
        try:
            return peer.snapshot(timeout=0.3)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def _grant(ctx: zmq.Context, port: int, ttl: float) -> tuple[str, float]:
    """A lease granted by a raw CALL?; its id and when we asked (monotonic)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(f"tcp://127.0.0.1:{port}")
        asked = time.monotonic()
        props = (("ttl", repr(ttl)),)
        dealer.send_multipart(encode_call(OP_LEASE_GRANT, os.urandom(16), "", props, b""))
        assert dealer.poll(10_000), "no reply to the lease grant"
        reply = decode_reply(dealer.recv_multipart())
        assert reply.ok, reply
        return reply.lease, asked
    finally:
        dealer.close(linger=0)


@pytest.mark.parametrize("step", [+STEP, -STEP], ids=["ahead", "behind"])
def test_a_wall_clock_step_on_the_active_expires_no_lease_early(
    servers: Servers, ctx: zmq.Context, libfaketime: str, tmp_path: Path, step: float
) -> None:
    """Before: a +30 s step revoked every live lease at once (two lock holders)."""
    primary, _backup, clocks = _fake_pair(servers, libfaketime, tmp_path)
    peer = ChpPeer(ctx)
    try:
        peer.connect(primary.port)
        peer.wait_hugz()
        ttl = 4.0
        lease, asked = _grant(ctx, primary.port, ttl)
        # The step is confirmed from the server's log in a thread while this one
        # reads the delete as it comes: confirming can take longer than the ttl
        # on a loaded machine, and a delete read only after it would count the
        # wait as the lease's life (CI saw 9.9 s).
        with ThreadPoolExecutor(1) as pool:
            stepped = pool.submit(_step, primary, clocks["primary"], step)
            gone = _delete_seen(peer, lease_key(lease).encode(), timeout=ttl + 30)
            stepped.result(timeout=30)
        lived = gone - asked
        # Never early (the unsafe direction); and not kept alive by a step back.
        assert ttl <= lived <= ttl + SLACK, lived
    finally:
        peer.close()


@pytest.mark.parametrize("stepped", ["primary", "backup"])
@pytest.mark.parametrize("step", [+STEP, -STEP], ids=["ahead", "behind"])
def test_after_a_failover_a_key_lives_its_ttl_whatever_either_wall_clock_did(
    servers: Servers,
    ctx: zmq.Context,
    libfaketime: str,
    tmp_path: Path,
    stepped: str,
    step: float,
) -> None:
    """Before: after a failover to a backup 10 s ahead a 20 s key lived 10 s;
    10 s behind, 30.1 s."""
    primary, backup, clocks = _fake_pair(servers, libfaketime, tmp_path)
    _step(primary if stepped == "primary" else backup, clocks[stepped], step)
    peer = ChpPeer(ctx)
    try:
        peer.connect(primary.port, collectors=[primary.port, backup.port])
        peer.wait_hugz()
        ttl = 6.0
        written = time.monotonic()
        peer.kvset(b"/ttl/k", b"v", props={"ttl": repr(ttl)})
        pub = peer.wait_for(lambda m: m.key == b"/ttl/k", timeout=10)
        eventually(
            lambda: int(str(read_stats(backup)["peer_updates"])) >= 1,
            what="the backup to follow the write",
        )
        primary.kill9()
        peer.resubscribe(backup.port)
        # A client's vote fails the backup over (Binary Star): ask it, as a client would.
        snap = _snapshot_with_retry(peer, backup.port, timeout=ttl)
        assert b"/ttl/k" in snap.entries, "the key was gone at the failover"
        gone = _delete_seen(peer, b"/ttl/k", timeout=ttl + 30)
        lived = gone - written
        assert ttl <= lived <= ttl + SLACK, (lived, pub.props)
        assert "now ACTIVE" in backup.log_text()
    finally:
        peer.close()


@pytest.mark.parametrize("step", [+STEP, -STEP], ids=["ahead", "behind"])
def test_a_restart_with_a_stepped_wall_clock_gives_a_key_at_least_what_it_had_left(
    servers: Servers, ctx: zmq.Context, libfaketime: str, tmp_path: Path, step: float
) -> None:
    """Monotonic time does not survive a restart: a key loaded from the data
    directory gets its stored ttl again from the load (never less than it had
    left), whatever the wall clock did meanwhile."""
    clock = FakeClock(libfaketime, tmp_path / "solo.faketime")
    solo = servers.standalone(env=clock.env)
    peer = ChpPeer(ctx)
    try:
        peer.connect(solo.port, collectors=[solo.port])
        peer.wait_hugz()
        ttl = 4.0
        written = time.monotonic()
        peer.kvset(b"/ttl/r", b"v", props={"ttl": repr(ttl)})
        peer.wait_for(lambda m: m.key == b"/ttl/r", timeout=10)
        solo.terminate(timeout=10)
        clock.step(step)
        solo.restart()
        solo.wait_serving()
        loaded = time.monotonic()
        assert abs(_server_wall_offset(solo) - step) < 15
        peer.resubscribe(solo.port)
        gone = _delete_seen(peer, b"/ttl/r", timeout=ttl + 30)
        assert gone - written >= ttl
        assert gone - loaded <= ttl + SLACK
    finally:
        peer.close()


def test_the_probe_process_sees_the_step_and_a_steady_monotonic_clock(
    libfaketime: str, tmp_path: Path
) -> None:
    """What the tests above rest on: the preload steps time.time() of a running
    process when its file is rewritten, and leaves time.monotonic() alone."""
    clock = FakeClock(libfaketime, tmp_path / "probe.faketime")
    # The file is read again every second: wait up to 5 s (on the monotonic
    # clock, with Event.wait: libfaketime 0.9.10 breaks time.sleep when it
    # leaves the monotonic clock alone) for the step to show.
    script = (
        "import sys, threading, time\n"
        "w, m = time.time(), time.monotonic()\n"
        "print(w, m, flush=True)\n"
        "sys.stdin.readline()\n"
        "while time.monotonic() - m < 5 and (time.time() - w) - (time.monotonic() - m) < 30:\n"
        "    threading.Event().wait(0.05)\n"
        "print(time.time(), time.monotonic(), flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        env={**os.environ, **clock.env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        wall1, mono1 = map(float, proc.stdout.readline().split())
        clock.step(+STEP)
        proc.stdin.write("\n")
        proc.stdin.flush()
        wall2, mono2 = map(float, proc.stdout.readline().split())
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert STEP - 5 < (wall2 - wall1) - (mono2 - mono1) < STEP + 5
    assert 0 <= mono2 - mono1 < 10  # seen within the wait, not by a jump
    assert abs(mono2 - time.monotonic()) < 10  # the real monotonic clock
