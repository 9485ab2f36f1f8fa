"""Fixtures every test directory may use.

``servers`` (real ``clone-server`` processes, tests/support/servers.py) and
``spark`` (the local SparkSession of the process, tests/support/spark_session.py)
and ``ctx`` (a zmq context of the test's own, tests/support/zmq_context.py)
and Clone's own ``clone_server``/``fake_clone`` (:mod:`clone.testing`, as a
user enables them) are registered here as plugins, so a test takes them as arguments without
importing them.  Helpers that are not fixtures (``eventually``, the fake
server, the raw CHP peer) are imported from :mod:`tests.support`.

``slow`` and ``spark`` are not only written by hand: tests/support/markers.py
gives them to every test that uses a real process or Spark (through its own
code or any fixture), and fails a test that is neither but starts a process.
"""

from tests.support import bytecode

# Before any module of ours is imported and any process started: with
# PYTHONDONTWRITEBYTECODE set, a bytecode cache outside the checkout instead of
# none (tests/support/bytecode.py; the suite's time on a loaded machine).
bytecode.enable()

# Each xdist worker draws free ports from a range of its own (tests/support/ports.py).
from tests.support.ports import claim_worker_port_range  # noqa: E402

claim_worker_port_range()

pytest_plugins = [
    "tests.support.servers",
    "tests.support.spark_session",
    "tests.support.zmq_context",
    # What a user of the library enables: clone_server and fake_clone.
    "clone.testing.pytest_plugin",
    # --- markers: slow/spark given by code, the quick set's no-process guard,
    # timeouts per marker (see tests/support/markers.py) ---
    "tests.support.markers",
    # --- the order xdist hands the tests out in: the long kinds first ---
    "tests.support.ordering",
    # --- SIGINT/SIGTERM deliverable in every child a test starts ---
    "tests.support.signals",
    # --- --cpu-report: CPU per test and per file (off unless asked) ---
    "tests.support.cpu_report",
]

# --- hypothesis on a busy machine: no per-example deadline and no
# "input generation is slow" health check; a loaded machine made both fail
# tests whose properties held (tests/wire/test_status.py::test_round_trip).
# A test's own @settings still wins for what it sets. ---
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("clone", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("clone")
