"""The calls section's lease driver: a process that grants leases and keeps
them alive with raw calls on a schedule (:func:`lease_main`; the section:
:mod:`clone.tools.bench.calls`)."""

from __future__ import annotations

import collections
import os
import time
from multiprocessing.synchronize import Event as MpEvent
from typing import Any

import zmq

from clone.tools.histogram import LatencyHistogram
from clone.wire.calls import (
    LEASE_PROPERTY,
    MAX_KEEPALIVES_PER_CALL,
    OP_LEASE_GRANT,
    OP_LEASE_KEEPALIVE,
    OP_LEASE_KEEPALIVES,
    SECRET_PROPERTY,
    decode_reply,
    encode_call,
    encode_keepalives,
)
from clone.wire.codec import new_uuid
from clone.wire.frames import cap_message_size
from clone.wire.protocol import TTL_PROPERTY

__all__ = ["DRAIN_S", "lease_main", "open_dealer"]

#: After ``stop``, how long a lease driver waits at most for the replies still
#: on their way (a starved host held some for seconds): only a keepalive never
#: answered counts as unanswered.  Bounds a hang only: it ends with the last reply.
DRAIN_S = 10.0


def open_dealer(ctx: zmq.Context[Any], endpoint: str) -> zmq.Socket[Any]:
    sock: zmq.Socket[Any] = ctx.socket(zmq.DEALER)
    sock.sndhwm = sock.rcvhwm = 0
    sock.linger = 0
    cap_message_size(sock)
    sock.connect(endpoint)
    return sock


def lease_main(snapshot_ep: str, leases: int, ttl: float, keepalive: bool, window: int,
               ready: MpEvent, stop: MpEvent, results: Any, batched: bool = False) -> None:
    """Grant ``leases`` leases (``window`` grants in flight), keep each alive every ttl/3
    (if ``keepalive``) until ``stop``; report the replies, the lag behind the schedule,
    the reply latency.

    ``batched``: as the client agent does (clone.client.calls), one
    ``lease-keepalives`` call for every lease due and every lease due within
    half an interval, instead of a ``lease-keepalive`` each; once all are
    granted they are kept in step (one call per interval for all of them)."""
    ctx: zmq.Context[Any] = zmq.Context()
    dealer = open_dealer(ctx, snapshot_ep)
    interval = ttl / 3
    # One owner for all the driver's leases (docs/protocol.md, "Lease ownership").
    secret = os.urandom(16).hex()
    grant_props = ((TTL_PROPERTY, repr(float(ttl))), (SECRET_PROPERTY, secret))
    pending: dict[bytes, tuple[bool, float]] = {}  # uuid -> (is a keepalive, sent)
    half = interval / 2
    due: collections.deque[tuple[float, str]] = collections.deque()
    statuses: collections.Counter[str] = collections.Counter()
    lag, ka_lat = LatencyHistogram(), LatencyHistogram()
    granted = asked = keepalives = 0
    mono = time.monotonic
    t0 = mono()
    t_granted = t_steady = 0.0
    k_steady = 0
    try:
        while not stop.is_set():
            now = mono()
            while asked < leases and len(pending) < window:
                u = new_uuid()
                dealer.send_multipart(encode_call(OP_LEASE_GRANT, u, properties=grant_props))
                pending[u] = (False, now)
                asked += 1
            if batched and due and due[0][0] <= now:
                group = []
                while due and due[0][0] <= now + half:
                    group.append(due.popleft())
                for at in range(0, len(group), MAX_KEEPALIVES_PER_CALL):
                    u = new_uuid()
                    chunk = group[at:at + MAX_KEEPALIVES_PER_CALL]
                    dealer.send_multipart(encode_call(
                        OP_LEASE_KEEPALIVES, u,
                        body=encode_keepalives([(lease, secret) for _, lease in chunk])))
                    pending[u] = (True, now)
                for t_due, lease in group:
                    if t_granted and t_due <= now:
                        lag.record_seconds(now - t_due)
                    due.append((now + interval, lease))
                keepalives += len(group)
            while due and due[0][0] <= now:
                t_due, lease = due.popleft()
                u = new_uuid()
                dealer.send_multipart(
                    encode_call(OP_LEASE_KEEPALIVE, u,
                                properties=((LEASE_PROPERTY, lease), (SECRET_PROPERTY, secret))))
                pending[u] = (True, now)
                if t_granted:
                    lag.record_seconds(now - t_due)
                keepalives += 1
                due.append((t_due + interval, lease))
            wait = min(0.01, max(0.0, due[0][0] - mono())) if due else 0.01
            if not dealer.poll(int(wait * 1000)):
                continue
            while True:
                try:
                    reply = decode_reply(dealer.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                now = mono()
                is_ka, sent = pending.pop(reply.uuid, (True, now))
                if not is_ka:
                    if not reply.ok:
                        raise RuntimeError(f"lease-grant refused: {reply.reason} {reply.detail}")
                    if keepalive:
                        due.append((sent + interval, reply.lease))
                    granted += 1
                    if granted == leases:
                        # From now on spread evenly over ttl/3, most urgent first: the
                        # grants came in bursts, and keepalives in bursts would measure
                        # the bursts (each holds the server's loop for milliseconds).
                        # Batched, all of them in step: one call per interval.
                        t_granted, step = now, interval / leases
                        due = collections.deque(
                            (now if batched else now + j * step, lid)
                            for j, (_, lid) in enumerate(sorted(due)))
                        ready.set()
                    continue
                if reply.kept is not None:  # a lease-keepalives: each lease counts
                    statuses["ok"] += reply.kept
                    for _, why in reply.gone:
                        statuses[why] += 1
                else:
                    statuses[reply.status if reply.status != "refused" else reply.reason] += 1
                ka_lat.record_seconds(now - sent)
                if not t_steady and t_granted and now - t_granted >= interval:
                    t_steady, k_steady = now, keepalives
        t_end = mono()
        rate = ((keepalives - k_steady) / (t_end - t_steady)
                if t_steady and t_end > t_steady else 0.0)
        while pending and mono() < t_end + DRAIN_S:
            if not dealer.poll(100):
                continue
            while True:
                try:
                    reply = decode_reply(dealer.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                is_ka, sent = pending.pop(reply.uuid, (False, 0.0))
                if not is_ka:
                    continue
                if reply.kept is not None:
                    statuses["ok"] += reply.kept
                    for _, why in reply.gone:
                        statuses[why] += 1
                else:
                    statuses[reply.status if reply.status != "refused" else reply.reason] += 1
                ka_lat.record_seconds(mono() - sent)
        results.put({
            "granted": granted,
            "grant_s": round(t_granted - t0, 3) if t_granted else None,
            "keepalives": keepalives,
            "keepalives_per_s": round(rate),
            "statuses": dict(statuses),
            "unanswered": len(pending),
            "lag": lag.encode(),
            "reply": ka_lat.encode(),
        })
    finally:
        dealer.close(linger=0)
        ctx.term()


# --------------------------------------------------------------------------
# The parts
