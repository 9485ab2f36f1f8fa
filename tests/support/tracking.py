"""A zmq context that remembers its sockets, so teardown can prove all were closed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import zmq

__all__ = ["TrackingContext", "tracking_context"]


class TrackingContext(zmq.Context):
    """Every socket it made, in ``made``; a fixture asserts they are all closed."""

    made: list[zmq.Socket]

    def __init__(self) -> None:
        super().__init__()
        self.made = []

    def socket(self, socket_type: int, *args: Any, **kwargs: Any) -> zmq.Socket:
        sock = super().socket(socket_type, *args, **kwargs)
        self.made.append(sock)
        return sock


def tracking_context() -> Iterator[TrackingContext]:
    """Body of a ``ctx`` fixture: yield a context, then prove every socket it made
    was closed and that ``term()`` returns (run in a thread, so a leak fails the
    test instead of hanging the run)."""
    context = TrackingContext()
    try:
        yield context
        left_open = [s for s in context.made if not s.closed]
        assert not left_open, f"sockets left open: {left_open}"
        done = threading.Event()

        def term() -> None:
            context.term()
            done.set()

        terminator = threading.Thread(target=term, daemon=True)
        terminator.start()
        assert done.wait(2.0), "context.term() hung: a socket was leaked"
    finally:
        if not context.closed:
            context.destroy(linger=0)
