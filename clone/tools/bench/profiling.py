"""``py-spy record`` on the server during a section, and a summary of where it spent its time."""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["Profiler", "summarise_profile"]

log = logging.getLogger(__name__)


class Profiler:
    """``py-spy record`` on one pid for the duration of a ``with`` block."""

    def __init__(self, out_dir: Path | None, label: str, pid: int) -> None:
        self.out_dir, self.label, self.pid = out_dir, label, pid
        self.proc: subprocess.Popen[bytes] | None = None
        self.summary: dict[str, Any] | None = None
        self.path: Path | None = None

    def __enter__(self) -> Profiler:
        exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        if self.out_dir is None:
            return self
        if not Path(exe).exists():
            log.warning("py-spy not found: pip install py-spy; not profiling %s", self.label)
            return self
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / f"{self.label}.txt"
        argv = [exe, "record", "--pid", str(self.pid), "--format", "raw", "--rate", "250"]
        argv += ["--nonblocking", "-o", str(self.path)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)  # let it attach before the clock starts
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.path is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        if self.path.exists():
            self.summary = summarise_profile(self.path)


def summarise_profile(path: Path, top: int = 15) -> dict[str, Any]:
    """Top functions by self and by total samples from a py-spy ``raw`` file."""
    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    samples = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, n_text = line.rpartition(" ")
        if not stack or not n_text.isdigit():
            continue
        n = int(n_text)
        frames = [_short_frame(f) for f in stack.split(";")[1:]]  # [0] is the process
        if not frames:
            continue
        samples += n
        self_c[frames[-1]] += n
        for f in set(frames):
            total_c[f] += n
    if not samples:
        return {"samples": 0, "self": [], "total": []}

    def pct(c: Counter[str]) -> list[list[Any]]:
        return [[f, round(100.0 * k / samples, 1)] for f, k in c.most_common(top)]

    return {"file": str(path), "samples": samples, "self": pct(self_c), "total": pct(total_c)}


def _short_frame(frame: str) -> str:
    """'handle (/x/clone/server/reactor.py:120)' -> 'handle (server/reactor.py)'."""
    name, _, where = frame.partition(" (")
    filename = where.rsplit(":", 1)[0].rstrip(")")
    parts = filename.replace("\\", "/").split("/")
    tail = "/".join(parts[-2:])
    return f"{name} ({tail})" if where else name
