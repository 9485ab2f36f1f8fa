"""What a drill's recorded events and final states say: pure, no processes, no clock.

How this works: :func:`analyse` reads the events of every client incarnation
(``c1``, then ``c1.g1`` after a restart) and the final states, and counts.

* **Unique keys** (``/drill/<id>/g<gen>/<n>``) are written once each, so a write
  is lost exactly when its key is missing or holds another value, and each
  client must see each writer's writes once and in order.
* **Overwritten keys** (``/drill/shared/<k>``) are written by every client, many
  times; only they can show a *revert*, a key going back to an older value.
  For those, :func:`find_reverts` judges each final value against the events:

  A write ``w`` was applied by the server some time after it was sent (its
  ``write_sent``) and, if it was confirmed, before its writer saw the
  confirmation (its ``write_confirmed``).  A client's writes reach a server in
  the order it sent them, so ``w`` was also applied before any *later* write of
  the same writer was confirmed: ``done_by(w)`` is the earliest confirmation of
  ``w`` or of a later write of its writer (infinite when there is none, and for
  a write that timed out, whose copies the agent may still resend).

  The final value of a key, from write ``F``, is a **revert** when a confirmed
  write ``L`` of that key (``L`` is not ``F``) was provably applied after ``F``:

  1. ``done_by(F) < sent(L)``: ``F`` was confirmed (or followed by a confirmed
     write of its writer) before ``L`` was even sent; or
  2. ``F`` and ``L`` come from the same writer (one client incarnation) and
     ``F`` was sent before ``L``, and ``F`` did not time out.

  Everything else is allowed: a write in flight while ``L`` was, confirmed or
  not, may legitimately land after ``L``, whichever client sent it.  A key
  with a confirmed write that is missing at the end, or holds a value no
  client wrote, is reverted too.  Timestamps are ``time.time()`` of processes
  on one host, so they share a clock.

Duplicates on an overwritten key are judged by the key, not the write id: a
client applied a write twice when the key already held that write.  (Seeing a
write again after another value is a revert, judged at the end, not a
duplicate; per-writer order is checked on unique keys only, since a resync
reports the changed keys in key order.)

**The lock workload** (``lock_acquired`` / ``lock_released`` / ``lock_lost``
events, each with the lock's fencing token): :func:`lock_fencing` orders the
acquisitions by time and requires every token to be higher than all the tokens
acquired before it, which is what lets a resource refuse a stale holder.  An
acquisition logged before an earlier holder logged its release is counted as an
overlap: it is allowed (a holder cut off past its lease is still running), but
only with a higher token.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from clone.tools.drill.client import (
    LOCK_PREFIX,
    SHARED_PREFIX,
    UNIQUE_KEY_RE,
    parse_value,
    state_hash,
)
from clone.tools.drill.splitjudge import (
    conflict_write_ids,
    conflicts_told,
    split_writes,
    stepped_down_writes,
)

__all__ = [
    "REVERT_EXAMPLES",
    "Revert",
    "SharedWrite",
    "analyse",
    "applied_before",
    "conflict_write_ids",
    "conflicts_told",
    "lock_holders",
    "find_reverts",
    "highest_sequence_before",
    "lock_fencing",
    "log_line_time",
    "split_brain_lines",
    "split_writes",
    "stepped_down_writes",
    "nearest_rank",
    "percentile",
    "revert_detail",
    "seen_revert_detail",
    "shared_writes",
]

#: How many reverted keys the summary describes in full.
REVERT_EXAMPLES = 10


def nearest_rank(n: int, p: float) -> int:
    """The index, in ``n`` sorted values, of the ``p``-th percentile.

    The one definition of a percentile in the tools: the nearest rank, the
    smallest value with at least ``p`` % of the values at or below it (rank
    ``ceil(p/100 * n)``, at least 1).  Always one of the values, never an
    interpolation: a failover gap or a benchmark run that happened, and the
    50th is the lower median.
    """
    if n < 1:
        raise ValueError("no values")
    return max(1, math.ceil(p / 100.0 * n)) - 1


def percentile(values: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``values`` by :func:`nearest_rank`; None for no values."""
    if not values:
        return None
    return sorted(values)[nearest_rank(len(values), p)]


# --------------------------------------------------------------------------
# Overwritten keys


@dataclass(frozen=True, slots=True)
class SharedWrite:
    """One write of an overwritten key, as its writer's events tell it."""

    key: str
    uuid: str
    writer: str  # the stream, i.e. the client incarnation: c1, c1.g1
    order: int  # its place among all the writes of its writer
    sent: float
    confirmed: float | None  # when its writer saw it confirmed
    timed_out: bool
    done_by: float  # applied by then at the latest; inf when unknown

    def describe(self, t0: float) -> dict[str, Any]:
        def rel(t: float | None) -> float | None:
            return None if t is None or math.isinf(t) else round(t - t0, 4)

        return {
            "writer": self.writer, "order": self.order, "uuid": self.uuid,
            "sent_s": rel(self.sent), "confirmed_s": rel(self.confirmed),
            "timed_out": self.timed_out, "done_by_s": rel(self.done_by),
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class Revert:
    """A key whose final value (in one final state) went back before a confirmed write."""

    state: str  # "server" or a client id
    key: str
    final: SharedWrite | None  # None: the key is missing or holds an unknown value
    final_uuid: str | None
    # The confirmed write that the final one should not have outlived (for a
    # missing or unknown value: the confirmed write sent last).
    outlived: SharedWrite
    reason: str

    def describe(self, t0: float) -> dict[str, Any]:
        return {
            "state": self.state, "key": self.key, "reason": self.reason,
            "final_uuid": self.final_uuid,
            "final": None if self.final is None else self.final.describe(t0),
            "outlived": self.outlived.describe(t0),
        }  # fmt: skip


def shared_writes(
    streams: Mapping[str, Sequence[Mapping[str, Any]]], conflicted: Collection[str] = ()
) -> dict[str, SharedWrite]:
    """Every write of an overwritten key, by write id, with its ``done_by``.

    A write in ``conflicted`` (a split brain's heal kept it as a conflict, and
    its writer was told) counts as not confirmed: the pair took back what the
    isolated server had said, so no later value is a revert of it.  Its
    confirmation still bounds when its writer's earlier writes were applied.
    """
    out: dict[str, SharedWrite] = {}
    for writer, events in streams.items():
        sent: list[tuple[str, str, float]] = []  # (uuid, key, ts), in the writer's order
        confirmed: dict[str, float] = {}
        timed_out: set[str] = set()
        for ev in events:
            kind, uid = ev.get("event"), ev.get("uuid")
            if not isinstance(uid, str):
                continue
            if kind == "write_sent":
                sent.append((uid, str(ev.get("key", "")), float(ev["ts"])))
            elif kind == "write_confirmed":
                confirmed[uid] = float(ev["ts"])
            elif kind == "write_timeout":
                timed_out.add(uid)
        # Backwards, carrying the earliest confirmation at or after each write:
        # every write of any key counts, since all share one path to the server.
        bound = math.inf
        for order in range(len(sent) - 1, -1, -1):
            uid, key, ts = sent[order]
            if uid in confirmed:
                bound = min(bound, confirmed[uid])
            if key.startswith(SHARED_PREFIX):
                late = uid in timed_out
                out[uid] = SharedWrite(
                    key, uid, writer, order, ts,
                    None if uid in conflicted else confirmed.get(uid), late,
                    math.inf if late else bound,
                )  # fmt: skip
    return out


def applied_before(older: SharedWrite, confirmed: SharedWrite) -> str | None:
    """Why write ``older`` was certainly applied before the confirmed write
    ``confirmed`` (so must not be a key's value after it), or None if that is
    not certain: a write in flight at the same time may land either side."""
    if older is confirmed or older.timed_out:
        return None
    if older.writer == confirmed.writer and older.order < confirmed.order:
        return "sent before a confirmed write of the same writer"
    if older.done_by < confirmed.sent:
        return f"done {confirmed.sent - older.done_by:.3f} s before a confirmed write was sent"
    return None


def _judge(
    state: str,
    key: str,
    final_uuid: str | None,
    confirmed: Sequence[SharedWrite],
    writes: Mapping[str, SharedWrite],
) -> Revert | None:
    """The revert, if the final value of ``key`` is one (see the module docstring)."""
    latest_first = sorted(confirmed, key=lambda w: (w.sent, w.writer, w.order), reverse=True)
    final = writes.get(final_uuid) if final_uuid is not None else None
    if final is None or final.key != key:
        what = "missing" if final_uuid is None else "a value no client wrote to this key"
        return Revert(state, key, None, final_uuid, latest_first[0], what)
    for later in latest_first:
        why = applied_before(final, later)
        if why is not None:
            return Revert(state, key, final, final_uuid, later, why)
    return None


def _seen_reverts(
    streams: Mapping[str, Sequence[Mapping[str, Any]]], writes: Mapping[str, SharedWrite]
) -> list[Revert]:
    """Updates that took a key back, as each client saw them: the client had
    applied a confirmed write ``L`` of the key, ``L`` had been confirmed, and
    then it applied a write certainly applied before ``L``.  A client that is
    merely behind sees old values, but never one older than what it has seen;
    this catches a revert that later writes hide from the final state."""
    out: list[Revert] = []
    for stream, events in streams.items():
        seen: dict[str, list[SharedWrite]] = {}  # key -> confirmed writes applied
        for ev in events:
            key = ev.get("key", "")
            if ev.get("event") != "update" or not key.startswith(SHARED_PREFIX):
                continue
            uid = ev.get("uuid")
            now = float(ev["ts"])
            w = writes.get(uid) if isinstance(uid, str) else None
            if w is None or w.key != key:
                continue  # a key found gone at a resync, or a stranger: judged at the end
            for earlier in seen.get(key, ()):
                assert earlier.confirmed is not None
                why = applied_before(w, earlier) if earlier.confirmed < now else None
                if why is not None:
                    out.append(Revert(stream, key, w, uid, earlier, why))
                    break
            if w.confirmed is not None:
                seen.setdefault(key, []).append(w)
    return out


def find_reverts(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    finals: Mapping[str, Mapping[str, str | None]],
    conflicted: Collection[str] = (),
) -> dict[str, Any]:
    """Judge every overwritten key in every final state, and every update of
    one that a client applied; the counts and examples for the summary.

    ``finals``: state name (``server``, or a client id) -> key -> write id
    held at the end; only keys under ``SHARED_PREFIX`` are looked at.
    """
    writes = shared_writes(streams, conflicted)
    by_key: dict[str, list[SharedWrite]] = {}
    for w in writes.values():
        by_key.setdefault(w.key, []).append(w)
    reverts: list[Revert] = []
    for state, items in finals.items():
        for key in sorted(by_key):
            confirmed = [w for w in by_key[key] if w.confirmed is not None]
            if confirmed:
                found = _judge(state, key, items.get(key), confirmed, writes)
                if found is not None:
                    reverts.append(found)
    seen = _seen_reverts(streams, writes)
    t0 = min((w.sent for w in writes.values()), default=0.0)
    return {
        "shared_keys_written": len(by_key),
        "shared_writes": len(writes),
        "shared_confirmed_writes": sum(1 for w in writes.values() if w.confirmed is not None),
        "reverted_keys": len({r.key for r in reverts}),
        "reverted_by_state": {s: sum(1 for r in reverts if r.state == s) for s in finals},
        "reverted_examples": [r.describe(t0) for r in reverts[:REVERT_EXAMPLES]],
        "reverts_seen": len(seen),
        "reverts_seen_by_client": {s: sum(1 for r in seen if r.state == s) for s in streams},
        "reverts_seen_examples": [r.describe(t0) for r in seen[:REVERT_EXAMPLES]],
        "shared_t0": t0,
    }


# --------------------------------------------------------------------------
# Everything


def analyse(
    streams: dict[str, list[dict[str, Any]]],
    server_state: dict[str, bytes] | None,
    final_clients: dict[str, str | None],
    client_items: Mapping[str, Mapping[str, str | None]] | None = None,
    conflicted: Collection[str] = (),
) -> dict[str, Any]:
    """Loss, order, duplicates, failover gaps, convergence and reverts.

    ``streams``: the events of each client incarnation (``c1`` then ``c1.g1``
    after a restart); ``server_state``: the active server's final ``/drill/``
    items; ``final_clients``: each client id's final state hash (its last
    incarnation), None when it has none; ``client_items``: each client id's
    final items as key -> write id, where known (for the revert check);
    ``conflicted``: the write ids the servers list as split-brain conflicts
    (:func:`shared_writes`).
    """
    writes: dict[str, dict[str, Any]] = {}
    duplicates = out_of_order = updates = 0
    gaps: list[float] = []
    timeouts = 0
    for events in streams.values():
        seen: set[str] = set()
        last_n: dict[str, int] = {}
        held: dict[str, str | None] = {}  # overwritten keys: the write each holds
        for ev in events:
            kind = ev.get("event")
            key = ev.get("key", "")
            # Lock keys are overwritten too (taken, released, taken again).
            shared = key.startswith((SHARED_PREFIX, LOCK_PREFIX))
            if kind == "write_sent" and not shared:
                writes[key] = {"uuid": ev.get("uuid"), "confirmed": False, "ttl": "/ttl/" in key}
            elif kind == "write_confirmed" and key in writes:
                writes[key]["confirmed"] = True
            elif kind == "write_timeout":
                timeouts += 1
            elif kind == "update":
                updates += 1
                uid = ev.get("uuid")
                if shared:
                    duplicates += uid is not None and held.get(key) == uid
                    held[key] = uid
                    continue
                if uid is None:
                    continue  # a delete (expiry): it carries no write
                if uid in seen:
                    duplicates += 1
                seen.add(uid)
                m = UNIQUE_KEY_RE.match(key)
                if m:
                    writer = f"{m['client']}/{m['ttl'] or ''}g{m['gen']}"
                    n = int(m["n"])
                    if n <= last_n.get(writer, -1):
                        out_of_order += 1
                    last_n[writer] = max(n, last_n.get(writer, -1))
            elif kind == "failover_done" and ev.get("gap_s") is not None:
                gaps.append(float(ev["gap_s"]))

    final = server_state or {}
    final_ids = {k: parse_value(v) for k, v in final.items()}
    lost_confirmed: list[str] = []
    unconfirmed = unconfirmed_lost = confirmed = ttl_writes = confirmed_conflicts = 0
    for key, w in writes.items():
        if w["ttl"]:
            ttl_writes += 1
            continue
        present = final_ids.get(key) == w["uuid"]
        if w["confirmed"]:
            confirmed += 1
            if not present and w["uuid"] in conflicted:
                confirmed_conflicts += 1  # kept and listed by a split brain's heal
            elif not present:
                lost_confirmed.append(key)
        else:
            unconfirmed += 1
            unconfirmed_lost += not present
    ttl_leftover = sum(1 for k in final if "/ttl/" in k)
    server_hash = state_hash(final.items()) if server_state is not None else None
    hashes = set(final_clients.values())
    converged = (
        server_state is not None
        and bool(final_clients)
        and None not in hashes
        and hashes == {server_hash}
    )
    finals: dict[str, Mapping[str, str | None]] = {}
    if server_state is not None:
        finals["server"] = final_ids
    finals.update(client_items or {})
    shared = find_reverts(streams, finals, conflicted)

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 4)

    summary: dict[str, Any] = {
        "writes_sent": len(writes),
        "confirmed_writes": confirmed,
        "confirmed_lost": len(lost_confirmed),
        "confirmed_lost_keys": sorted(lost_confirmed)[:20],
        "confirmed_conflicts": confirmed_conflicts,
        "unconfirmed_writes": unconfirmed,
        "unconfirmed_lost": unconfirmed_lost,
        "write_timeouts": timeouts,
        "ttl_writes": ttl_writes,
        "ttl_leftover": ttl_leftover,
        "duplicates": duplicates,
        "out_of_order": out_of_order,
        "updates_seen": updates,
        "failovers_observed": len(gaps),
        "failover_p50_s": r(percentile(gaps, 50)),
        "failover_p99_s": r(percentile(gaps, 99)),
        "failover_max_s": r(max(gaps) if gaps else None),
        "final_keys": len(final),
        "final_hash": server_hash,
        "converged": converged,
    }
    summary.update(shared)
    summary.update(lock_fencing(streams))
    return summary


def lock_fencing(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    split: tuple[str, float, float] | None = None,
) -> dict[str, Any]:
    """The lock workload's holds and what breaks fencing among them.

    ``split``: ``(server, from, until)``, the side of a split brain that stepped
    down and while it was active beside the winner: the holds it granted then
    are left out of the order and counted in ``lock_holds_split``.  Each side of
    a split brain grants the lock and numbers it from its own sequence, so no
    order holds between them (docs/client.md, "Fencing tokens").

    ``lock_holds``: acquisitions; ``lock_token_violations``: acquisitions whose
    token is not above every token acquired before (by ``ts``), with up to ten
    described in ``lock_token_violation_examples``; ``lock_overlaps``:
    acquisitions logged before an earlier holder logged its release (a holder
    killed while holding logs none and is not counted); ``lock_lost``: holds
    that ended with the lock lost.
    """
    holds: list[dict[str, Any]] = []
    open_holds: dict[tuple[str, int], dict[str, Any]] = {}
    lost = split_holds = 0
    for stream, events in streams.items():
        for ev in events:
            kind = ev.get("event")
            token = ev.get("token")
            if not isinstance(token, int):
                continue
            if kind == "lock_acquired":
                new: dict[str, Any] = {"client": stream, "token": token,
                                       "acquired": float(ev["ts"]), "released": None}
                open_holds[(stream, token)] = new
                if split is not None and split[0] in _granted_by(ev) \
                        and split[1] <= new["acquired"] <= split[2]:
                    split_holds += 1
                    continue
                holds.append(new)
            elif kind in ("lock_released", "lock_lost"):
                lost += kind == "lock_lost"
                if (stream, token) in open_holds:
                    open_holds.pop((stream, token))["released"] = float(ev["ts"])
    holds.sort(key=lambda h: (h["acquired"], h["token"]))
    violations: list[str] = []
    overlaps = 0
    highest: dict[str, Any] | None = None
    last_release = -math.inf  # of the holds before, those that logged one
    for hold in holds:
        if highest is not None and hold["token"] <= highest["token"]:
            violations.append(
                f"{hold['client']} took token {hold['token']} after {highest['client']}"
                f" had taken {highest['token']}")
        overlaps += last_release > hold["acquired"]
        if hold["released"] is not None:
            last_release = max(last_release, hold["released"])
        if highest is None or hold["token"] > highest["token"]:
            highest = hold
    return {
        "lock_holds": len(holds) + split_holds,
        "lock_holds_split": split_holds,
        "lock_token_violations": len(violations),
        "lock_token_violation_examples": violations[:10],
        "lock_overlaps": overlaps,
        "lock_lost": lost,
    }


def _granted_by(ev: Mapping[str, Any]) -> set[str]:
    """The servers a ``lock_acquired`` may have come from: the client's server
    when it logged it and, if it failed over meanwhile, the one before."""
    names = set(ev.get("servers") or ())
    if ev.get("server") is not None:
        names.add(ev["server"])
    return names


def highest_sequence_before(
    streams: Mapping[str, Sequence[Mapping[str, Any]]], ts: float
) -> int | None:
    """The highest sequence any client applied before ``ts``, None if none did.

    Every update a client applies carries the sequence the server gave it, so
    a pair that serves a lower sequence after ``ts`` went back: it would hand
    out those sequences again, for other updates.
    """
    seqs = [int(ev["seq"]) for events in streams.values() for ev in events
            if ev.get("event") == "update" and isinstance(ev.get("seq"), int)
            and float(ev["ts"]) < ts]
    return max(seqs, default=None)


def split_brain_lines(log_text: str) -> list[str]:
    """A server log's ``split brain`` lines (Binary Star logs one per episode, on
    each side, saying whether this side steps down or keeps serving)."""
    return [line.strip() for line in log_text.splitlines() if "split brain" in line]


_LATE_RE = re.compile(r"heartbeat ran (\d+) ms late")


def late_heartbeats(log_text: str) -> list[int]:
    """How late (ms) each heartbeat was that a server logged as late: it logs
    one whenever its loop was blocked for more than a heartbeat interval."""
    return [int(m.group(1)) for m in _LATE_RE.finditer(log_text)]


def burst_writes(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
) -> dict[str, Any]:
    """partition-split with split writes: the island's burst (keys
    ``/drill/<id>/burst/...``, unconfirmed), and how many of them the final
    state holds."""
    sent: dict[str, str] = {}  # key -> write id
    seconds: float | None = None
    for events in streams.values():
        for ev in events:
            kind = ev.get("event")
            if kind == "write_sent" and "/burst/" in str(ev.get("key", "")):
                sent[str(ev["key"])] = str(ev.get("uuid"))
            elif kind == "burst_done":
                seconds = ev.get("seconds")
    final = {k: parse_value(v) for k, v in (server_state or {}).items()}
    kept = sum(1 for key, uid in sent.items() if final.get(key) == uid)
    return {"sent": len(sent), "kept": kept, "seconds": seconds}


def log_line_time(line: str) -> float | None:
    """The Unix time of a server log line (``YYYY-MM-DD HH:MM:SS.mmm``, local
    time, as the server's logging writes it), or None."""
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def _example(ex: Mapping[str, Any], where: str) -> str:
    final, outlived = ex["final"], ex["outlived"]
    held = f"{final['writer']} write #{final['order']}" if final else ex["final_uuid"] or "nothing"
    return (f"; e.g. {ex['key']} {where} {ex['state']}: {held}, {ex['reason']} "
            f"({outlived['writer']} write #{outlived['order']}, sent at t={outlived['sent_s']} s, "
            f"confirmed at t={outlived['confirmed_s']} s)")


def revert_detail(summary: Mapping[str, Any]) -> str:
    """For the check table: how many keys ended reverted, where, and the first case."""
    per_state = ", ".join(f"{s} {n}" for s, n in summary["reverted_by_state"].items())
    text = (f"{summary['reverted_keys']} of {summary['shared_keys_written']} overwritten keys "
            f"reverted ({per_state or 'no final state'}); "
            f"{summary['shared_confirmed_writes']} of {summary['shared_writes']} writes confirmed")
    examples = summary["reverted_examples"]
    return text + (_example(examples[0], "at the end on") if examples else "")


def seen_revert_detail(summary: Mapping[str, Any]) -> str:
    """For the check table: how many updates took a key back, for whom, the first case."""
    per_client = ", ".join(f"{s} {n}" for s, n in summary["reverts_seen_by_client"].items())
    text = f"{summary['reverts_seen']} updates took a key back ({per_client or 'no client'})"
    examples = summary["reverts_seen_examples"]
    return text + (_example(examples[0], "seen by") if examples else "")


# --------------------------------------------------------------------------
# Locks and split-brain conflicts


def lock_holders(
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
) -> dict[str, Any]:
    """``--locks``: who believes it holds each lock key at the end (its last
    event on the key is ``lock_taken``, not followed by ``lock_released`` or
    ``lock_lost``), and whose take the server's final value is.  A key is bad
    when two clients believe they hold it, or one does and the server holds
    another's take (or nothing)."""
    believed: dict[str, dict[str, str]] = {}
    taken = lost = 0
    for writer, events in streams.items():
        held: dict[str, str] = {}
        for ev in events:
            kind, key = ev.get("event"), str(ev.get("key", ""))
            if not key.startswith(LOCK_PREFIX):
                continue  # the fenced lock workload's events (lock_fencing judges those)
            if kind == "lock_taken":
                held[key] = str(ev.get("uuid"))
                taken += 1
            elif kind in ("lock_released", "lock_lost"):
                held.pop(key, None)
                lost += kind == "lock_lost"
        for key, uid in held.items():
            believed.setdefault(key, {})[writer] = uid
    final = {k: parse_value(v) for k, v in (server_state or {}).items()
             if k.startswith(LOCK_PREFIX)}
    keys = []
    for key in sorted(set(believed) | set(final)):
        holders = believed.get(key, {})
        ok = len(holders) <= 1 and all(uid == final.get(key) for uid in holders.values())
        keys.append({"key": key, "believed_by": sorted(holders), "server_holder": final.get(key),
                     "ok": ok})
    return {"taken": taken, "lost": lost, "keys": keys,
            "bad": [k for k in keys if not k["ok"]]}
