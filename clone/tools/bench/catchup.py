"""The resync's catch-up case: the update every client holds before the kill.

A client that followed the old active holds the state up to its last update.
After a failover our client asks for what it missed (``X-CHP-Since``, the last
update's sequence and digest: :mod:`clone.wire.delta`) and gets a KVDELTA when
the history of the server it asks (the new active, or its relay) reaches back
to that update.  The subscribers section's catch-up mode models that: the
driver writes one update before the kill, waits until the pair's publisher
has published it and every server the requesters will ask (the backup, the
relays) holds it (their STATUS sequence), and gives every requester that
update's ``X-CHP-Since``.  The full mode is the worst case instead: every
client takes a full snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import zmq

from clone.client.status import query_status
from clone.tools.bench.processes import SNAP_SUBTREE, kvset
from clone.wire.delta import since_metadata, update_digest
from clone.wire.frames import cap_message_size, recv_frames
from clone.wire.protocol import COLLECTOR_OFFSET, HUGZ, PUBLISHER_OFFSET

__all__ = ["RESYNC_MODES", "RESYNC_RUNS", "before_kill"]

#: How the resync's clients ask after the failover: a full snapshot each (the
#: worst case), or a catch-up from the last update they held.
RESYNC_MODES = ("full", "catchup")
#: The resync runs' names in the subscribers section's results.
RESYNC_RUNS = ("resync", "resync_direct", "resync_catchup", "resync_direct_catchup")

#: The key of the update written before the kill (outside the marker's prefix,
#: which the requesters watch for).
_BEFORE = (SNAP_SUBTREE + "before-the-kill").encode()


def before_kill(ctx: zmq.Context[Any], active_port: int, holder_ports: Sequence[int],
                timeout: float = 30) -> tuple[int, bytes]:
    """Write one update to the active at base ``active_port``; once it is
    published and every server at ``holder_ports`` holds it, its sequence and
    the ``X-CHP-Since`` metadata a client holding it would send."""
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, _BEFORE)
    sub.setsockopt(zmq.SUBSCRIBE, HUGZ)
    cap_message_size(sub)
    pub.connect(f"tcp://127.0.0.1:{active_port + COLLECTOR_OFFSET}")
    sub.connect(f"tcp://127.0.0.1:{active_port + PUBLISHER_OFFSET}")
    msg = kvset(_BEFORE, b"before the failover", 1 << 41)  # one uuid: one update
    deadline = time.monotonic() + timeout
    try:
        # A resend of one uuid is not published again: send only once a HUGZ
        # says our subscription is in place.
        attached = False
        frames: list[bytes] | None = None
        while frames is None:
            if time.monotonic() > deadline:
                raise TimeoutError("the update before the kill was not published")
            if attached:
                pub.send_multipart(msg)
            if sub.poll(50):
                got = recv_frames(sub)
                if got[0] == HUGZ:
                    attached = True
                else:
                    frames = got
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
    seq = int.from_bytes(frames[1], "big")
    endpoints = [f"tcp://127.0.0.1:{port}" for port in holder_ports]
    while True:
        seqs = [s.get("sequence") or 0 for s in query_status(endpoints, 2.0, ctx=ctx)]
        if all(s >= seq for s in seqs):
            return seq, since_metadata(seq, update_digest(frames))
        if time.monotonic() > deadline:
            raise TimeoutError(f"servers at {list(holder_ports)} hold {seqs}, not {seq}")
        time.sleep(0.05)
