"""From the ``clone-server`` command's parsed flags to a :class:`ServerConfig`.

Why a module of its own: :mod:`clone.server.cli` holds the parser (every
flag, its help and its layers) and ``main``; this is the one place that reads
the flags as a whole: the Guide's default ports per role, the memory budget's
default ``--max-bytes``, and the combinations refused (a relay's flags on a
pair member, a data directory on a relay, ``--restore`` in memory).  Raises
``ValueError`` with the flag to fix; ``main`` reports it as a usage error.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from clone.server.budget import STORE_FRACTION, default_max_bytes, read_memory_limit
from clone.server.config import ServerConfig, ServerMode
from clone.server.core import CoreSettings
from clone.wire.protocol import (
    DEFAULT_BACKUP_HA_PORT,
    DEFAULT_BACKUP_PORT,
    DEFAULT_PRIMARY_HA_PORT,
    DEFAULT_PRIMARY_PORT,
)

__all__ = ["config_from_args"]

log = logging.getLogger("clone.server.cli")


def _max_bytes(given: int | None) -> int:
    """``--max-bytes`` as given, else the memory budget's default (clone.server.budget)."""
    if given is not None:
        return given
    limit = read_memory_limit()
    chosen = default_max_bytes(limit)
    log.info("--max-bytes defaults to %d: %d%% of %s",
             chosen, round(STORE_FRACTION * 100),
             f"{limit.nbytes} bytes ({limit.source})" if limit else "nothing known (4 GiB)")
    return chosen


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """Turn parsed flags into a config, filling in the Guide's example defaults."""
    core = CoreSettings(
        dedup_window=args.dedup_window,
        pending_max=args.pending_max,
        pending_max_age=args.pending_max_age,
        pending_max_bytes=args.pending_max_bytes,
        history_max=args.history,
        history_bytes=args.history_bytes,
        max_keys=args.max_keys,
        max_bytes=_max_bytes(args.max_bytes),
        max_leases=args.max_leases,
        max_leases_per_client=args.max_leases_per_client,
        max_conflict_bytes=args.max_conflict_bytes,
    )
    common = dict(
        bind=args.bind,
        heartbeat=args.heartbeat / 1000.0,
        ha_missed=args.missed,
        pub_hwm=args.hwm,
        collector_hwm=args.hwm,
        snapshot_hwm=args.snapshot_hwm,
        snapshot_chunk=args.snapshot_chunk,
        stats_interval=args.stats_interval,
        core=core,
        fsync=args.fsync,
        peer_wait=args.peer_wait,
        restore=args.restore,
        curve_secret=args.curve_secret,
        clients_dir=args.clients,
        acl=args.acl,
        trusted_relays=frozenset(args.trusted_relay),
        max_snapshots=args.max_snapshots,
        snapshot_bytes=args.snapshot_bytes,
        snapshot_stall_timeout=args.snapshot_stall_timeout,
        handover_timeout=args.handover_timeout,
        snapshot_slot_idle=args.snapshot_slot_idle,
        handshake_timeout=args.handshake_timeout,
        collector_bytes=args.collector_bytes,
        max_subscriptions=args.max_subscriptions,
        max_subscription_bytes=args.max_subscription_bytes,
        max_subscriber_bytes=args.max_subscriber_bytes,
        http_port=args.http_port,
        http_idle_timeout=args.http_idle_timeout,
        http_max_connections=args.http_max_connections,
        http_viewers=args.http_viewers,
    )
    if args.upstream and not args.relay:
        raise ValueError("--upstream is for a relay (--relay) only")
    if (args.upstream_curve_secret or args.upstream_server_key) and not args.relay:
        raise ValueError(
            "--upstream-curve-secret and --upstream-server-key are for a relay (--relay) only"
        )
    if args.relay:
        return _relay_config(args, common)
    role = "standalone" if args.standalone else "primary" if args.primary else "backup"
    if args.in_memory:
        if args.restore:
            raise ValueError("--restore needs a data directory; it cannot go with --in-memory")
        data_dir = None
    else:
        data_dir = args.data_dir or f"{role}.clone"
    common["data_dir"] = data_dir
    if args.standalone:
        return ServerConfig(
            port=DEFAULT_PRIMARY_PORT if args.port is None else args.port,
            mode=ServerMode.STANDALONE,
            **common,
        )
    if args.primary:
        mode = ServerMode.PRIMARY
        port, ha_port = DEFAULT_PRIMARY_PORT, DEFAULT_PRIMARY_HA_PORT
        peer, peer_ha = DEFAULT_BACKUP_PORT, DEFAULT_BACKUP_HA_PORT
    else:
        mode = ServerMode.BACKUP
        port, ha_port = DEFAULT_BACKUP_PORT, DEFAULT_BACKUP_HA_PORT
        peer, peer_ha = DEFAULT_PRIMARY_PORT, DEFAULT_PRIMARY_HA_PORT
    return ServerConfig(
        port=port if args.port is None else args.port,
        mode=mode,
        peer=args.peer or f"localhost:{peer}",
        ha_port=ha_port if args.ha_port is None else args.ha_port,
        peer_ha=args.peer_ha or f"localhost:{peer_ha}",
        **common,
    )


def _relay_config(args: argparse.Namespace, common: dict[str, Any]) -> ServerConfig:
    """A relay: in memory, no Binary Star peer (docs/operations.md, "Relays")."""
    if not args.upstream:
        raise ValueError("--relay needs --upstream HOST:PORT[,HOST:PORT] (the pair's base ports)")
    if args.data_dir or args.restore:
        raise ValueError("a relay keeps its copy in memory: no --data-dir or --restore")
    for flag in ("peer", "ha_port", "peer_ha"):
        if getattr(args, flag) is not None:
            name = flag.replace("_", "-")
            raise ValueError(f"a relay has no Binary Star peer: --{name} is not for it")
    return ServerConfig(
        port=DEFAULT_PRIMARY_PORT if args.port is None else args.port,
        mode=ServerMode.RELAY,
        upstream=args.upstream,
        upstream_curve_secret=args.upstream_curve_secret,
        upstream_server_key=args.upstream_server_key,
        **common,
    )
