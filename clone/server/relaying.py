"""A relay: follow a pair like a client, serve its copy like a server.

How this works: a relay (``clone-server --relay --upstream A,B``) has no
Binary Star.  Its core is in the RELAY role, which follows another server
exactly as a passive server follows the active one (:mod:`.following`: a SUB
on the upstream's publisher, a snapshot or digest catch-up on a fresh DEALER),
with two differences:

* every update it applies (a KVPUB, a catch-up entry, a buffered update
  replayed after a snapshot) is *published* as received, with the pair's
  sequence, and its snapshot port serves its copy at any time; its own HUGZ
  carry its sequence and ``stale=1`` while it has lost the pair;
* it chooses its upstream like a client: it follows one server at a time and,
  when that one is silent for the missed heartbeats (once synced) or does not
  answer a snapshot request within the sync timeout (a passive server of the
  pair never does, unless the request wins it the vote), it moves on to the
  next one and resyncs from it, by a catch-up from its sequence where the
  new server's history allows, else by a full snapshot.

Client writes (KVSETs on its collector) are forwarded as they are to every
upstream collector, from one PUB, the way a client sends them: the pair
deduplicates them by uuid, and the write's KVPUB comes back through the
relay's stream, which is what confirms it to the writer.

The decisions (when an upstream counts as lost, whether the relay is stale)
are small pure functions here, tested with explicit times.
"""

from __future__ import annotations

import logging

import zmq

from clone.errors import ProtocolError
from clone.server.base import ServerBase, log
from clone.server.core import SyncState
from clone.wire.calls import Reply, call_uuid
from clone.wire.codec import Hugz, decode_update, encode_hugz
from clone.wire.frames import recv_frames
from clone.wire.protocol import COLLECTOR_OFFSET, HUGZ

__all__ = ["RelayMixin", "relay_stale", "upstream_lost"]


def upstream_lost(
    *,
    now: float,
    syncing: bool,
    sync_started: float,
    sync_timeout: float,
    heard: float,
    heartbeat: float,
    missed: int,
) -> bool:
    """Whether a relay should give up its current upstream for the next one.

    While a sync is outstanding the sync timeout decides (a server that will
    not answer is passive, or gone); once synced, silence for ``missed``
    heartbeats of the upstream's own rhythm does (the active sends HUGZ).
    """
    if syncing:
        return now - sync_started >= sync_timeout
    return now - heard >= heartbeat * missed


def relay_stale(
    *,
    now: float,
    synced_once: bool,
    heard: float,
    heartbeat: float,
    missed: int,
    upstream_stale: bool,
) -> bool:
    """Whether a relay's HUGZ should say ``stale=1``.

    Stale: it has never synced, its upstream is silent beyond the missed
    heartbeats, or its upstream is a relay that says it is stale itself.
    """
    return not synced_once or upstream_stale or now - heard >= heartbeat * missed


def _collector(host_port: str) -> str:
    host, _, port = host_port.rpartition(":")
    return f"tcp://{host}:{int(port) + COLLECTOR_OFFSET}"


class RelayMixin(ServerBase):
    """Follow an upstream with failover; forward writes; heartbeat with staleness."""

    def _start_relay(self) -> None:
        cfg = self.config
        pub = self._socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, cfg.collector_hwm)
        for host_port in cfg.upstream:
            pub.connect(_collector(host_port))
        self._upstream_pub = pub
        self._upstream_heard = self._clock()
        log.info("relay of %s: following %s", ", ".join(cfg.upstream), self._followed)
        self._sync_started = self._clock()
        self._follow()

    def _forward_call(self, identity: bytes, frames: list[bytes]) -> None:
        """A relay does not decide calls; until it forwards them, it says so."""
        uuid = call_uuid(frames)
        if uuid is not None:
            self._send_reply(
                identity,
                Reply(uuid, "refused", reason="not-active", detail="a relay does not take calls"),
            )

    def _close_relay(self) -> None:
        pub, self._upstream_pub = self._upstream_pub, None
        if pub is not None and not pub.closed:
            pub.close(linger=0)

    # -- the upstream ----------------------------------------------------------

    def _heard_upstream(self, frames: list[bytes]) -> None:
        """Any message from the followed server's publisher: it is alive."""
        self._upstream_heard = self._clock()
        if frames and frames[0] == HUGZ:
            try:
                hugz = decode_update(frames)
            except ProtocolError:
                return  # the core counts and logs it
            if isinstance(hugz, Hugz):
                if hugz.heartbeat:
                    self._upstream_heartbeat = hugz.heartbeat
                stale = hugz.stale
                if stale != self._upstream_stale:
                    self._upstream_stale = stale
                    log.warning(
                        "upstream %s says it is %s", self._followed, "stale" if stale else "fresh"
                    )

    def _relay_synced(self) -> None:
        if not self._relay_synced_once:
            self._relay_synced_once = True
        self._upstream_heard = self._clock()

    def _check_upstream(self) -> None:
        """Housekeeping: give up a silent (or unanswering) upstream for the next."""
        cfg = self.config
        now = self._clock()
        if not upstream_lost(
            now=now,
            syncing=self.core.sync_state is SyncState.SYNCING,
            sync_started=self._sync_progress,
            sync_timeout=cfg.effective_sync_timeout,
            heard=self._upstream_heard,
            heartbeat=max(self._upstream_heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
        ):
            return
        was = self._followed
        self._upstream_index = (self._upstream_index + 1) % len(cfg.upstream)
        self._followed = cfg.upstream[self._upstream_index]
        self._upstream_stale = False
        self.counters["upstream_switches"] += 1
        self._throttle.log(
            "upstream_switch",
            logging.WARNING,
            "upstream %s %s; following %s (serving our copy at sequence %d meanwhile)",
            was,
            "did not answer our snapshot request"
            if self.core.sync_state is SyncState.SYNCING
            else "is silent",
            self._followed,
            self.core.store.sequence,
        )
        self._close_peer()
        # _upstream_heard stays: until the new upstream speaks, we are stale.
        self._sync_started = now
        self._follow()

    def _relay_stale(self) -> bool:
        cfg = self.config
        return relay_stale(
            now=self._clock(),
            synced_once=self._relay_synced_once,
            heard=self._upstream_heard,
            heartbeat=max(self._upstream_heartbeat, cfg.heartbeat),
            missed=cfg.ha_missed,
            upstream_stale=self._upstream_stale,
        )

    def _relay_hugz(self) -> list[bytes]:
        return encode_hugz(self.core.store.sequence, self._heartbeat_ms, stale=self._relay_stale())

    # -- client writes -----------------------------------------------------------

    def _on_relay_collector(self, frames: list[bytes]) -> None:
        """KVSETs from our clients: forwarded as they are to the pair's collectors."""
        pub = self._upstream_pub
        sock = self._collector
        if pub is None or sock is None:
            return
        for _ in range(self.config.collector_batch):
            try:
                pub.send_multipart(frames, zmq.NOBLOCK)
                self.counters["kvset_forwarded"] += 1
            except zmq.Again:
                self.counters["kvset_forward_dropped"] += 1
            try:
                frames = recv_frames(sock)
            except zmq.Again:
                return
