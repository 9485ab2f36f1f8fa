"""The chaos run's checker: every guarantee the docs promise, judged on a saved history.

Pure: it reads records (dicts, one per line of ``history.jsonl``), never a
socket or a clock, so a history can be judged again, and the checker tested on
histories made by hand (tests/tools/test_chaos_checker.py).

A record has ``proc`` (who recorded it), ``f`` (what), ``t0``/``t1`` (invoke
and complete, monotonic seconds shared by the processes of one machine) and
``res`` for operations: ``ok``, ``conflict`` (a compare-and-set whose sequence
no longer matched), ``refused`` (the server said no: nothing happened) or
``unknown`` (a timeout: it may have happened, or not).  The kinds:

* ``write``: a confirmed write (``key``, ``value``, ``seq`` when ok);
* ``cas``: an increment of a counter (``key``, ``expect``: the sequence it was
  read at, 0 for absent; ``value``: the new count; ``tag``: unique per op, part
  of the value written, so that an unknown one can be found later; ``seq``);
* ``read``: a read of the local replica (``key``, ``seq``, ``value``);
* ``update``: a change a watcher saw (``key``, ``seq``, ``value``, None when
  deleted; ``epoch``: the resyncs its change stream told so far), and
  ``resync``: where a resync's changes begin (``epoch``: the new count);
* ``status``: a watcher's client's applied sequence (``seq``; ``epoch``: its
  client's resyncs + failovers + gaps, read with it);
* ``acquire`` / ``release``: a lock holder (``token``, ``holder``);
* ``fence``: the fenced resource's answer (``token``, ``holder``, ``accepted``,
  ``n``: the resource's own order);
* ``lease``: a key bound to a lease (``key``, ``ttl``), and ``died``: its owner
  process exiting without revoking (``t0``);
* ``fault``: a fault and its times; ``final``: the active server's state at the
  end (``state``: key -> [seq, value]).

Each check returns a :class:`Verdict`: ``PASS``, ``FAIL`` (with the first
counterexamples, the operations around each), or ``UNKNOWN`` (the
linearizability search hit its bound: nothing proven either way).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CHECKS",
    "LinOp",
    "Verdict",
    "check_all",
    "check_cas_counters",
    "check_fencing",
    "check_leases",
    "check_linearizable",
    "check_lost_writes",
    "check_reverts",
    "check_watchers",
    "linearizable",
    "lock_overlaps",
]

Record = dict[str, Any]
#: How many counterexamples a verdict keeps.
MAX_EXAMPLES = 5
#: The linearizability search gives up (UNKNOWN) after this many states per key.
DEFAULT_BOUND = 200_000


@dataclass
class Verdict:
    name: str
    status: str = "PASS"  # PASS, FAIL, UNKNOWN
    checked: int = 0  # how many things were judged
    violations: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)

    def fail(self, what: str, **context: Any) -> None:
        self.status = "FAIL"
        self.violations += 1
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append({"what": what, **context})

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "checked": self.checked,
                "violations": self.violations, "examples": self.examples, "notes": self.notes}


def _ops(history: Iterable[Record], *kinds: str) -> list[Record]:
    return [r for r in history if r.get("f") in kinds]


def _final(history: Sequence[Record]) -> dict[str, tuple[int, str]] | None:
    finals = _ops(history, "final")
    if not finals:
        return None
    return {k: (int(v[0]), str(v[1])) for k, v in finals[-1]["state"].items()}


def _around(history: Sequence[Record], key: str, t: float, n: int = 3) -> list[Record]:
    """The operations on ``key`` nearest to time ``t``: a counterexample's context."""
    on_key = [r for r in history if r.get("key") == key and "t0" in r]
    on_key.sort(key=lambda r: abs(r["t0"] - t))
    return sorted(on_key[:n], key=lambda r: r["t0"])


#: Seconds before a split brain is seen (both servers sending HUGZ) that it
#: may already have begun, and after it that its heal may still be under way
#: (the loser's writes forwarded, the clients resynced).
SPLIT_BEFORE, SPLIT_AFTER = 2.0, 5.0


def split_windows(history: Sequence[Record]) -> list[tuple[float, float]]:
    """When a split brain was (``active`` records naming both servers), widened
    by :data:`SPLIT_BEFORE` and :data:`SPLIT_AFTER`, merged.  docs/failover.md
    promises less then: a conditional write the loser confirmed is forwarded as
    a plain one, the loser's writes get the winner's (possibly lower) sequences,
    two servers number locks at once."""
    marks = sorted((r["t0"], str(r.get("server", r.get("active", ""))))
                   for r in history if r.get("f") in ("active", "settled"))
    raw: list[tuple[float, float]] = []
    for (t, who), (t2, _) in itertools.pairwise([*marks, (math.inf, "")]):
        if "+" in who:
            raw.append((t - SPLIT_BEFORE, t2 + SPLIT_AFTER))
    return _merged(raw)


def _merged(raw: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(raw):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


def heal_windows(history: Sequence[Record]) -> list[tuple[float, float]]:
    """Split brains that the HUGZ sample missed, from what their heals leave in
    the counters' history, widened as :func:`split_windows` does and merged.

    The runner samples who sends HUGZ a few times a second, from the clients'
    side: a split brain of a few hundred milliseconds, or one whose second
    active the clients' side could not hear, leaves no ``active`` record naming
    both servers (chaos run seed 7 at 105 s and 467 s: the servers' logs say
    ``split brain``, the samples do not).  Its heal does leave footprints:

    * a counter value (its tag is unique) seen at two sequences: the winner
      applied a write the loser confirmed under a sequence of its own
      (docs/failover.md, "Writes of a split brain"); from its first sight to
      its last;
    * an increment that succeeded from a sequence at which no record ever
      shows its key (not 0, "absent"): its client read a version that only a
      server's renumbering made; around that increment.
    """
    sights: dict[tuple[str, str], dict[int, list[float]]] = {}
    known: dict[str, set[int]] = {}

    def sight(key: str, tag: str | None, seq: int, *times: float) -> None:
        known.setdefault(key, set()).add(seq)
        if tag is not None:
            sights.setdefault((key, tag), {}).setdefault(seq, []).extend(times)

    for r in history:
        key, seq = r.get("key"), r.get("seq")
        if key is None or seq is None:
            continue
        f = r.get("f")
        if f == "cas" and r.get("res") == "ok":
            sight(key, str(r.get("tag")), int(seq), float(r["t0"]), float(r["t1"]))
        elif f in ("update", "read") and r.get("value"):
            sight(key, _tag_of(str(r["value"])), int(seq), float(r["t0"]))
        else:
            known.setdefault(key, set()).add(int(seq))
    for key, (seq, _value) in (_final(history) or {}).items():
        known.setdefault(key, set()).add(seq)
    raw: list[tuple[float, float]] = []
    for by_seq in sights.values():
        if len(by_seq) > 1:
            times = [t for ts in by_seq.values() for t in ts]
            raw.append((min(times) - SPLIT_BEFORE, max(times) + SPLIT_AFTER))
    for op in _ops(history, "cas"):
        expect = int(op.get("expect", 0))
        if op.get("res") == "ok" and expect and expect not in known.get(op["key"], ()):
            raw.append((float(op["t0"]) - SPLIT_BEFORE, float(op["t1"]) + SPLIT_AFTER))
    return _merged(raw)


def _in_split(windows: Sequence[tuple[float, float]], t0: float, t1: float) -> bool:
    return any(t0 <= b and t1 >= a for a, b in windows)


# -- lost writes and reverts ---------------------------------------------------


def check_lost_writes(history: Sequence[Record]) -> Verdict:
    """Every confirmed write (and ok increment) is in the final state, unless a
    later write to its key replaced it: the final value is another write's
    whose sequence is higher, or that began after this one completed.  Values
    are unique per write, so a write re-sequenced by a split brain's heal (the
    winner gives the loser's writes its own, possibly lower, sequences) is
    still found by its value."""
    v = Verdict("lost_writes")
    final = _final(history)
    if final is None:
        v.status = "UNKNOWN"
        v.notes["why"] = "no final state in the history"
        return v
    writer: dict[tuple[str, str], Record] = {}
    for op in _ops(history, "write", "cas"):
        writer[(op["key"], _written(op))] = op
    resequenced = 0
    for op in _ops(history, "write", "cas"):
        if op.get("res") != "ok":
            continue
        v.checked += 1
        key, seq = op["key"], int(op["seq"])
        got = final.get(key)
        if got is not None and got[1] == _written(op):
            resequenced += got[0] != seq
            continue
        later = None if got is None else writer.get((key, got[1]))
        if got is not None and (got[0] > seq or (later is not None and (
                int(later.get("seq") or 0) > seq or later["t0"] > op["t1"]))):
            continue
        v.fail("confirmed write missing from the final state", op=op,
               final=None if got is None else list(got),
               final_writer=later)
    v.notes["kept_at_another_sequence"] = resequenced
    return v


def _written(op: Record) -> str:
    """The value a write or an increment put in the store."""
    if op["f"] == "cas":
        return counter_value(int(op["value"]), str(op["tag"]))
    return str(op["value"])


def _epoch_ok(prev: Record, cur: Record) -> bool:
    """Whether a resync (or failover, or detected gap) came between two observations."""
    return int(cur.get("epoch", 0)) > int(prev.get("epoch", 0))


def check_reverts(history: Sequence[Record]) -> Verdict:
    """No key goes back to an older sequence for any watcher or reader (a drop
    right after a split brain is reported, not failed: docs/failover.md, the
    heal shows the winner's value once more); each client's applied sequence
    (``status`` records) never goes down outside a resync."""
    v = Verdict("reverts")
    windows = split_windows(history)
    last: dict[tuple[str, str], Record] = {}
    after_split = 0
    for op in sorted(_ops(history, "update", "read"), key=lambda r: (r["proc"], r["t1"])):
        if not op.get("seq"):  # absent, or a delete learned from a snapshot (no sequence)
            continue
        v.checked += 1
        k = (op["proc"], op["key"])
        prev = last.get(k)
        if prev is not None and int(op["seq"]) < int(prev["seq"]):
            if _in_split(windows, prev["t1"], op["t1"]) or any(
                    a <= op["t1"] <= b + 30.0 for a, b in windows):
                after_split += 1
            else:
                v.fail("a key went back to an older sequence", proc=op["proc"],
                       key=op["key"], before=prev, after=op)
        last[k] = op
    stream: dict[str, Record] = {}
    for op in sorted(_ops(history, "status"), key=lambda r: (r["proc"], r["t1"])):
        v.checked += 1
        p = stream.get(op["proc"])
        if p is not None and int(op["seq"]) < int(p["seq"]) and not _epoch_ok(p, op):
            v.fail("a client's sequence went down without a resync", proc=op["proc"],
                   before=p, after=op)
        stream[op["proc"]] = op
    v.notes["back_after_split_brain"] = after_split
    return v


# -- compare-and-set ------------------------------------------------------------


@dataclass(frozen=True)
class LinOp:
    """One operation for the linearizability search: ``ret`` is inf for an
    unknown one, which may be left out (it did not happen) unless ``required``."""

    call: float
    ret: float
    expect: int
    value: int
    result: str  # ok, conflict, unknown
    seq: int  # the sequence it made (ok, or an unknown one found later), else a ghost
    required: bool
    index: int = 0


State = tuple[int, int]  # (sequence, count) of one counter key
#: The state of a counter not known yet (a segment's start after a split brain).
ANY: State = (-1, -1)


def _step(state: State, op: LinOp) -> State | None:
    """The sequential model of one counter: the new state, or None if ``op``
    cannot happen in ``state``."""
    seq, count = state
    if state == ANY:
        return state if op.result == "conflict" else (op.seq, op.value)
    if op.result == "conflict":
        return state if seq != op.expect else None
    if seq != op.expect or count != op.value - 1:
        return None
    return (op.seq, op.value)


def linearizable(ops: Sequence[LinOp], init: State = (0, 0), bound: int = DEFAULT_BOUND,
                 step: Callable[[State, LinOp], State | None] = _step,
                 ) -> tuple[bool | None, int, list[int]]:
    """Wing & Gong's search with Lowe's memo (as Porcupine does): is there an
    order of ``ops``, each placed between its call and return, that the
    sequential model accepts?  Unknown ops (``ret`` inf) may be left out.

    Returns (True, states explored, the order), (False, explored, the longest
    prefix found) or (None, explored, []) when ``bound`` states were explored.
    """
    ops = sorted(ops, key=lambda o: o.call)
    n = len(ops)
    needed = 0
    for i, o in enumerate(ops):
        if o.ret != math.inf or o.required:
            needed |= 1 << i
    seen: set[tuple[int, State]] = set()
    # Depth-first; each frame: (mask, state, candidates, next candidate, order).
    best: list[int] = []
    stack: list[tuple[int, State, list[int], int]] = []
    order: list[int] = []

    def candidates(mask: int) -> list[int]:
        # From the first op not yet placed: the ones before it are all placed,
        # and the bits past it are few (the ops placed out of call order).
        lo = (~mask & (mask + 1)).bit_length() - 1
        rest = mask >> lo
        out: list[int] = []
        m = math.inf
        for i in range(lo, n):
            if rest >> (i - lo) & 1:
                continue
            o = ops[i]
            if o.call > m:
                break
            out.append(i)
            m = min(m, o.ret)
        return out

    explored = 0
    stack.append((0, init, candidates(0), 0))
    while stack:
        mask, state, cands, at = stack[-1]
        if mask & needed == needed:
            return True, explored, [ops[i].index for i in order]
        if at >= len(cands):
            stack.pop()
            if order:
                order.pop()
            continue
        stack[-1] = (mask, state, cands, at + 1)
        i = cands[at]
        new = step(state, ops[i])
        if new is None:
            continue
        nmask = mask | 1 << i
        if (nmask, new) in seen:
            continue
        seen.add((nmask, new))
        explored += 1
        if explored > bound:
            return None, explored, []
        order.append(i)
        if len(order) > len(best):
            best = list(order)
        stack.append((nmask, new, candidates(nmask), 0))
    return False, explored, [ops[i].index for i in best]


def _lin_ops(history: Sequence[Record], key: str, observed: dict[tuple[str, str], int],
             ) -> list[LinOp]:
    out = []
    ghost = -1
    for i, op in enumerate(history):
        if op.get("f") != "cas" or op.get("key") != key or op.get("res") == "refused":
            continue
        res = op["res"]
        seq = op.get("seq")
        required = False
        if res == "unknown":
            found = observed.get((key, str(op.get("tag"))))
            if found is not None:
                seq, required = found, True
            else:
                seq, ghost = ghost, ghost - 1
        out.append(LinOp(call=float(op["t0"]),
                         ret=float(op["t1"]) if res != "unknown" else math.inf,
                         expect=int(op["expect"]), value=int(op["value"]),
                         result="ok" if res == "ok" else ("conflict" if res == "conflict"
                                                          else "unknown"),
                         seq=int(seq if seq is not None else 0), required=required, index=i))
    return out


def _observed_tags(history: Sequence[Record]) -> dict[tuple[str, str], int]:
    """(key, tag) -> sequence, for every counter value anyone saw: what an unknown
    increment turned out to be."""
    seen: dict[tuple[str, str], int] = {}
    for r in history:
        if r.get("f") in ("update", "read") and r.get("value") and r.get("seq") is not None:
            tag = _tag_of(str(r["value"]))
            if tag is not None:
                seen[(r["key"], tag)] = int(r["seq"])
    final = _final(history) or {}
    for key, (seq, value) in final.items():
        tag = _tag_of(value)
        if tag is not None:
            seen[(key, tag)] = seq
    return seen


def counter_value(count: int, tag: str) -> str:
    """A counter's value as written: the count and the op's unique tag."""
    return f"{count}|{tag}"


def parse_counter(value: str) -> int | None:
    head = value.split("|", 1)[0]
    return int(head) if head.isdigit() else None


def _tag_of(value: str) -> str | None:
    parts = value.split("|", 1)
    return parts[1] if len(parts) == 2 and parts[0].isdigit() else None


def check_linearizable(history: Sequence[Record], bound: int = DEFAULT_BOUND) -> Verdict:
    """Each counter key's compare-and-set history is linearizable.  Operations
    that overlap a split brain (:func:`split_windows`, and the ones
    :func:`heal_windows` infers) are optional (they may
    have happened or not, whatever their answer), and the history after one is
    judged from an unknown state: docs/failover.md does not promise a
    conditional write's condition across a split brain."""
    v = Verdict("linearizable_cas")
    observed = _observed_tags(history)
    healed = heal_windows(history)
    windows = _merged([*split_windows(history), *healed])
    keys = sorted({op["key"] for op in _ops(history, "cas")})
    explored = {}
    skipped = 0
    for key in keys:
        ops = _lin_ops(history, key, observed)
        # An op that overlaps a split brain may have happened or not, as far as
        # this search goes: optional (an unknown op is judged by when its
        # client gave up, its recorded t1).
        kept = [o if not _in_split(windows, o.call, float(history[o.index]["t1"]))
                else dataclasses.replace(o, ret=math.inf, required=False) for o in ops]
        skipped += sum(1 for o, k in zip(ops, kept, strict=True) if k is not o)
        segments: list[list[LinOp]] = [[] for _ in range(len(windows) + 1)]
        for o in kept:
            segments[sum(1 for _a, b in windows if b < o.call)].append(o)
        explored[key] = 0
        for i, seg in enumerate(segments):
            if not seg:
                continue
            v.checked += len(seg)
            ok, n, order = linearizable(seg, init=(0, 0) if i == 0 else ANY, bound=bound)
            explored[key] += n
            if ok is None:
                if v.status == "PASS":
                    v.status = "UNKNOWN"
                v.notes.setdefault("bounded", []).append(key)
            elif not ok:
                stuck_at = order[-1] if order else None
                t = history[stuck_at]["t1"] if stuck_at is not None else seg[0].call
                v.fail("no linearization of the key's compare-and-set history", key=key,
                       linearized=len(order), of=len(seg),
                       around=_around(history, key, t, 6))
    v.notes["explored"] = explored
    v.notes["optional_in_split_brain"] = skipped
    v.notes["split_brains_inferred"] = len(healed)
    return v


def check_cas_counters(history: Sequence[Record]) -> Verdict:
    """Each counter's final value is between what certainly counted and what
    may have.  Certainly: the ok increments outside every split brain (the
    winner's writes win, and outside one there is one side).  At most: every
    ok increment, every unknown one, and the conflicts answered in a split
    brain, since a split brain's heal applies a conditional write of the
    loser's only if the winner left the key as the loser judged it (else it
    is a kept conflict: docs/failover.md, "Writes of a split brain"), and a
    conflict answered there may be a retry of a call the other side applied."""
    v = Verdict("cas_counters")
    final = _final(history)
    if final is None:
        v.status = "UNKNOWN"
        return v
    by_key: dict[str, list[Record]] = defaultdict(list)
    for op in _ops(history, "cas"):
        by_key[op["key"]].append(op)
    windows = split_windows(history)
    for key, ops in sorted(by_key.items()):
        v.checked += 1
        in_split = [o for o in ops if _in_split(windows, o["t0"], o["t1"])]
        ok = sum(1 for o in ops if o["res"] == "ok")
        unknown = sum(1 for o in ops if o["res"] == "unknown")
        low = ok - sum(1 for o in in_split if o["res"] == "ok")
        high = ok + unknown + sum(1 for o in in_split if o["res"] == "conflict")
        got = final.get(key)
        count = parse_counter(got[1]) if got else 0
        v.notes[key] = {"ok": ok, "unknown": unknown, "final": count}
        if in_split:
            v.notes[key]["in_split_brain"] = len(in_split)
            v.notes[key]["bounds"] = [low, high]
        if count is None or not low <= count <= high:
            v.fail("counter's final value is not its confirmed increments", key=key,
                   confirmed=ok, unknown=unknown, bounds=[low, high],
                   final=None if got is None else list(got))
    return v


# -- locks ------------------------------------------------------------------------


def check_fencing(history: Sequence[Record]) -> Verdict:
    """The fenced resource never accepted a lower token after a higher one, nor
    one token from two holders; no two acquisitions got the same token, and an
    acquisition that began after another had completed got a higher token."""
    v = Verdict("fencing")
    fences = sorted((r for r in _ops(history, "fence") if r.get("accepted")),
                    key=lambda r: int(r["n"]))
    top: Record | None = None
    for r in fences:
        v.checked += 1
        if top is not None and (int(r["token"]) < int(top["token"]) or (
                int(r["token"]) == int(top["token"]) and r["holder"] != top["holder"])):
            v.fail("the resource accepted a lower or shared token", before=top, after=r)
        if top is None or int(r["token"]) >= int(top["token"]):
            top = r
    windows = split_windows(history)
    acquired = [r for r in _ops(history, "acquire") if r.get("res") == "ok"]
    v.notes["acquired_in_split_brain"] = sum(
        1 for r in acquired if _in_split(windows, r["t0"], r["t1"]))
    acquired = [r for r in acquired if not _in_split(windows, r["t0"], r["t1"])]
    by_token: dict[int, Record] = {}
    for r in acquired:
        v.checked += 1
        tok = int(r["token"])
        if tok in by_token:
            v.fail("two lock holders with the same token", first=by_token[tok], second=r)
        by_token[tok] = r
    acquired.sort(key=lambda r: r["t1"])
    for a in acquired:
        for b in acquired:
            if a["t1"] < b["t0"] and int(b["token"]) <= int(a["token"]):
                v.fail("a later holder got a lower token", first=a, later=b)
    v.notes["refused_stale"] = sum(1 for r in _ops(history, "fence") if not r.get("accepted"))
    return v


def lock_overlaps(history: Sequence[Record]) -> Verdict:
    """Holds that overlapped in time (each holder between its acquire and its
    release): expected when a holder is paused past its lease, harmless when
    fenced; reported, never a failure."""
    v = Verdict("lock_overlaps")
    holds = []
    releases = {r["holder"]: r for r in _ops(history, "release")}
    for a in _ops(history, "acquire"):
        if a.get("res") != "ok":
            continue
        rel = releases.get(a["holder"])
        holds.append((a["t1"], rel["t0"] if rel else math.inf, a))
    holds.sort(key=lambda h: h[0])
    v.notes["overlaps"] = 0
    for i, (_s1, e1, a1) in enumerate(holds):
        v.checked += 1
        for s2, _e2, a2 in holds[i + 1:]:
            if s2 >= e1:
                break
            v.notes["overlaps"] += 1
            if len(v.examples) < MAX_EXAMPLES:
                v.examples.append({"what": "two holds overlapped", "first": a1, "second": a2,
                                   "seconds": round(min(e1, math.inf) - s2, 3)})
    return v


# -- leases -----------------------------------------------------------------------


def check_leases(history: Sequence[Record], bound: float) -> Verdict:
    """A dead owner's key goes within its ttl plus ``bound`` (the documented
    slack: docs/failover.md, a whole ttl from a promotion plus the failover),
    the deadline pushed back past every fault to the servers, every time
    without one active server, and every promotion that overlapped it; and no
    lease key is left in the final state."""
    v = Verdict("leases")
    final = _final(history)
    died = {r["proc"]: r["t0"] for r in _ops(history, "died")}
    faults = [(r["t0"], r["t1"]) for r in _ops(history, "fault") if r.get("server_fault")]
    # No one active (or both): nothing expires; and a promotion gives every
    # lease a whole ttl from then (docs/failover.md): both move the deadline too.
    marks = sorted((r["t0"], str(r.get("server", ""))) for r in _ops(history, "active"))
    for (t, who), (t2, _) in itertools.pairwise([*marks, (math.inf, "")]):
        if who in ("primary", "backup"):
            faults.append((t, t))
        else:
            faults.append((t, t2))
    deletes: dict[str, float] = {}
    for r in _ops(history, "update"):
        if r.get("value") is None and r["key"] not in deletes:
            deletes[r["key"]] = r["t1"]
    for op in _ops(history, "lease"):
        if op.get("res") != "ok" or op["proc"] not in died:
            continue
        v.checked += 1
        t_dead = died[op["proc"]]
        deadline = t_dead + float(op["ttl"]) + bound
        moved = True
        while moved:
            moved = False
            for s, e in faults:
                if s <= deadline and e > t_dead and e + float(op["ttl"]) + bound > deadline:
                    deadline, moved = e + float(op["ttl"]) + bound, True
        gone = deletes.get(op["key"])
        if final is not None and op["key"] in final:
            v.fail("a dead owner's lease key is still there at the end", op=op, died=t_dead)
        elif gone is not None and gone > deadline:
            v.fail("a dead owner's lease key went late", op=op, died=t_dead, deleted=gone,
                   deadline=deadline, late_s=round(gone - deadline, 3))
    return v


# -- watchers ---------------------------------------------------------------------


def check_watchers(history: Sequence[Record]) -> Verdict:
    """Every watcher sees a key's transitions in the same order, and misses none
    (a sequence of the key that someone saw or wrote, between two it saw) unless
    a resync came between, or within ``1 s`` after the second.  Gaps are not
    judged across or within a split brain (:func:`split_windows`)."""
    v = Verdict("watchers")
    # A delete learned from a snapshot has no sequence (0): nothing to order.
    updates = [r for r in _ops(history, "update") if r.get("seq")]
    per: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in sorted(updates, key=lambda r: r["t1"]):
        per[(r["proc"], r["key"])].append(r)
    windows = split_windows(history)

    def era(t: float) -> int:
        """Which stretch between split brains ``t`` is in: a split brain's heal
        can number a key lower than before it (docs/failover.md), so sequences
        are compared within one stretch only."""
        return sum(1 for _a, b in windows if b < t)

    known: dict[tuple[str, int], set[int]] = defaultdict(set)
    for r in history:
        if r.get("f") in ("update", "write", "cas") and r.get("seq") is not None and (
                r.get("f") == "update" or r.get("res") == "ok") and not _in_split(
                    windows, r["t0"], r.get("t1") or r["t0"]):
            known[(r["key"], era(r["t0"]))].add(int(r["seq"]))
    epochs: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for r in sorted(updates, key=lambda r: r["t1"]):
        epochs[r["proc"]].append((r["t1"], int(r.get("epoch", 0))))
    for r in _ops(history, "resync"):
        epochs[r["proc"]].append((r["t1"], int(r.get("epoch", 0))))
    for lst in epochs.values():
        lst.sort()

    def resynced(proc: str, a: Record, b: Record) -> bool:
        lo = int(a.get("epoch", 0))
        return any(e > lo for t, e in epochs[proc] if a["t1"] <= t <= b["t1"] + 1.0)

    # A transition is (sequence, value): in a split brain both servers number.
    orders: dict[str, dict[str, list[tuple[int, str]]]] = defaultdict(dict)
    for (proc, key), seen in per.items():
        seqs: list[tuple[int, str]] = []
        for r in seen:
            s = (int(r["seq"]), str(r.get("value")))
            # Resynced in a split brain, a watcher may be shown the other side's
            # older state: a transition seen again there is no new one (the
            # reverts check judges the going back).
            if s in seqs and _in_split(windows, r["t1"], r["t1"]):
                continue
            seqs.append(s)
        orders[key][proc] = seqs
        for a, b in itertools.pairwise(seen):
            sa, sb = int(a["seq"]), int(b["seq"])
            if sb <= sa or _in_split(windows, a["t1"], b["t1"]):
                continue
            ks = sorted(known[(key, era(a["t1"]))])
            lo = bisect.bisect_right(ks, sa)
            if lo < len(ks) and ks[lo] < sb:
                v.checked += 1
                if not resynced(proc, a, b):
                    v.fail("a watcher missed a transition without a resync", proc=proc,
                           key=key, missed=ks[lo], between=[a, b])
    for key, by_proc in orders.items():
        procs = sorted(by_proc)
        for i, p in enumerate(procs):
            for q in procs[i + 1:]:
                v.checked += 1
                common = set(by_proc[p]) & set(by_proc[q])
                op_ = [s for s in _dedup(by_proc[p]) if s in common]
                oq = [s for s in _dedup(by_proc[q]) if s in common]
                if op_ != oq:
                    v.fail("two watchers saw a key's transitions in different orders",
                           key=key, watchers=[p, q], orders=[op_[:20], oq[:20]])
    return v


def _dedup(seqs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    for s in seqs:
        if s not in out[-1:]:
            out.append(s)
    return out


# -- all of them ------------------------------------------------------------------

CHECKS = ("lost_writes", "reverts", "linearizable_cas", "cas_counters", "fencing",
          "lock_overlaps", "leases", "watchers")


def check_all(history: Sequence[Record], *, lease_bound: float,
              bound: int = DEFAULT_BOUND) -> dict[str, Verdict]:
    """Every check, by name (:data:`CHECKS`); ``lock_overlaps`` is information."""
    history = list(history)
    return {
        "lost_writes": check_lost_writes(history),
        "reverts": check_reverts(history),
        "linearizable_cas": check_linearizable(history, bound),
        "cas_counters": check_cas_counters(history),
        "fencing": check_fencing(history),
        "lock_overlaps": lock_overlaps(history),
        "leases": check_leases(history, lease_bound),
        "watchers": check_watchers(history),
    }
