"""A child started by our process helpers dies with its parent (``setpriv``).

The children are started without a ``preexec_fn``: Python code between fork
and exec can deadlock in a threaded parent, and ``Popen`` then waits forever.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from clone.tools.procs import with_pdeathsig
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

_PARENT = textwrap.dedent(
    """
    import signal, subprocess, sys, time
    from clone.tools.procs import with_pdeathsig
    argv, preexec = with_pdeathsig(["sleep", "60"], signal.Signals[sys.argv[1]])
    assert preexec is None, "setpriv is missing"
    child = subprocess.Popen(argv, preexec_fn=preexec)
    print(child.pid, flush=True)
    time.sleep(60)
    """
)


def _program(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].startswith("Z")  # a zombie is gone
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_a_child_dies_when_its_parent_is_killed(sig: str) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, sig], stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert not _gone(child)
        eventually(lambda: _program(child) == b"sleep", 10, "setpriv to exec (same pid)")
        parent.kill()
        parent.wait(10)
        eventually(lambda: _gone(child), 10, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait(10)


def test_without_setpriv_a_preexec_sets_the_signal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    argv, preexec = with_pdeathsig(["true"])
    assert argv == ["true"] and preexec is not None
    # The fallback still works: the child runs and exits on its own.
    assert subprocess.run(["/bin/true"], preexec_fn=preexec, timeout=10).returncode == 0
