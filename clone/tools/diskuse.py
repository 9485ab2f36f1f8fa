"""``python -m clone.tools.diskuse``: how much disk a data directory takes for its data.

Starts one standalone ``clone-server`` on a fresh data directory, writes
``--mb`` megabytes as ``--value-kb`` values with confirmed writes (``--rounds``
times over the same keys, so old versions become history and free pages),
waits for the server's checkpoint thread, and prints the data directory's size
while it runs and after SIGTERM, against the logical size of the data
(docs/benchmarks.md, "Disk").
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from clone import Clone
from clone.storage.files import dir_bytes
from clone.tools.procs import (
    ProcessGroup,
    ServerAddress,
    free_base_port,
    server_argv,
    wait_listening,
)

__all__ = ["main"]

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m clone.tools.diskuse", description=__doc__)
    p.add_argument("--mb", type=int, default=660, help="megabytes of data (default 660)")
    p.add_argument("--value-kb", type=int, default=512, help="value size in KiB (default 512)")
    p.add_argument("--rounds", type=int, default=2,
                   help="times every key is written (default 2: one overwrite each)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="seconds to let the checkpoint thread run before measuring (default 5)")
    p.add_argument("--dir", type=Path, default=None, help="where to put the data directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    value = os.urandom(args.value_kb * 1024)
    keys = max(1, args.mb * 1024 * 1024 // len(value))
    base = Path(args.dir or tempfile.mkdtemp(prefix="clone-diskuse-"))
    data = base / "data"
    me = ServerAddress("disk", free_base_port())
    with ProcessGroup(base / "logs") as group:
        server = group.add("server", server_argv(
            "standalone", me, data_dir=data, extra=["--max-bytes", "0"]))
        if not wait_listening(me.port, time.monotonic() + 60):
            raise SystemExit(f"the server did not listen; see {server.log_path}")
        started = time.monotonic()
        with Clone(me.endpoint, confirm_timeout=60) as client:
            client.wait_synced(30)
            for r in range(args.rounds):
                for i in range(keys):
                    client.set(f"/disk/{i:06d}", value[r:] + value[:r], wait=True)
        wrote = time.monotonic() - started
        logical = keys * (len(value) + len(f"/disk/{0:06d}"))
        time.sleep(args.settle)
        running = dir_bytes(data)
        server.signal(15)
        server.wait(30)
    stopped = dir_bytes(data)
    print(f"keys {keys} x {len(value)} B, {args.rounds} rounds, written in {wrote:.1f} s")
    print(f"logical data            {logical / 1e6:10.1f} MB")
    print(f"data dir while running  {running / 1e6:10.1f} MB  ({running / logical:.2f}x)")
    print(f"data dir after SIGTERM  {stopped / 1e6:10.1f} MB  ({stopped / logical:.2f}x)")
    for f in sorted(data.iterdir()):
        print(f"  {f.name:20s} {f.stat().st_blocks * 512 / 1e6:10.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
