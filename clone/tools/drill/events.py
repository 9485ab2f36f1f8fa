"""The clients' event files: followed while the drill runs, read whole at its end."""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["EventTail", "read_events"]


class EventTail:
    """Reads new complete lines from the clients' event files and counts events."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.offsets: dict[Path, int] = {}
        self.counts: Counter[str] = Counter()

    def poll(self) -> None:
        for path in sorted(self.directory.glob("*.jsonl")):
            off = self.offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(off)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self.offsets[path] = off + end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.counts[json.loads(line)["event"]] += 1


def read_events(path: Path) -> list[dict[str, Any]]:
    """A client's events; a line cut short by kill -9 is skipped."""
    out: list[dict[str, Any]] = []
    if not path.exists():
        return out
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out
