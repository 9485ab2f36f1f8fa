"""``python -m clone.tools.chaos.check DIR``: judge a saved chaos history again.

Reads ``DIR/history.jsonl``, rewrites ``DIR/verdict.json``, ``verdict.md`` and
``timeline.png``, prints the Markdown verdict; exits 1 if a check failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from clone.tools.chaos.report import judge_dir

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m clone.tools.chaos.check")
    p.add_argument("dir", type=Path, help="a chaos run's output directory")
    p.add_argument("--no-picture", action="store_true", help="skip timeline.png")
    args = p.parse_args(argv)
    if not (args.dir / "history.jsonl").is_file():
        print(f"check: no history.jsonl in {args.dir}", file=sys.stderr)
        return 2
    verdict = judge_dir(args.dir, picture=not args.no_picture)
    sys.stdout.write((args.dir / "verdict.md").read_text())
    return 0 if verdict["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
