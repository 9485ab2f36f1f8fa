"""The core, its three parts (calls, sync, split-brain heal), its settings and
the stream opener stay sans-IO: no sockets, no clock, no logging on their paths
(events and ``now`` in, replies and outcomes out)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = (
    "clone/server/core.py",
    "clone/server/callcore.py",
    "clone/server/synccore.py",
    "clone/server/splitcore.py",
    "clone/server/coresettings.py",
    "clone/server/delta.py",
)
#: What a sans-IO module must not import (house style, "Sans-IO cores").
BANNED = {"zmq", "tornado", "time", "socket", "asyncio", "threading", "logging", "sqlite3"}


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_no_io(module: str) -> None:
    bad = _imports(ROOT / module) & BANNED
    assert not bad, f"{module} imports {sorted(bad)}: the core is sans-IO"


def test_the_check_sees_an_import() -> None:
    assert "clone" in _imports(ROOT / "clone/server/core.py")
