"""The README's run command: scripts/run starts a local primary+backup pair.

It uses the Guide's fixed ports (5556/5566, Binary Star 5003/5004), so the test
skips when something else holds them rather than fight over them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clone import Clone
from tests.ports import port_is_free

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PORTS = (5556, 5557, 5558, 5566, 5567, 5568, 5003, 5004)


@pytest.mark.timeout(120)
def test_run_starts_a_pair_that_serves_and_stops_on_sigterm(tmp_path: Path) -> None:
    busy = [p for p in PORTS if not port_is_free(p)]
    if busy:
        pytest.skip(f"the default ports {busy} are in use on this machine")
    env = dict(os.environ, CLONE_VENV=str(Path(sys.executable).parent.parent))
    log = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen(
        [str(ROOT / "scripts" / "run"), "--bind", "127.0.0.1", "--heartbeat", "200"],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        with Clone(["tcp://127.0.0.1:5556", "tcp://127.0.0.1:5566"], heartbeat=0.2) as client:
            while True:
                try:
                    client.wait_synced(1)
                    break
                except Exception:
                    assert proc.poll() is None, (tmp_path / "run.log").read_text()
                    assert time.monotonic() < deadline, "the pair never served"
            client.set("/run/check", b"ok", wait=True, timeout=10)
            assert client.get("/run/check") == b"ok"
            assert client.status().server == "tcp://127.0.0.1:5556"  # the primary serves
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) is not None
        text = (tmp_path / "run.log").read_text()
        assert text.count("server stopped") == 2, text
        assert "now ACTIVE" in text and "now PASSIVE" in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
