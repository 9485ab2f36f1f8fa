"""``clone status`` without a server: the table, unreachable servers,
usage errors, and a fake server that answers STATUS? (or garbage)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clone.client.cli import EXIT_OK, EXIT_UNREACHABLE, main
from clone.client.status import STATUS_COLUMNS, query_status, status_table
from clone.wire.status import encode_status, is_status_request
from tests.support.ports import free_base_port


class _Answerer:
    """A ROUTER on a free base port answering each STATUS? with ``reply``."""

    def __init__(self, reply: list[bytes]) -> None:
        self.port = free_base_port()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._reply = reply
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(20):
                identity, *frames = self._sock.recv_multipart()
                if is_status_request(frames):
                    self._sock.send_multipart([identity, *self._reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(linger=0)
        self._ctx.term()


@pytest.fixture
def answerer() -> Iterator[_Answerer]:
    server = _Answerer(encode_status({"role": "active", "sequence": 5, "keys": 2,
                                      "endpoint": "lies", "reachable": False}))  # fmt: skip
    yield server
    server.close()


def _dead() -> str:
    return f"tcp://127.0.0.1:{free_base_port()}"


def test_an_answer_and_a_silence(answerer: _Answerer) -> None:
    up = f"tcp://127.0.0.1:{answerer.port}"
    down = _dead()
    got = query_status([up, down], 0.5)
    assert got[0] == {"endpoint": up, "reachable": True, "role": "active", "sequence": 5,
                      "keys": 2}  # fmt: skip
    assert got[1]["endpoint"] == down and got[1]["reachable"] is False
    assert all(got[1][c] is None for c in STATUS_COLUMNS)
    assert "no answer within 0.5 s" in got[1]["error"]


class _ImmediateSocket(zmq.Socket):  # type: ignore[type-arg]
    """A socket that queues nothing before its connection is made
    (``ZMQ_IMMEDIATE``): a send with no connection raises ``Again``, as a
    DEALER's does after a server refused its handshake."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.setsockopt(zmq.IMMEDIATE, 1)


class _ImmediateContext(zmq.Context):  # type: ignore[type-arg]
    _socket_class = _ImmediateSocket


def test_a_request_no_connection_takes_is_unreachable_not_a_crash() -> None:
    """Found by a CI run: ``clone status`` without keys against a CURVE pair
    raised ``zmq.Again`` from its send instead of saying unreachable."""
    ctx = _ImmediateContext()
    try:
        down = _dead()
        (got,) = query_status([down], 0.3, ctx=ctx)
    finally:
        ctx.term()
    assert got["endpoint"] == down and got["reachable"] is False
    assert "no connection took the request within 0.3 s" in got["error"]


def test_a_request_is_offered_again_until_a_connection_takes_it(answerer: _Answerer) -> None:
    """With nothing queued before the connection is made, the first send
    finds no connection; the request is offered again and answered."""
    ctx = _ImmediateContext()
    try:
        (got,) = query_status([f"tcp://127.0.0.1:{answerer.port}"], 10.0, ctx=ctx)
    finally:
        ctx.term()
    assert got["reachable"] is True and got["role"] == "active"


def test_offers_poll_briefly_only_while_a_request_is_unsent(ctx: zmq.Context[Any]) -> None:
    """The shared wait of the one-shot askers: while no connection took the
    request, the poll wakes every RESEND_MS to offer it again; once every
    socket took it, the poll may wait the whole time left."""
    from clone.wire.frames import RESEND_MS, Offers

    immediate = _ImmediateContext()
    try:
        refused = immediate.socket(zmq.DEALER)
        refused.connect(_dead())
        queued = ctx.socket(zmq.DEALER)  # queues before it connects
        # Linger 0 now: freed with the test's locals, before the fixture's
        # destroy, a socket closes with the default (forever) and the queued
        # request would hold the context's term.
        queued.setsockopt(zmq.LINGER, 0)
        queued.connect(_dead())
        offers = Offers([b"ping"])
        offers.offer(refused)
        offers.offer(queued)
        assert offers.unsent == {refused}
        assert offers.poll_ms(5.0) == RESEND_MS
        assert offers.poll_ms(0.01) == 10
        offers.unsent.clear()  # as if a connection took it
        assert offers.poll_ms(5.0) == 5000
    finally:
        immediate.destroy(linger=0)


def test_conflicts_and_diagnose_say_unreachable_when_no_connection_takes_a_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``clone conflicts``, ``clone resolve`` and ``clone diagnose`` open their
    own contexts: every socket made here queues nothing before a connection,
    as after a refused handshake; each says the server did not answer."""
    from clone.client.commands.diagnose import probe
    from clone.client.conflicts import query_conflicts, resolve_conflict

    monkeypatch.setattr(zmq, "Context", _ImmediateContext)
    down = _dead()
    assert query_conflicts([down], 0.3) == ([], [down])
    with pytest.raises(TimeoutError, match=r"took the call within 0\.3 s"):
        resolve_conflict(down, 1, "/k", apply=True, timeout=0.3)
    (seen,) = probe([down], 0.3, None)
    assert seen.role is None and not seen.refused_key


def test_a_bad_reply_is_unreachable() -> None:
    server = _Answerer([b"STATUS", b"[]"])
    try:
        (got,) = query_status([f"tcp://127.0.0.1:{server.port}"], 1.0)
    finally:
        server.close()
    assert got["reachable"] is False and "bad reply" in got["error"]


def test_query_refuses_bad_arguments() -> None:
    with pytest.raises(ValueError):
        query_status(["tcp://127.0.0.1:5556"], 0)
    with pytest.raises(ValueError):
        query_status(["nohost"], 1.0)


def test_table() -> None:
    lines = status_table(
        [
            {"endpoint": "tcp://a:1", "reachable": True, "role": "active", "sequence": 10,
             "keys": 4, "peer_state": {"state": "passive", "alive": True},
             "uptime": 3725.2, "version": "0.2.0", "data_format": 2,
             "data_dir_bytes": 823_132_160},
            {"endpoint": "tcp://c:1", "reachable": True, "role": "passive", "sequence": 10,
             "keys": 4, "peer_state": {"state": "active", "alive": True},
             "uptime": 5.0, "version": "0.1.0"},
            {"endpoint": "tcp://b:1", "reachable": False, "role": None, "sequence": None,
             "keys": None, "peer_state": None, "uptime": None, "version": None},
        ]
    )  # fmt: skip
    assert lines[0].split() == [
        "ENDPOINT", "REACHABLE", "ROLE", "SEQUENCE", "KEYS", "DISK", "PEER", "UPTIME", "VERSION",
    ]  # fmt: skip
    assert lines[1].split() == [
        "tcp://a:1", "yes", "active", "10", "4", "785.0M", "passive", "(alive)", "1h02m05s",
        "0.2.0",
        "(format", "2)",
    ]  # fmt: skip
    # Release 0.1.0 reports no format: its version alone.
    assert lines[2].split()[-1] == "0.1.0" and "format" not in lines[2]
    assert lines[3].split() == ["tcp://b:1", "NO", "-", "-", "-", "-", "-", "-", "-"]
    assert len({line.index("ROLE") for line in lines[:1]}) == 1
    assert len(lines) == 4  # no conflicts: no more lines


def test_table_says_unresolved_conflicts() -> None:
    up = {"endpoint": "tcp://a:1", "reachable": True, "role": "active", "sequence": 1,
          "keys": 1, "peer_state": None, "uptime": 1.0, "version": "0.2.0", "conflicts": 3}
    lines = status_table([up, {**up, "endpoint": "tcp://b:1", "conflicts": 0}])  # fmt: skip
    assert lines[3:] == ["tcp://a:1: 3 unresolved split-brain conflict(s): see `clone conflicts`"]


def test_cli_json_and_exit_codes(answerer: _Answerer, capsys: pytest.CaptureFixture[str]) -> None:
    up = f"tcp://127.0.0.1:{answerer.port}"
    assert main(["--servers", up, "status", "--json", "--timeout", "1"]) == EXIT_OK
    (one,) = json.loads(capsys.readouterr().out)
    assert one["reachable"] is True and one["role"] == "active"
    down = _dead()
    code = main(["--servers", f"{up},{down}", "--timeout", "0.3", "status", "--json"])
    assert code == EXIT_UNREACHABLE
    out, err = capsys.readouterr()
    assert [s["reachable"] for s in json.loads(out)] == [True, False]
    assert f"{down} did not answer within 0.3 s" in err


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--servers", "nohost", "status"]) == EXIT_UNREACHABLE
    assert "nohost" in capsys.readouterr().err
    assert main(["--servers", "127.0.0.1:1", "status", "--timeout", "0"]) == EXIT_UNREACHABLE
    assert "--timeout" in capsys.readouterr().err
    code = main(["--servers", "127.0.0.1:1", "--curve-secret", "/nonexistent", "status"])
    assert code == EXIT_UNREACHABLE
    assert "server_key" in capsys.readouterr().err
