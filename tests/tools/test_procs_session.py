"""A drill's child in a session of its own, or in the drill's."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from clone.tools.procs import ProcessGroup
from tests.support.waiting import eventually


def _sid_line(path: Path) -> int | None:
    for line in path.read_text().splitlines():
        if line.startswith("sid "):
            return int(line.split()[1])
    return None


@pytest.mark.slow
@pytest.mark.parametrize("own", [True, False])
def test_a_child_gets_a_session_of_its_own_only_when_asked(tmp_path: Path, own: bool) -> None:
    argv = [sys.executable, "-c", "import os; print('sid', os.getsid(0), flush=True)"]
    with ProcessGroup(tmp_path) as group:
        proc = group.add("child", argv, own_session=own)
        assert proc.wait(30) == 0
        eventually(lambda: _sid_line(proc.log_path) is not None, timeout=30)
        sid = _sid_line(proc.log_path)
    if own:
        assert sid == proc.pid  # it leads its own session
    else:
        assert sid == os.getsid(0)
