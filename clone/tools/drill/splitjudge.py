"""What a split brain did to the drill's writes: pure, no processes, no clock.

Split out of :mod:`clone.tools.drill.analysis` (which re-exports these names):
the writes a stepped-down active confirmed, the island's writes and their fate
at the heal (applied, overwritten or listed as a conflict), and whether each
writer of a conflicted write was told.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from clone.tools.drill.client import SHARED_PREFIX, UNIQUE_KEY_RE, parse_value

__all__ = ["conflict_write_ids", "conflicts_told", "split_writes", "stepped_down_writes"]


def stepped_down_writes(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
    server: str,
    conflicted: Collection[str] = (),
) -> dict[str, Any]:
    """What became of the writes a server took before it stepped down.

    Over the clients' own keys (each written once, so present or lost):
    ``confirmed_by`` counts the confirmed writes a client saw confirmed while
    synced from ``server`` (``write_confirmed.server``), ``confirmed_by_lost``
    lists those missing from the final state (must be none); ``seen_applied``
    counts the writes a client applied from ``server`` (``update.server``),
    and ``applied_missing_confirmed`` lists those missing from the final state
    although confirmed (must be none: a write the server applied and then lost
    with its step-down must never have been confirmed).  ``applied_missing``
    counts all applied-then-missing ones, confirmed or not.  The lists hold
    the first 20 keys; the ``_count`` fields count them all.  A write the
    servers list as a split-brain conflict (``conflicted``, write ids) is kept,
    not lost: ``kept_as_conflicts`` counts those missing from the final state.
    """
    sent: dict[str, str | None] = {}
    confirmed: set[str] = set()
    confirmed_by: set[str] = set()
    applied: set[str] = set()
    for events in streams.values():
        for ev in events:
            key = str(ev.get("key", ""))
            if key.startswith(SHARED_PREFIX) or "/ttl/" in key or not UNIQUE_KEY_RE.match(key):
                continue
            kind = ev.get("event")
            if kind == "write_sent":
                sent[key] = ev.get("uuid")
            elif kind == "write_confirmed":
                confirmed.add(key)
                if ev.get("server") == server:
                    confirmed_by.add(key)
            elif kind == "update" and ev.get("server") == server and ev.get("uuid"):
                applied.add(key)
    final = {k: parse_value(v) for k, v in (server_state or {}).items()}

    def present(key: str) -> bool:
        return key in sent and final.get(key) == sent[key]

    def listed(key: str) -> bool:
        return sent.get(key) in conflicted

    missing = sorted(k for k in applied if not present(k))
    lost = sorted(k for k in confirmed_by if not present(k) and not listed(k))
    missing_confirmed = [k for k in missing if k in confirmed and not listed(k)]
    return {
        "server": server,
        "confirmed_by": len(confirmed_by),
        "confirmed_by_lost": lost[:20],
        "confirmed_by_lost_count": len(lost),
        "seen_applied": len(applied),
        "applied_missing": len(missing),
        "applied_missing_confirmed": missing_confirmed[:20],
        "applied_missing_confirmed_count": len(missing_confirmed),
        "kept_as_conflicts": sum(
            1 for k in {*applied, *confirmed_by} if not present(k) and listed(k)
        ),
    }


def split_writes(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
    server: str,
    winner: str,
    since: float,
    until: float,
    heal: float,
    conflicted: Collection[str] = (),
    winner_applied: Collection[str] | None = None,
) -> dict[str, Any]:
    """The writes ``server`` confirmed during a split brain, one by one, and what
    became of each.

    A write counts when a client saw it confirmed while synced from ``server``
    (``write_confirmed.server``) between ``since`` (the cut) and ``until`` (the
    server's step-down).  Its ``fate``: ``kept`` when the final state holds it;
    ``conflict`` when the winner lists it as a split-brain conflict (``conflicted``);
    ``overwritten`` (overwritten keys only) when the winner applied it but the
    key ended at another write: a client synced from ``winner`` applied it, or
    the winner's own history holds it (``winner_applied``, drill write ids: a
    write replaced before any client synced from the winner, as when its
    clients were still failing over at the heal, is seen only there);
    ``lost`` otherwise.  ``in_winner_history``: how many were in it (None: not read).
    ``at_winner_s``: when a client synced from ``winner`` first applied it, in
    seconds after ``heal`` (None: no client saw it come from the winner).
    Times of confirmation are seconds after ``since``.  ``reapplied_by``: the
    clients that applied the write more than once (it came back after their
    resync from ``winner`` had taken it away: the ``duplicates`` and reordering
    of a late merge).
    """
    sent: dict[str, tuple[str, str]] = {}  # uuid -> (writer, key)
    confirmed: list[tuple[float, str]] = []  # (ts, uuid)
    at_winner: dict[str, float] = {}
    applied: dict[str, Counter[str]] = {}  # uuid -> how often each client applied it
    for writer, events in streams.items():
        for ev in events:
            kind, uid = ev.get("event"), ev.get("uuid")
            if not isinstance(uid, str):
                continue
            key = str(ev.get("key", ""))
            if "/ttl/" in key:
                continue
            ts = float(ev["ts"])
            if kind == "write_sent":
                sent[uid] = (writer, key)
            elif kind == "write_confirmed" and ev.get("server") == server and since <= ts <= until:
                confirmed.append((ts, uid))
            elif kind == "update":
                applied.setdefault(uid, Counter())[writer.split(".")[0]] += 1
                if ev.get("server") == winner:
                    at_winner[uid] = min(ts, at_winner.get(uid, math.inf))
    final = {k: parse_value(v) for k, v in (server_state or {}).items()}
    history = set(winner_applied or ())
    writes: list[dict[str, Any]] = []
    arrivals: list[float] = []
    for ts, uid in sorted(confirmed):
        writer, key = sent.get(uid, ("?", "?"))
        reached = at_winner.get(uid)
        if final.get(key) == uid:
            fate = "kept"
        elif uid in conflicted:
            fate = "conflict"
        elif key.startswith(SHARED_PREFIX) and (reached is not None or uid in history):
            fate = "overwritten"
        else:
            fate = "lost"
        if reached is not None:
            arrivals.append(round(reached - heal, 3))
        writes.append({
            "client": writer, "key": key, "uuid": uid, "confirmed_s": round(ts - since, 3),
            "fate": fate, "at_winner_s": None if reached is None else round(reached - heal, 3),
            "reapplied_by": sorted(c for c, n in applied.get(uid, Counter()).items() if n > 1),
        })  # fmt: skip
    return {
        "server": server,
        "winner": winner,
        "window_s": round(until - since, 3) if not math.isinf(until) else None,
        "confirmed": len(writes),
        "by_client": {
            c: sum(1 for w in writes if w["client"] == c)
            for c in sorted({w["client"] for w in writes})
        },
        "kept": sum(1 for w in writes if w["fate"] == "kept"),
        "overwritten": sum(1 for w in writes if w["fate"] == "overwritten"),
        "lost": sum(1 for w in writes if w["fate"] == "lost"),
        "conflicts": sum(1 for w in writes if w["fate"] == "conflict"),
        "reached_winner": len(arrivals),
        "at_winner_first_s": min(arrivals, default=None),
        "at_winner_last_s": max(arrivals, default=None),
        "reapplied": sum(1 for w in writes if w["reapplied_by"]),
        "in_winner_history": (
            None if winner_applied is None else sum(1 for w in writes if w["uuid"] in history)
        ),
        "writes": writes,
    }


def conflict_write_ids(conflicts: Sequence[Mapping[str, Any]]) -> set[str]:
    """The drill write ids of the loser's values the servers list as conflicts
    (a delete has none)."""
    out: set[str] = set()
    for rec in conflicts:
        value = (rec.get("loser") or {}).get("value")
        uid = parse_value(value.encode()) if isinstance(value, str) and value else None
        if uid is not None:
            out.add(uid)
    return out


def conflicts_told(
    streams: Mapping[str, Sequence[Mapping[str, Any]]], conflicted: Collection[str]
) -> dict[str, Any]:
    """Whether the writers of conflicted writes they saw confirmed were told:
    per client, how many of its confirmed writes (``write_confirmed``, a lock's
    ``lock_taken``) are listed conflicts, and how many ``write_conflict``
    events it logged."""
    expected: Counter[str] = Counter()
    told: Counter[str] = Counter()
    for writer, events in streams.items():
        for ev in events:
            kind = ev.get("event")
            if kind in ("write_confirmed", "lock_taken") and ev.get("uuid") in conflicted:
                expected[writer] += 1
            elif kind == "write_conflict":
                told[writer] += 1
    return {
        "expected": dict(expected),
        "told": dict(told),
        "missing": {w: n - told[w] for w, n in expected.items() if told[w] < n},
    }
