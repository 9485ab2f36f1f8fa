"""A pipe that ends a helper thread's poll at once, so that its stop is immediate.

Why: the server's helper threads (the publisher's door, its inbound watch)
wait in a ZeroMQ poll of up to 100 ms and looked at their stop flag only
when it timed out.  Every stop of a server, SIGTERM's included, waited for
them: about 90 ms of a 95 ms stop of an idle server (docs/benchmarks.md,
"Stopping without waiting out a poll").  A thread that polls this pipe's
read end beside its socket wakes as soon as :meth:`WakePipe.wake` writes.
"""

from __future__ import annotations

import os

__all__ = ["WakePipe"]


class WakePipe:
    """The read end goes into a poller; :meth:`wake` makes it readable.

    Nothing reads it: a thread woken by it stops.  Writes never block (a full
    pipe is already readable)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._closed = False

    @property
    def fd(self) -> int:
        """The descriptor to poll for POLLIN."""
        return self._read

    def wake(self) -> None:
        if self._closed:
            return
        try:
            os.write(self._write, b"x")
        except BlockingIOError:  # full: readable already
            pass

    def close(self) -> None:
        """Close both ends; only once the polling thread is gone."""
        if not self._closed:
            self._closed = True
            os.close(self._read)
            os.close(self._write)
