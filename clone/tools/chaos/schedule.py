"""The chaos run's fault plan: seeded, pure, the same seed the same plan.

How this works: :func:`plan` draws faults one after another from a
``random.Random(seed)``: the kind (uniformly among those the run may use), its
target, when it starts (a gap after the previous start) and how long it lasts.
Each fault holds *resources* (a server, the network, the clients, a server's
disk) while it lasts; a fault whose resources are still held by an earlier one
starts when they are free, so faults on different resources overlap (a killed
backup while the primary's disk is full) and faults on the same one never
undo each other (a partition healed by another partition's heal).  Nothing
here touches a process: :mod:`.faults` carries a plan out.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["FAULT_KINDS", "NEEDS_ROOT", "SERVER_FAULTS", "Fault", "plan"]

#: Every fault kind, in docs/drills.md's order.
FAULT_KINDS: tuple[str, ...] = (
    "kill",  # kill -9 one server, restart it after the fault's duration
    "kill-both",  # kill -9 both at once, restart both
    "pause-server",  # SIGSTOP one server, SIGCONT after
    "pause-client",  # SIGSTOP one client process, SIGCONT after
    "partition-pair",  # the Binary Star link only
    "partition-clients",  # one server from the clients (its peer still reaches it)
    "partition-all",  # both servers from everything
    "clock-step",  # one server's wall clock stepped (libfaketime), back after
    "disk-full",  # one server's data directory (a small tmpfs) filled, freed after
    "restart-storm",  # one server restarted (SIGTERM, start) several times quickly
)
#: Kinds that need root (network namespaces, iptables, mounting a tmpfs).
NEEDS_ROOT: tuple[str, ...] = ("partition-pair", "partition-clients", "partition-all",
                               "disk-full")
#: Kinds that touch the servers (the lease check's deadline moves past them).
SERVER_FAULTS: tuple[str, ...] = tuple(k for k in FAULT_KINDS if k != "pause-client")
SERVERS = ("primary", "backup")


@dataclass(frozen=True)
class Fault:
    at: float  # seconds after the traffic starts
    kind: str
    target: str  # a server, "both", "network", or a client process
    duration: float
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def end(self) -> float:
        return self.at + self.duration

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _resources(kind: str, target: str) -> tuple[str, ...]:
    if kind in ("partition-pair", "partition-clients", "partition-all"):
        return ("network",)
    if kind == "kill-both":
        return SERVERS
    if kind == "pause-client":
        return ("clients",)
    if kind == "disk-full":
        return (f"disk-{target}",)
    return (target,)


def plan(seed: int, duration: float, kinds: Sequence[str], clients: Sequence[str] = (),
         *, gap: tuple[float, float] = (3.0, 8.0), length: tuple[float, float] = (1.0, 6.0),
         quiet_end: float = 5.0) -> list[Fault]:
    """The faults of a run of ``duration`` seconds, seeded by ``seed``.

    ``kinds``: the kinds to draw from (a run without root leaves some out);
    ``clients``: the client processes ``pause-client`` may pick.  Faults start
    ``gap`` seconds apart (uniform) and last ``length`` seconds, and every one
    ends ``quiet_end`` seconds before the traffic does, so the pair can settle
    while the clients still write.
    """
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault kind(s) {', '.join(unknown)}; "
                         f"known: {', '.join(FAULT_KINDS)}")
    if not kinds:
        return []
    rng = random.Random(seed)
    pool = sorted(set(kinds), key=FAULT_KINDS.index)
    if not clients:
        pool = [k for k in pool if k != "pause-client"] or pool
    free: dict[str, float] = {}
    out: list[Fault] = []
    t = rng.uniform(*gap) / 2
    while t < duration - quiet_end:
        kind = rng.choice(pool)
        target = _target(rng, kind, clients)
        length_s = round(rng.uniform(*length), 2)
        params: dict[str, Any] = {}
        if kind == "clock-step":
            params["step_s"] = rng.choice((-1, 1)) * rng.choice((30, 300, 3600))
        elif kind == "restart-storm":
            params["restarts"] = rng.randint(2, 4)
            length_s = max(length_s, 2.0 * params["restarts"])
        elif kind in ("kill", "kill-both"):
            length_s = min(length_s, 4.0)
        start = max([t, *(free.get(r, 0.0) for r in _resources(kind, target))])
        t += rng.uniform(*gap)
        if start + length_s > duration - quiet_end:
            continue  # does not fit: the next draw may (a shorter kind, a free resource)
        out.append(Fault(round(start, 2), kind, target, length_s, params))
        for r in _resources(kind, target):
            free[r] = start + length_s + 0.5
    return out


def _target(rng: random.Random, kind: str, clients: Sequence[str]) -> str:
    if kind in ("kill-both", "partition-pair", "partition-all"):
        return "both" if kind == "kill-both" else "network"
    if kind == "pause-client":
        return rng.choice(list(clients))
    return rng.choice(SERVERS)
