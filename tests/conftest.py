"""Fixtures every test directory may use.

``servers`` (real ``clone-server`` processes, tests/support/servers.py) and
``spark`` (the one local SparkSession of the run, tests/support/spark_session.py)
and ``ctx`` (a zmq context of the test's own, tests/support/zmq_context.py)
and Clone's own ``clone_server``/``fake_clone`` (:mod:`clone.testing`, as a
user enables them) are registered here as plugins, so a test takes them as arguments without
importing them.  Helpers that are not fixtures (``eventually``, the fake
server, the raw CHP peer) are imported from :mod:`tests.support`.
"""

pytest_plugins = [
    "tests.support.servers",
    "tests.support.spark_session",
    "tests.support.zmq_context",
    # What a user of the library enables: clone_server and fake_clone.
    "clone.testing.pytest_plugin",
]
