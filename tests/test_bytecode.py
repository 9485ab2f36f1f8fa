"""The test run's bytecode cache where PYTHONDONTWRITEBYTECODE turns it off:
scripts/test's ``cache_bytecode_outside_checkout`` (for pytest's own imports)
and tests/support/bytecode.py (for everything after tests/conftest.py) agree on
one directory outside the checkout, and leave a cache the environment already
names alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import bytecode

ROOT = Path(__file__).resolve().parent.parent
HELPER = ROOT / "scripts" / "_venv.sh"


def _script_env(env: dict[str, str]) -> dict[str, str]:
    """What ``cache_bytecode_outside_checkout`` leaves in a bash environment."""
    shown = subprocess.run(
        ["bash", "-c", f'source "{HELPER}" && cache_bytecode_outside_checkout && '
         'echo "prefix=${PYTHONPYCACHEPREFIX-unset}" && '
         'echo "off=${PYTHONDONTWRITEBYTECODE-unset}"'],
        env=env, capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return dict(line.split("=", 1) for line in shown.splitlines())


def _base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONDONTWRITEBYTECODE", "PYTHONPYCACHEPREFIX")}  # fmt: skip
    env["TMPDIR"] = str(tmp_path)
    return env


def test_the_script_moves_the_cache_out_of_the_checkout_when_bytecode_is_off(
    tmp_path: Path,
) -> None:
    env = {**_base_env(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    got = _script_env(env)
    assert got == {"prefix": f"{tmp_path}/clone-tests-pycache-{os.getuid()}", "off": "unset"}
    # The same directory as the conftest side's, so one run fills one cache.
    probe = subprocess.run(
        [sys.executable, "-c", "from tests.support import bytecode; print(bytecode.enable())"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()  # fmt: skip
    assert probe == got["prefix"]


def test_the_script_keeps_a_prefix_the_environment_gives(tmp_path: Path) -> None:
    env = {**_base_env(tmp_path), "PYTHONDONTWRITEBYTECODE": "1",
           "PYTHONPYCACHEPREFIX": str(tmp_path / "mine")}  # fmt: skip
    assert _script_env(env) == {"prefix": str(tmp_path / "mine"), "off": "unset"}


def test_the_script_changes_nothing_when_bytecode_is_on(tmp_path: Path) -> None:
    assert _script_env(_base_env(tmp_path)) == {"prefix": "unset", "off": "unset"}


def test_a_process_started_with_the_cache_writes_it_under_the_prefix(tmp_path: Path) -> None:
    # A module of ours imported in a child with the script's environment: its
    # bytecode lands in the mirror tree, none beside the source.
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_mod.py").write_text("VALUE = 42\n")
    env = {**_base_env(tmp_path), "PYTHONDONTWRITEBYTECODE": "1"}
    prefix = _script_env(env)["prefix"]
    env.pop("PYTHONDONTWRITEBYTECODE")
    env["PYTHONPYCACHEPREFIX"] = prefix
    subprocess.run([sys.executable, "-c", "import probe_mod"], env=env, cwd=src,
                   timeout=60, check=True)  # fmt: skip
    assert not (src / "__pycache__").exists()
    cached = list(Path(prefix).rglob("probe_mod.*.pyc"))
    assert len(cached) == 1 and str(src).lstrip("/") in str(cached[0])


def test_enable_does_nothing_when_bytecode_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.enable() is None
