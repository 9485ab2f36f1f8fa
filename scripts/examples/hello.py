"""Hello, Clone: the client API in one runnable page.

Run it against a server pair (or one standalone server)::

    clone-server --standalone --port 5556 &
    CLONE_SERVERS=tcp://127.0.0.1:5556 python scripts/examples/hello.py

tests/test_cli.py runs it too, so it stays correct.
"""

from __future__ import annotations

import os
import threading

from clone import Clone, clone_get, clone_set

servers = os.environ.get("CLONE_SERVERS", "tcp://127.0.0.1:5556,tcp://127.0.0.1:5566")

# One client: an agent thread keeps a replica of the /hello/ subtree in sync.
with Clone(servers, subtree="/hello/") as client:
    client.wait_synced(timeout=10)

    # Be told about changes (the callback runs in the client's callback thread).
    seen = threading.Event()
    client.on_change(lambda entry: seen.set() if entry.key == "/hello/world" else None)

    # A confirmed write: returns once the active server has republished it,
    # so the read that follows sees it.
    client.set("/hello/world", "Hello, World!", wait=True)
    print(client.get("/hello/world").decode())  # Hello, World!

    # An ephemeral key: the server deletes it after 60 s.
    client.set("/hello/session", b"\x00\x01", ttl=60, wait=True)

    # Everything under a prefix, sorted by key.
    for key, value in client.items("/hello/"):
        print(f"{key} = {value!r}")

    seen.wait(5)
    status = client.status()
    print(f"{status.state} on {status.server}, sequence {status.sequence}")

    client.delete("/hello/session", wait=True)
    assert client.get("/hello/session") is None

# The module-level helpers use one default client configured by $CLONE_SERVERS.
clone_set("/hello/simple", "yes")
print(clone_get("/hello/simple"))  # b'yes'
