"""A zmq context that remembers its sockets, so teardown can prove all were closed."""

from __future__ import annotations

from typing import Any

import zmq

__all__ = ["TrackingContext"]


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
