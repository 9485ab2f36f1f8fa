"""The one way to send (clone.server.sending): its outcomes and backlog looks on
real sockets, and a scan that fails if a raw send appears anywhere else in
clone/server."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from clone.server.sending import Burst, Sent, send

SERVER = Path(__file__).resolve().parents[2] / "clone" / "server"

# Calls that put bytes on a zmq socket without looking at its backlog.
_RAW_SENDS = {
    "send",
    "send_multipart",
    "send_string",
    "send_json",
    "send_pyobj",
    "send_serialized",
    "send_frames",
    "send_tracked",
    "_raw_send",
}

# The explicit allow-list: (file, the call as written).  sending.py is the
# primitive; http.py's ``send`` is a WebSocket's text, not a zmq socket;
# ``burst.send`` and the bare ``send`` are the primitive itself.  door.py's
# ZAP handler answers on its own socket in its own thread, in lockstep (a
# REP-like request and reply, no stream, no loop): no edge to hide.
_ALLOWED = {
    ("door.py", "sock.send_multipart"),
    ("sending.py", "*"),
    ("*", "send"),
    ("*", "burst.send"),
    ("http.py", "self.send"),
    ("http.py", "hub.send"),
}


def _raw_sends(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _RAW_SENDS:
            yield node.lineno, ast.unparse(func)


def test_no_raw_send_outside_the_primitive() -> None:
    found = []
    files = sorted(SERVER.rglob("*.py"))
    assert len(files) > 20  # the scan looks at the real tree
    for path in files:
        rel = path.name
        if (rel, "*") in _ALLOWED:
            continue
        for line, call in _raw_sends(path):
            if ("*", call) in _ALLOWED or (rel, call) in _ALLOWED:
                continue
            found.append(f"{path.relative_to(SERVER)}:{line}: {call}(...)")
    assert not found, "raw sends outside clone.server.sending:\n" + "\n".join(found)


def test_the_scan_finds_a_raw_send(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(sock, stream):\n"
        "    sock.send_multipart([b'x'])\n"
        "    stream.socket.send(b'y')\n"
        "    send_frames(sock, [b'z'])\n"
    )
    assert [call for _, call in _raw_sends(bad)] == [
        "sock.send_multipart",
        "stream.socket.send",
        "send_frames",
    ]


@pytest.fixture
def pair(ctx: zmq.Context[Any]) -> Iterator[tuple[zmq.Socket[Any], zmq.Socket[Any]]]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"d")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    try:
        yield router, dealer
    finally:
        dealer.close(0)
        router.close(0)


def test_send_looks_at_the_backlog_whatever_the_outcome(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    looks: list[str] = []
    # Unknown identity on a mandatory ROUTER: gone, and still a look.
    assert send(router, [b"nobody", b"x"], backlog=lambda: looks.append("gone")) is Sent.GONE
    dealer.send(b"hello")
    assert router.poll(10_000)
    assert router.recv_multipart() == [b"d", b"hello"]
    assert send(router, [b"d", b"back"], backlog=lambda: looks.append("ok")) is Sent.OK
    assert dealer.poll(10_000)
    assert dealer.recv() == b"back"
    assert looks == ["gone", "ok"]


def test_a_full_pipe_is_an_outcome(ctx: zmq.Context[Any]) -> None:
    dealer = ctx.socket(zmq.DEALER)  # connected to nobody: every send is EAGAIN
    try:
        looks: list[int] = []
        assert send(dealer, [b"x"], backlog=lambda: looks.append(1)) is Sent.FULL
        assert looks == [1]
    finally:
        dealer.close(0)


def test_a_burst_looks_once_and_only_if_it_sent(
    pair: tuple[zmq.Socket[Any], zmq.Socket[Any]],
) -> None:
    router, dealer = pair
    looks: list[int] = []
    with Burst(lambda: looks.append(1)):
        pass
    assert looks == []  # no send tried: no edge consumed
    dealer.send(b"hi")
    assert router.poll(10_000)
    router.recv_multipart()
    trackers: list[zmq.MessageTracker] = []
    with Burst(lambda: looks.append(2)) as burst:
        for i in range(3):
            assert burst.send(router, [b"d", b"%d" % i], trackers=trackers) is Sent.OK
        assert looks == []  # not yet: at the end of the burst
    assert looks == [2]
    assert len(trackers) == 3
    got = []
    for _ in range(3):
        assert dealer.poll(10_000)
        got.append(dealer.recv())
    assert got == [b"0", b"1", b"2"]


def test_a_burst_looks_when_its_block_raises(ctx: zmq.Context[Any]) -> None:
    looks: list[int] = []
    sock = ctx.socket(zmq.DEALER)
    try:
        with pytest.raises(RuntimeError):
            with Burst(lambda: looks.append(1)) as burst:
                burst.send(sock, [b"x"])
                raise RuntimeError("boom")
        assert looks == [1]
    finally:
        sock.close(0)
