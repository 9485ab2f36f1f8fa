"""The command pipe's wait for the agent's answer (clone.client.pipe): time
the process did not run does not count against the agent, and an agent that
does not answer still times out."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from clone.client import pipe as pipe_mod
from clone.client import verbs
from clone.client.pipe import FROZEN_S, CommandPipe
from clone.errors import AgentTimeout

_numbers = itertools.count(1)


@pytest.fixture
def ctx() -> Iterator[zmq.Context[Any]]:
    context: zmq.Context[Any] = zmq.Context()
    yield context
    context.term()


class _Clock:
    """time.monotonic() plus the seconds a "freeze" added."""

    def __init__(self) -> None:
        self.frozen = 0.0
        self._real = pipe_mod.time.monotonic

    def monotonic(self) -> float:
        return self._real() + self.frozen


class _FreezingSocket:
    """The front socket, whose first poll comes back empty and 30 s late (the
    process stopped while waiting), after its agent answered meanwhile."""

    def __init__(self, sock: zmq.Socket[Any], clock: _Clock, answer: threading.Event) -> None:
        self._sock, self._clock, self._answer = sock, clock, answer
        self.polls = 0

    def poll(self, timeout: int) -> int:
        self.polls += 1
        if self.polls == 1:
            self._clock.frozen += 30.0
            self._answer.set()  # the agent answers once the process runs again
            return 0
        return int(self._sock.poll(timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _agent(back: zmq.Socket[Any], answer: threading.Event) -> None:
    frames = back.recv_multipart()
    answer.wait(10)
    back.send_multipart([verbs.OK, frames[1], b"status"])


def _pipes(ctx: zmq.Context[Any]) -> CommandPipe:
    return CommandPipe(ctx, 10_000 + next(_numbers), timeout=5.0)


def _close(p: CommandPipe) -> None:
    p.close_front()
    for sock in (p.commands[1], p.events[1]):
        sock.close(linger=0)


def test_a_freeze_while_waiting_is_not_the_agents_delay(
    ctx: zmq.Context[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    monkeypatch.setattr(pipe_mod.time, "monotonic", clock.monotonic)
    p = _pipes(ctx)
    answer = threading.Event()
    front = _FreezingSocket(p.commands[0], clock, answer)
    p.commands = (front, p.commands[1])  # type: ignore[assignment]
    agent = threading.Thread(target=_agent, args=(p.commands[1], answer), daemon=True)
    agent.start()
    try:
        assert p.request(verbs.STATUS, []) == [b"status"]
        assert front.polls >= 2 and clock.frozen > FROZEN_S
    finally:
        agent.join(10)
        _close(p)


def test_an_agent_that_does_not_answer_still_times_out(ctx: zmq.Context[Any]) -> None:
    p = CommandPipe(ctx, 10_000 + next(_numbers), timeout=0.2)
    try:
        with pytest.raises(AgentTimeout, match=r"did not answer STATUS within 0\.2 s"):
            p.request(verbs.STATUS, [])
    finally:
        _close(p)
