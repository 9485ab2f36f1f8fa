"""``clone``'s main() called in-process leaves the caller's signals as they were.

The CLI ignores SIGINT while it closes its client (a second Ctrl-C must not
cut the close short), and ``lease keep-alive`` and ``elect`` make SIGTERM and
SIGHUP end them as Ctrl-C does; a program that embeds the CLI must get its
own handlers back, whether the command returned or raised, and its later
children must not inherit an ignored SIGINT.  No server: the client's close,
the unreachable path and the held commands' handlers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from signal import getsignal as real_getsignal
from types import FrameType

import pytest

from clone.client import cli
from clone.client.commands import leases
from clone.errors import CloneError


class _Closing:
    """A client whose close records the SIGINT disposition it ran under."""

    def __init__(self, fails: bool = False) -> None:
        self.fails = fails
        self.during: list[object] = []

    def close(self) -> None:
        self.during.append(real_getsignal(signal.SIGINT))  # not a test's stand-in
        if self.fails:
            raise CloneError("close failed")


def _embedders_handler(signum: int, frame: FrameType | None) -> None:
    raise AssertionError("no SIGINT is sent in these tests")


@pytest.fixture
def own_handler() -> Iterator[None]:
    """SIGINT handled by the embedding program's own handler, as before."""
    previous = signal.signal(signal.SIGINT, _embedders_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_the_close_runs_with_sigint_ignored_and_the_handler_comes_back(own_handler: None) -> None:
    client = _Closing()
    cli._close_uninterrupted(client)  # type: ignore[arg-type]
    assert client.during == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is _embedders_handler


def test_a_close_that_raises_still_gives_the_handler_back(own_handler: None) -> None:
    client = _Closing(fails=True)
    with pytest.raises(CloneError, match="close failed"):
        cli._close_uninterrupted(client)  # type: ignore[arg-type]
    assert client.during == [signal.SIG_IGN]
    assert signal.getsignal(signal.SIGINT) is _embedders_handler


def test_a_handler_python_cannot_put_back_is_left_alone(
    own_handler: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An embedding C program's handler: getsignal says None, and
    # signal.signal(SIGINT, None) would raise TypeError with SIGINT ignored.
    monkeypatch.setattr(cli.signal, "getsignal", lambda signum: None)
    client = _Closing()
    cli._close_uninterrupted(client)  # type: ignore[arg-type]
    monkeypatch.undo()
    assert client.during == [_embedders_handler]  # never ignored
    assert signal.getsignal(signal.SIGINT) is _embedders_handler


def test_off_the_main_thread_the_close_is_plain(own_handler: None) -> None:
    client = _Closing()
    worker = threading.Thread(target=cli._close_uninterrupted, args=(client,))
    worker.start()
    worker.join(30)
    assert client.during == [_embedders_handler]
    assert signal.getsignal(signal.SIGINT) is _embedders_handler


def test_main_on_its_error_path_gives_the_handler_back(
    own_handler: None, capsys: pytest.CaptureFixture[str]
) -> None:
    # Nothing listens on port 1: not synced, the client closed twice (before
    # the probe and at the end), exit 2.
    code = cli.main(["--servers", "127.0.0.1:1", "--timeout", "0", "get", "/k"])
    assert code == cli.EXIT_UNREACHABLE
    assert capsys.readouterr().err
    assert signal.getsignal(signal.SIGINT) is _embedders_handler


def test_a_held_command_ends_on_sigterm_and_gives_the_handlers_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(KeyboardInterrupt), leases._held_until_signal():
        os.kill(os.getpid(), signal.SIGTERM)  # as `kill` sends it to clone lease keep-alive
        for _ in range(1000):  # the handler runs between bytecodes, in this thread
            time.sleep(0.01)
        raise AssertionError("SIGTERM did not end the held command")
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_held_command_that_fails_gives_the_handlers_back() -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with pytest.raises(CloneError, match="lost"), leases._held_until_signal():
        assert signal.getsignal(signal.SIGHUP) not in (before[signal.SIGHUP], signal.SIG_DFL)
        raise CloneError("lost")
    assert {sig: signal.getsignal(sig) for sig in before} == before
