"""The subscribers section: thousands of subscribers, directly and through relays.

This module is the driver; the processes it starts (the writer, the sinks, the
resync requesters) are :mod:`.subscriberprocs`.

How this works.  **Fan-out** runs, one per (subscriber count, topology):

* a standalone ``clone-server --in-memory``; ``direct``: every subscriber on its
  publisher; ``relays``: ``sub_relays`` relays (``clone-server --relay``)
  follow it and the subscribers are spread over the relays round-robin;
* the subscribers live in ``sub_processes`` *sink processes* (spawned), each
  holding hundreds to thousands of subscribers.  Most are **C-level sinks**:
  one SUB socket holds ``sub_per_socket`` subscribers (each its own TCP
  connection, from a source address of its own, so the server has a
  connection and a pipe per subscriber, as with separate clients), drained by
  ``zmq.proxy_steerable(SUB, PUB to nowhere, control=PAIR)`` in a thread, so
  libzmq receives every update with no Python in the loop (a thread per
  subscriber cost more CPU than the server: a thread wake-up per update).
  After the run the process asks each proxy for its ``STATISTICS`` (frames
  received): each connection delivers an update at most once, so a sink that
  received ``held x sent`` lost nothing on any of its subscribers, and the lost
  updates are counted exactly.  A Python receive loop for all of them could
  not keep up (1,000 subscribers at 1k updates/s are a million messages a
  second on two cores) and would measure itself.  ``sub_probes`` subscribers
  per process, spread over its
  order (and over the relays), are **probes**: Python SUBs polled in the main
  thread that record each update's ``arrival - intended send time`` in an HDR
  histogram (one per probe: its p99; and merged).  Latency percentiles are
  therefore those of the probes, a sample of the subscribers sharing the
  same server (or relay) and the same sink processes; counts are every one's;
* a writer process sends ``sub_rate`` updates/s for ``rate_seconds`` on a
  schedule, each body starting with its intended send time (as the latency
  section does: no coordinated omission).  Subscribers subscribe to the
  latency prefix only (probes to the warm-up key too), so the warm-up that
  precedes the schedule is counted by nobody but the probes;
* the server's (and relays') CPU seconds (psutil ``cpu_times``) over the
  measured window, and their RSS at its end.

Every process raises its ``RLIMIT_NOFILE`` soft limit to the hard limit (a
sink holds four sockets and an eventfd or a TCP connection each per
subscriber), and each sink process's zmq context its ``MAX_SOCKETS``.

**Resync after a failover**: a pair (in memory) holding ``resync_keys`` keys
under ``/bench/snap/``, ``sub_relays`` relays following it, and
``resync_clients`` raw CHP requesters (DEALERs asking for our KVBATCH
snapshots and naming themselves, as our client does) spread over the relays,
in a few processes.
The active server is killed (-9); the driver writes one marker key into the
pair (resent, with one uuid, until the new active publishes it).  Each
requester process watches its relays' publishers for the marker; the moment
a relay delivers it (the relay has switched to the new active and follows its
stream) its requesters send ICANHAZ? and count entries until KTHXBAI.  The
resync time is from the kill until the last of them holds a complete snapshot
(every key and the marker).  That is the worst case, as if every client
resynced from its relay after the failover; a relay whose catch-up kept its
sequence needs no client to resync at all.  The relays get ``--max-snapshots``
above their share of requesters (the default, 64, leaves the others
unanswered until they retry).  The same run ``direct`` (``resync_topologies``):
no relays, the requesters on the backup, where a client of the pair goes when
the active dies, and the pair with ``--max-snapshots`` above the requesters;
the backup's own publisher tells them it holds the marker.  A backup takes
over only when a client asks it for a snapshot (the vote), so there the driver
asks it for an empty subtree every 0.25 s from the kill, as the first
client to fail over would.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from clone.tools.bench.catchup import RESYNC_RUNS, before_kill
from clone.tools.bench.config import BenchConfig, Say
from clone.tools.bench.processes import MP, SNAP_SUBTREE, kvset, reap
from clone.tools.bench.subscriberprocs import (
    _MARKER,
    _VOTE_SUBTREE,
    _cpu,
    _requester_main,
    _sink_process_main,
    _writer_main,
    raise_nofile,
)
from clone.tools.bench.subscriberprocs import _probe_positions as _probe_positions
from clone.tools.bench.targets import Target, load_keys, running_target
from clone.tools.histogram import LatencyHistogram
from clone.tools.procs import (
    ManagedProcess,
    ProcessGroup,
    ServerAddress,
    free_base_port,
    free_port,
    python_module_argv,
    server_argv,
)
from clone.wire.frames import MAX_SYNC_FRAME_BYTES, cap_message_size, recv_frames
from clone.wire.protocol import (
    BATCH_METADATA,
    COLLECTOR_OFFSET,
    KTHXBAI,
    KVBATCH,
    PUBLISHER_OFFSET,
    SNAPSHOT_OFFSET,
)

__all__ = ["raise_nofile", "run_subscribers", "subscribers_tables"]

log = logging.getLogger(__name__)



# --------------------------------------------------------------------------
# The driver


def _base_port(target: Target) -> int:
    return int(target.snapshot_endpoint.rsplit(":", 1)[1]) - SNAPSHOT_OFFSET


def _start_relays(group: ProcessGroup, upstream: Sequence[int], n: int, tag: str,
                  max_snapshots: int) -> list[tuple[ManagedProcess, int]]:
    """``n`` relays following the servers at base ports ``upstream``, synced."""
    relays = []
    for r in range(n):
        port = free_base_port(3)
        name = f"clone-relay-{tag}-{r}-{len(group.procs)}"
        argv = python_module_argv(
            "clone.server.cli", "--relay", "--port", str(port), "--bind", "127.0.0.1",
            "--upstream", ",".join(f"127.0.0.1:{p}" for p in upstream),
            "--max-snapshots", str(max_snapshots))
        relays.append((group.add(name, argv), port))
    for proc, _ in relays:
        proc.wait_log("synced from", 30)
    return relays


def _rss_mib(pid: int) -> float:
    import psutil

    rss: int = psutil.Process(pid).memory_info().rss
    return round(rss / 2**20, 1)


def _split(total: int, parts: int) -> list[tuple[int, int]]:
    """(first, count) of ``parts`` nearly equal slices of ``range(total)``."""
    parts = max(1, min(parts, total))
    out, first = [], 0
    for p in range(parts):
        n = total // parts + (1 if p < total % parts else 0)
        out.append((first, n))
        first += n
    return out


@contextlib.contextmanager
def _reaped(procs: list[Any]) -> Iterator[list[Any]]:
    try:
        yield procs
    finally:
        reap(procs, 3.0)


def _fanout(cfg: BenchConfig, group: ProcessGroup, subs: int, topology: str) -> dict[str, Any]:
    """One fan-out run: ``subs`` subscribers, ``direct`` or through relays."""
    with running_target("clone", group, cfg.server_heartbeat_ms) as target:
        pids = [target.pid]
        endpoints = [target.out_endpoint]
        served = [(target.pid, _base_port(target) + PUBLISHER_OFFSET)]
        relays: list[tuple[ManagedProcess, int]] = []
        if topology == "relays":
            relays = _start_relays(group, [_base_port(target)], cfg.sub_relays, "fanout", 64)
            pids += [p.pid for p, _ in relays]
            endpoints = [f"tcp://127.0.0.1:{port + PUBLISHER_OFFSET}" for _, port in relays]
            served = [(p.pid, port + PUBLISHER_OFFSET) for p, port in relays]
        try:
            return _fanout_traffic(cfg, target, subs, topology, pids, endpoints, served)
        finally:
            for proc, _ in relays:
                proc.stop()


def _wait_subscribed(served: list[tuple[int, int]], want: int, timeout: float) -> None:
    """Until the processes in ``served`` (pid, publisher port) hold ``want``
    established publisher connections in all (asked of the kernel, so the
    servers run as measured), then a moment for the subscriptions to land.

    A fixed pause was not enough: at 5,000 subscribers on a loaded machine some
    sinks connected after the writer started and missed its first updates, which
    the loss count then reported as lost (a slow joiner, not a server's loss).
    """
    deadline = time.monotonic() + timeout
    total = 0
    while time.monotonic() < deadline:
        total = sum(_publisher_connections(pid, port) for pid, port in served)
        if total >= want:
            time.sleep(0.5)
            return
        time.sleep(0.2)
    raise RuntimeError(f"only {total}/{want} subscribers connected after {timeout:g} s")


def _publisher_connections(pid: int, port: int) -> int:
    import psutil

    return sum(
        1
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port
    )


def _fanout_traffic(cfg: BenchConfig, target: Target, subs: int, topology: str,
                    pids: list[int], endpoints: list[str],
                    served: list[tuple[int, int]]) -> dict[str, Any]:
    ready, results, writer_q = MP.Queue(), MP.Queue(), MP.Queue()
    go, stop = MP.Event(), MP.Event()
    expected = MP.Value("q", 1 << 62)
    slices = _split(subs, cfg.sub_processes)
    sinks = [MP.Process(target=_sink_process_main,
                        args=(i, endpoints, first, n, cfg.sub_probes, cfg.sub_per_socket,
                              ready, stop, expected, results), daemon=True)
             for i, (first, n) in enumerate(slices)]
    writer = MP.Process(target=_writer_main,
                        args=(target.in_endpoint, cfg.sub_rate, cfg.rate_seconds,
                              cfg.value_size, go, writer_q), daemon=True)
    with _reaped([*sinks, writer]):
        for p in sinks:
            p.start()
        writer.start()
        seen: set[int] = set()
        end = time.monotonic() + 60 + subs / 100
        while len(seen) < len(sinks):
            try:
                seen.add(ready.get(timeout=max(0.01, end - time.monotonic())))
            except queue.Empty:
                raise RuntimeError(f"only {len(seen)}/{len(sinks)} sink processes ready") from None
        # Every sink's connection is up and subscribed (at the server or its relay).
        _wait_subscribed(served, subs, 60 + subs / 100)
        cpu0, t0 = _cpu(pids), time.monotonic()
        sinks_cpu0 = _cpu([p.pid for p in sinks if p.pid is not None])
        go.set()
        w = writer_q.get(timeout=cfg.rate_seconds + 60)
        # At the writer's end, where queues behind a slow server are longest.
        rss: dict[str, Any] = {"server": _rss_mib(pids[0])}
        if len(pids) > 1:
            rss["relays"] = [_rss_mib(p) for p in pids[1:]]
        expected.value = w["sent"]
        stop.set()
        got = [results.get(timeout=600) for _ in sinks]
        # CPU over the whole delivery, until the last subscriber had it (plus the
        # subscribers' idle wait when some did not).
        cpu1, t1 = _cpu(pids), time.monotonic()
    received: dict[int, int] = {}
    held: dict[int, int] = {}
    probes: dict[int, dict[str, Any]] = {}
    merged = LatencyHistogram()
    for r in got:
        received.update({int(g): n for g, n in r["received"].items()})
        held.update({int(g): n for g, n in r["held"].items()})
        probes.update({int(g): p for g, p in r["probes"].items()})
        merged.merge(LatencyHistogram.decode(r["hist"]))
    sent = int(w["sent"])
    # A sink's connections each deliver every update at most once, so a sink
    # that received held x sent lost nothing on any of its subscribers.
    lost = {g: max(0, held.get(g, 1) * sent - n) for g, n in received.items()}
    p99s = sorted(p["p99_ms"] for p in probes.values())
    return {
        "subscribers": subs,
        "topology": topology,
        "relays": len(endpoints) if topology == "relays" else 0,
        "rate": cfg.sub_rate,
        "seconds": cfg.rate_seconds,
        "sent": sent,
        "sink_processes": len(sinks),
        "probes": len(probes),
        "latency": merged.summary(),
        "probe_p99_ms": {"min": p99s[0], "median": p99s[len(p99s) // 2], "max": p99s[-1]}
        if p99s else {},
        "writer_lag": LatencyHistogram.decode(w["lag"]).summary(),
        "lost": sum(lost.values()),
        # Probes, and sinks of ``sub_per_socket`` subscribers, that lost any update.
        "sinks_with_loss": sum(1 for x in lost.values() if x),
        "per_socket": cfg.sub_per_socket,
        "subscribers_counted": sum(held.get(g, 1) for g in received),
        "received_min": min((n // held.get(g, 1) for g, n in received.items()), default=0),
        "server_cpu_s": round(cpu1 - cpu0, 2),
        "server_cpu_pct": round(100 * (cpu1 - cpu0) / (t1 - t0), 1),
        # The subscribers' own processes (their libzmq I/O threads receive every
        # update), over the same window: on a small machine they compete with the server.
        "sinks_cpu_pct": round(100 * (sum(r["cpu_s"] for r in got) - sinks_cpu0) / (t1 - t0), 1),
        "delivery_s": round(t1 - t0, 2),
        "rss_mib": rss,
        "nofile": min(r["nofile"] for r in got),
    }


def _count_keys(ctx: zmq.Context[Any], port: int, subtree: bytes, timeout: float = 30) -> int:
    """The entries of a (batched) snapshot of ``subtree`` from the server at base ``port``."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.linger = 0
    cap_message_size(dealer, MAX_SYNC_FRAME_BYTES)
    dealer.setsockopt(zmq.METADATA, BATCH_METADATA)
    dealer.connect(f"tcp://127.0.0.1:{port + SNAPSHOT_OFFSET}")
    count = 0
    deadline = time.monotonic() + timeout
    try:
        dealer.send_multipart([b"ICANHAZ?", subtree])
        while dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            frames = recv_frames(dealer)
            if frames[0] == KTHXBAI:
                return count
            count += len(frames[1]) // 4 if frames[0] == KVBATCH else 1
        raise TimeoutError(f"no KTHXBAI from the server at {port}")
    finally:
        dealer.close(linger=0)


def _load(ctx: zmq.Context[Any], target: Target, port: int, keys: int, size: int) -> None:
    """Load ``keys`` keys and check they are all there: a write sent on the PUB before its
    connection is up is dropped (:func:`.targets.load_keys` waits 0.2 s, which a loaded
    machine can exceed), so load again until the snapshot holds them all."""
    for _ in range(3):
        load_keys(ctx, target, keys, size)
        got = _count_keys(ctx, port, SNAP_SUBTREE.encode())
        if got >= keys:
            return
        log.warning("subscribers: the server holds %d of %d keys after loading; again",
                    got, keys)
    raise RuntimeError(f"could not load {keys} keys into the server at {port}")


def _write_marker(ctx: zmq.Context[Any], ports: Sequence[int],
                  timeout: float, vote_port: int | None = None) -> tuple[float, int]:
    """Send the marker to every server's collector until one publishes it:
    when it did, and the marker's sequence.

    ``vote_port``: also ask the server there for a snapshot (of an empty
    subtree) every 0.25 s, as the first client to fail over to it would.  A
    backup takes over only when a client asks it (Binary Star's vote); with
    relays, their own resync is that request."""
    pub = ctx.socket(zmq.PUB)
    pub.sndhwm = 0
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, _MARKER)
    cap_message_size(sub)
    for p in ports:
        pub.connect(f"tcp://127.0.0.1:{p + COLLECTOR_OFFSET}")
        sub.connect(f"tcp://127.0.0.1:{p + PUBLISHER_OFFSET}")
    voter = None
    if vote_port is not None:
        voter = ctx.socket(zmq.DEALER)
        voter.linger = 0
        cap_message_size(voter, MAX_SYNC_FRAME_BYTES)
        voter.connect(f"tcp://127.0.0.1:{vote_port + SNAPSHOT_OFFSET}")
    msg = kvset(_MARKER, b"after the failover", 1 << 42)  # one uuid: one update
    deadline = time.monotonic() + timeout
    voted = 0.0
    try:
        while time.monotonic() < deadline:
            pub.send_multipart(msg)
            if voter is not None and time.monotonic() - voted >= 0.25:
                voter.send_multipart([b"ICANHAZ?", _VOTE_SUBTREE])
                voted = time.monotonic()
            if sub.poll(50):
                frames = recv_frames(sub)
                return time.monotonic(), int.from_bytes(frames[1], "big")
        raise TimeoutError("the marker was not published after the failover")
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        if voter is not None:
            voter.close(linger=0)


def _resync(cfg: BenchConfig, group: ProcessGroup, say: Say,
            topology: str = "relays", mode: str = "full") -> dict[str, Any]:
    """One resync run: the clients behind the relays (``relays``) or on the pair
    itself, where a client goes to the backup when the active dies (``direct``);
    each asking for a full snapshot or a catch-up (``mode``, :mod:`.catchup`)."""
    keys, clients = cfg.resync_keys, cfg.resync_clients
    nrelays = cfg.sub_relays if topology == "relays" else 0
    me = ServerAddress("primary", free_base_port(3), free_port())
    peer = ServerAddress("backup", free_base_port(3), free_port())
    tag = len(group.procs)
    # Direct, the pair serves every client: a slot each (as the relays get).
    extra = ("--max-snapshots", str(clients + 16)) if topology == "direct" else ()
    primary = group.add(f"clone-primary-{tag}", server_argv("primary", me, peer, extra=extra))
    backup = group.add(f"clone-backup-{tag}", server_argv("backup", peer, me, extra=extra))
    ctx: zmq.Context[Any] = zmq.Context()
    relays: list[tuple[ManagedProcess, int]] = []
    try:
        primary.wait_log("now ACTIVE", 30)
        backup.wait_log("synced from", 30)
        target = Target("clone-primary", f"tcp://127.0.0.1:{me.port + COLLECTOR_OFFSET}",
                        f"tcp://127.0.0.1:{me.port + PUBLISHER_OFFSET}", primary.pid)
        _load(ctx, target, me.port, keys, cfg.value_size)
        if nrelays:
            per_relay = -(-clients // nrelays)
            relays = _start_relays(group, [me.port, peer.port], nrelays, "resync",
                                   per_relay + 16)
            ports = [port for _, port in relays]
        else:
            ports = [peer.port]  # the backup: where a client fails over to
        since, subtree = None, SNAP_SUBTREE.encode()
        if mode == "catchup":
            subtree = b""  # a catch-up is for a client holding the whole map
            # What the relays and the backup must hold: a client following them
            # holds it too, and asks for what came after.
            since = before_kill(ctx, me.port, sorted({peer.port, *ports}))[1]
        endpoints = [(f"tcp://127.0.0.1:{port + PUBLISHER_OFFSET}",
                      f"tcp://127.0.0.1:{port + SNAPSHOT_OFFSET}") for port in ports]
        ready, results, stop = MP.Queue(), MP.Queue(), MP.Event()
        marker_seq = MP.Value("q", 0)
        slices = _split(clients, cfg.sub_processes)
        procs = [MP.Process(target=_requester_main,
                            args=(i, endpoints, first, n, subtree, marker_seq,
                                  ready, stop, results, since), daemon=True)
                 for i, (first, n) in enumerate(slices)]
        with _reaped(procs):
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=60)
            time.sleep(1.0)  # connected
            t_kill = time.monotonic()
            primary.kill9()
            t_marker, marker_seq.value = _write_marker(
                ctx, [me.port, peer.port], 30, None if nrelays else peer.port)
            got = []
            end = time.monotonic() + 30
            with contextlib.suppress(queue.Empty):
                for _ in procs:
                    got.append(results.get(timeout=max(0.01, end - time.monotonic())))
            stop.set()
            with contextlib.suppress(queue.Empty):
                while len(got) < len(procs):
                    got.append(results.get(timeout=5))
    finally:
        for proc, _ in relays:
            proc.stop()
        backup.stop()
        primary.stop()
        ctx.term()
    done = {int(g): t for r in got for g, t in r["done"].items()}
    entries = {int(g): n for r in got for g, n in r["entries"].items()}
    marker_at: dict[int, float] = {}
    how: dict[int, str] = {}
    for r in got:
        for rel, t in r["marker_at"].items():
            marker_at[int(rel)] = min(t, marker_at.get(int(rel), t))
        how.update({int(rel): h for rel, h in r["how"].items()})
    deltas = {int(g) for r in got for g in r.get("deltas", ())}
    marked = {int(g) for r in got for g in r.get("marked", ())}
    # A full snapshot holds every key, the marker (and the update before the kill).
    full = keys + 1 + (mode == "catchup")
    complete = [g for g in range(clients) if g in done
                and ((g in deltas and g in marked) or entries.get(g) == full)]
    result: dict[str, Any] = {
        "topology": topology,
        "mode": mode,
        "keys": keys,
        "clients": clients,
        "relays": nrelays,
        "new_active_published_s": round(t_marker - t_kill, 3),
        "relays_delivered_s": sorted(round(t - t_kill, 3) for t in marker_at.values()),
        # kvpub: the relay published the marker; hugz: its HUGZ passed the marker's
        # sequence (a full resync, which publishes no difference).
        "relays_told_by": sorted(set(how.values())),
        "retries": sum(int(r.get("retries", 0)) for r in got),
        "complete": len(complete),
        "incomplete": clients - len(complete),
        "catchups": len(deltas & set(complete)),
        "snapshot_s": {},
        "resync_s": None,
    }
    if complete:
        times = sorted(done[g] - t_kill for g in complete)
        result["snapshot_s"] = {"first": round(times[0], 3),
                                "median": round(times[len(times) // 2], 3),
                                "last": round(times[-1], 3)}
    if len(complete) == clients:
        result["resync_s"] = result["snapshot_s"]["last"]
    via = f"via {nrelays} relays" if nrelays else "directly on the pair"
    by = " by catch-up" if mode == "catchup" else ""
    say(f"  resync{by} of {clients:,} clients ({keys:,} keys) {via} after kill -9: "
        f"new active published at {result['new_active_published_s']} s, relays delivered "
        f"{result['relays_delivered_s']} s, all complete at {result['resync_s']} s "
        f"({len(complete)}/{clients} complete, {result['catchups']} by KVDELTA, "
        f"{result['retries']} retries)")
    return result


def run_subscribers(cfg: BenchConfig, group: ProcessGroup, say: Say) -> dict[str, Any]:
    """Fan-out runs and the resync after a failover; see the module."""
    out: dict[str, Any] = {"nofile_driver": raise_nofile(), "fanout": []}
    for subs in cfg.sub_counts:
        for topology in ("direct", "relays"):
            try:
                run = _fanout(cfg, group, subs, topology)
            except Exception as exc:
                log.exception("subscribers: %d %s failed", subs, topology)
                say(f"  {subs} subscribers {topology} FAILED: {exc}")
                out.setdefault("errors", {})[f"{subs} {topology}"] = repr(exc)[:2000]
                continue
            out["fanout"].append(run)
            lat = run["latency"]
            say(f"  {subs:>5} subscribers {topology:>6} at {run['rate']}/s: p50 "
                f"{lat['p50_ms']:.2f} p99 {lat['p99_ms']:.2f} p99.9 {lat['p99_9_ms']:.2f} max "
                f"{lat['max_ms']:.2f} ms ({run['probes']} probes); lost {run['lost']} "
                f"({run['sinks_with_loss']} sinks); server CPU "
                f"{run['server_cpu_pct']}%, RSS {run['rss_mib']} MiB")
    for topology, mode in ((t, m) for m in cfg.resync_modes for t in cfg.resync_topologies):
        # "resync" (through the relays) as before; "resync_direct" on the pair;
        # "_catchup" after either for the catch-up mode.
        name = "resync" if topology == "relays" else f"resync_{topology}"
        name += "" if mode == "full" else f"_{mode}"
        try:
            out[name] = _resync(cfg, group, say, topology, mode)
        except Exception as exc:
            log.exception("subscribers: %s failed", name)
            say(f"  {name} FAILED: {exc}")
            out.setdefault("errors", {})[name] = repr(exc)[:2000]
    return out


def subscribers_tables(section: dict[str, Any], *,
                       markdown: bool = False) -> list[tuple[str, str]]:
    """(title, table) pairs for the subscribers section's results."""
    from clone.tools.report import table

    out: list[tuple[str, str]] = []
    runs = section.get("fanout", [])
    if runs:
        out.append((
            f"Subscribers: fan-out at {runs[0]['rate']:,} updates/s (latency of the probes, ms)",
            table(
                ["subscribers", "topology", "p50", "p99", "p99.9", "max", "probe p99s",
                 "lost", "sinks with loss", "server CPU %", "subscribers' CPU %", "delivery s",
                 "RSS MiB", "writer lag p99"],
                [[r["subscribers"], r["topology"] + (f" ({r['relays']})" if r["relays"] else ""),
                  r["latency"]["p50_ms"], r["latency"]["p99_ms"], r["latency"]["p99_9_ms"],
                  r["latency"]["max_ms"],
                  " / ".join(str(r["probe_p99_ms"].get(k)) for k in ("min", "median", "max")),
                  r["lost"], r["sinks_with_loss"], r["server_cpu_pct"],
                  r.get("sinks_cpu_pct", "-"), r.get("delivery_s", "-"), _rss_cell(r["rss_mib"]),
                  r["writer_lag"]["p99_ms"]] for r in runs],
                markdown=markdown,
            ),
        ))
    resyncs = [section[k] for k in RESYNC_RUNS if section.get(k)]
    if resyncs:
        out.append((
            "Subscribers: resync after kill -9 of the active (s from the kill)",
            table(
                ["clients", "keys", "relays", "mode", "new active published",
                 "relays (or the new active) had it (told by)",
                 "first / median / last snapshot complete", "complete", "retries", "resync"],
                [[rs["clients"], rs["keys"], rs["relays"] or "direct", rs.get("mode", "full"),
                  rs["new_active_published_s"],
                  " / ".join(str(x) for x in rs["relays_delivered_s"])
                  + f" ({', '.join(rs['relays_told_by'])})",
                  " / ".join(str(rs["snapshot_s"].get(k)) for k in ("first", "median", "last")),
                  f"{rs['complete']}/{rs['clients']}"
                  + (f" ({rs['catchups']} KVDELTA)" if rs.get("mode") == "catchup" else ""),
                  rs.get("retries", "-"), rs["resync_s"]]
                 for rs in resyncs],
                markdown=markdown,
            ),
        ))
    for name, error in section.get("errors", {}).items():
        out.append((f"Subscribers: {name} FAILED", error))
    return out


def _rss_cell(rss: dict[str, Any]) -> str:
    relays = rss.get("relays")
    return f"{rss['server']}" + (f" + relays {'/'.join(str(x) for x in relays)}" if relays else "")
