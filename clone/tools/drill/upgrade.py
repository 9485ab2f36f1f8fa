"""``--upgrade-from REF``: an older release in a virtual environment of its own.

How this works: the pair of a rolling-restart drill starts on the code of REF
(a git ref of this repository, or a wheel file) and each restart brings a server
onto the code that runs the drill.  :func:`prepare_release` builds REF once:
``git archive REF`` into a tarball, a fresh ``python -m venv``, and ``pip
install`` of the tarball (its dependencies come from pip's configured index and
its cache), all under ``CACHE/<commit sha>/``; a ``ready`` file written last
marks a finished build, so the next run with the same commit reuses it (a few
milliseconds instead of ~15 s) and an interrupted build is started again.  A
lock file keeps two drills from building the same commit at once.

The old servers run the environment's own ``clone-server`` with ``PYTHONPATH``
removed from their environment: a checkout first on the path (as the drills
and tests run the new code) would otherwise shadow the installed old code.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from clone.tools.drill.config import Say

__all__ = [
    "ReleaseEnv",
    "UpgradeError",
    "default_cache",
    "new_server_env",
    "old_server_env",
    "prepare_release",
]

log = logging.getLogger(__name__)

#: The distribution name in setup.cfg (what ``pip`` installs and reports).
_DISTRIBUTION = "clone-kv"


class UpgradeError(RuntimeError):
    """The older release could not be prepared: the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class ReleaseEnv:
    """A ready environment of an older release."""

    ref: str
    #: The commit sha (git) or the wheel's sha256: the cache key.
    key: str
    venv: Path
    #: Its ``clone-server`` executable.
    server: Path
    #: What its installed metadata says (setup.cfg's version at REF).
    version: str
    #: Seconds spent building (0 when the cache had it).
    build_s: float
    cached: bool

    def summary(self) -> dict[str, object]:
        return {"ref": self.ref, "key": self.key, "venv": str(self.venv),
                "version": self.version, "build_s": self.build_s, "cached": self.cached}


def default_cache() -> Path:
    """``$CLONE_RELEASE_CACHE``, else ``$XDG_CACHE_HOME/clone/releases`` (~/.cache/...)."""
    env = os.environ.get("CLONE_RELEASE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "clone" / "releases"


def old_server_env() -> dict[str, str]:
    """The environment of an old-release server: ours without ``PYTHONPATH``."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def new_server_env() -> dict[str, str]:
    """The environment of a server on this code: this checkout first on
    ``PYTHONPATH``, so that the code running the drill is the code it upgrades
    to, whatever else the interpreter's environment has installed."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def repo_root() -> Path:
    """The checkout this code runs from (where REF is looked up)."""
    return Path(__file__).resolve().parents[3]


def prepare_release(ref: str, cache: Path, say: Say, *, repo: Path | None = None) -> ReleaseEnv:
    """An environment with release ``ref`` installed, built or taken from ``cache``."""
    source = Path(ref)
    if ref.endswith(".whl"):
        if not source.is_file():
            raise UpgradeError(f"--upgrade-from {ref}: no such wheel file")
        key = "wheel-" + hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    else:
        key = _commit(ref, repo or repo_root())
    home = cache / key
    venv = home / "venv"
    ready = home / "ready"
    started = time.monotonic()
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / "lock"):
        if ready.exists():
            info = json.loads(ready.read_text())
            # Read again, not trusted: a build before 2026-11-27 could record
            # the checkout's version instead of the release's (see
            # _installed_version), and a drill judged by it fails.
            version = _installed_version(venv, home)
            if version != info.get("version"):
                info["version"] = version
                ready.write_text(json.dumps(info) + "\n")
            env = ReleaseEnv(ref, key, venv, _server(venv), version, 0.0, True)
            say(f"upgrade from {ref} ({key[:12]}): release {env.version}, cached in {venv}")
            return env
        say(f"upgrade from {ref} ({key[:12]}): building its environment in {venv}")
        shutil.rmtree(venv, ignore_errors=True)
        target = source.resolve() if ref.endswith(".whl") else _archive(key, repo or repo_root(),
                                                                       home)
        _run([_base_python(), "-m", "venv", str(venv)], "creating the virtual environment")
        _run([str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
              "--disable-pip-version-check", str(target)],
             f"installing {ref} (pip needs its index or cache for the dependencies)", cwd=home)
        version = _installed_version(venv, home)
        server = _server(venv)
        build_s = round(time.monotonic() - started, 1)
        ready.write_text(json.dumps({"ref": ref, "version": version, "build_s": build_s}) + "\n")
    say(f"upgrade from {ref}: release {version} built in {build_s} s")
    return ReleaseEnv(ref, key, venv, server, version, build_s, False)


def _installed_version(venv: Path, home: Path) -> str:
    """The release's version as its own environment has it installed.

    Isolated (``-I``) and run from the cache, not from our working directory:
    ``python -c`` puts the working directory first on ``sys.path``, and run
    from a checkout with an editable install (its ``clone_kv.egg-info``)
    ``importlib.metadata`` answered the checkout's version, not the release's.
    """
    code = f"from importlib.metadata import version; print(version({_DISTRIBUTION!r}))"
    return _run([str(venv / "bin" / "python"), "-I", "-c", code],
                "reading the installed version", cwd=home).strip()


def _commit(ref: str, repo: Path) -> str:
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                             capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpgradeError(f"--upgrade-from {ref}: cannot run git in {repo}: {exc}") from exc
    if out.returncode != 0:
        raise UpgradeError(f"--upgrade-from {ref}: not a commit of {repo} "
                           f"({out.stderr.strip() or 'git rev-parse failed'}); give a tag, "
                           "branch or sha of this repository, or a wheel file")
    return out.stdout.strip()


def _archive(sha: str, repo: Path, home: Path) -> Path:
    tarball = home / f"clone-{sha[:12]}.tar.gz"
    if not tarball.exists():
        tmp = tarball.with_name(tarball.name + ".tmp")
        _run(["git", "-C", str(repo), "archive", "--format=tar.gz",
              f"--prefix=clone-{sha[:12]}/", "-o", str(tmp), sha], f"git archive {sha[:12]}")
        tmp.replace(tarball)
    return tarball


def _base_python() -> str:
    """The interpreter our own environment was made from (a venv's python makes a
    nested venv that still sees nothing of ours; the base one is plainer)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _server(venv: Path) -> Path:
    server = venv / "bin" / "clone-server"
    if not server.exists():
        raise UpgradeError(f"{venv} has no clone-server: is it a Clone release?")
    return server


def _run(argv: list[str], doing: str, cwd: Path | None = None) -> str:
    log.debug("running %s", argv)
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False,
                             cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UpgradeError(f"{doing} failed: {exc}") from exc
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-5:]
        raise UpgradeError(f"{doing} failed (exit {out.returncode}): " + " | ".join(tail))
    return out.stdout


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
