"""The drill's verdict: the guarantees every drill checks and each scenario's own.

Pure judgement over the summary :func:`.analysis.analyse` made and what the
run noted (its config, faults, restarts and the HUGZ monitor's history).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from clone.release import RELEASE
from clone.storage.schema import FORMAT_VERSION
from clone.tools.drill.analysis import (
    burst_writes,
    conflicts_told,
    late_heartbeats,
    lock_fencing,
    lock_holders,
    log_line_time,
    revert_detail,
    seen_revert_detail,
    split_brain_lines,
    split_writes,
    stepped_down_writes,
)
from clone.tools.drill.applied import WinnerHistory
from clone.tools.drill.pair import PairRun

__all__ = ["judge_partition", "judge_restarts", "judge_upgrade", "run_checks"]


def _log_since(run: PairRun, name: str, offset: int) -> str:
    with open(run.group[name].log_path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def judge_partition(
    run: PairRun,
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
    conflicted: Collection[str] = (),
) -> dict[str, Any]:
    """partition-*: what the pair did about the cut, from the servers' logs
    since the cut and the HUGZ monitor, and what became of the writes of any
    server that stepped down (:func:`.analysis.stepped_down_writes`)."""
    part = dict(run.notes["partition"])
    offsets = part.pop("log_offsets")
    part.pop("heal_offsets", None)
    heal = part.get("heal_ts")
    logs = {n: _log_since(run, n, offsets[n]) for n in run.servers}
    part["presumed_dead"] = {n: "presumed dead" in text for n, text in logs.items()}
    part["split_brain"] = {n: split_brain_lines(text) for n, text in logs.items()}
    part["stepped_down"] = [n for n, lines in part["split_brain"].items()
                            if any("we step down" in line for line in lines)]
    # How long after the heal each side logged the split brain: both sides must
    # hear each other, and a link that was cut resumes only when TCP retransmits.
    if heal is not None:
        part["split_brain_after_heal_s"] = {
            n: round(t - heal, 3) for n, lines in part["split_brain"].items()
            if lines and (t := log_line_time(lines[0])) is not None}
    part["became_active"] = {n: "now ACTIVE" in text for n, text in logs.items()}
    passive = part["passive"]
    part["passive_hugz_during_cut"] = len(run.monitor.hugz_after(
        passive, part["ts"], heal if heal is not None else float("inf")))
    part["passive_hugz_after_cut"] = len(run.monitor.hugz_after(passive, part["ts"]))
    if heal is not None:
        part["dual_active_after_heal_s"] = round(run.monitor.dual_active_seconds(heal), 3)
    part["writes_of_stepped_down"] = [stepped_down_writes(streams, server_state, n, conflicted)
                                      for n in part["stepped_down"]]
    # Loop stalls from the cut on: each server logs every heartbeat that ran
    # more than an interval late (the ms), and counts its worst in stats.
    part["late_heartbeats_after_cut_ms"] = {n: late_heartbeats(t) for n, t in logs.items()}
    if run.cfg.split_writes:
        part["split_burst"] = burst_writes(streams, server_state)
    if part["kind"] == "partition-split" and heal is not None:
        _judge_split(part, streams, server_state, conflicted, run.notes.get("winner_history"))
    return part


def _judge_split(
    part: dict[str, Any],
    streams: Mapping[str, Sequence[Mapping[str, Any]]],
    server_state: Mapping[str, bytes] | None,
    conflicted: Collection[str],
    history: WinnerHistory | None = None,
) -> None:
    """partition-split: what each side confirmed while both were active, and what
    became of every write the isolated side confirmed, from the cut to its
    step-down (or to the end, if it never stepped down); ``history``: what the
    winner's own history says it applied (:mod:`.applied`)."""
    active, passive, cut, heal = part["active"], part["passive"], part["ts"], part["heal_ts"]
    down = [t for line in part["split_brain"][active] if "we step down" in line
            and (t := log_line_time(line)) is not None]
    until = min(down, default=float("inf"))
    part["isolated_step_down_after_heal_s"] = round(until - heal, 3) if down else None
    part["winner_confirmed_during_split"] = sum(
        1 for events in streams.values() for ev in events
        if ev.get("event") == "write_confirmed" and ev.get("server") == passive
        and cut <= float(ev["ts"]) <= heal)
    part["split_writes"] = split_writes(streams, server_state, active, passive, cut, until, heal,
                                        conflicted, None if history is None else history.ids)
    part["winner_history"] = None if history is None else history.summary()
    # The loser's grants are out of the order from the cut on, not only until
    # its step-down line: it grants nothing once passive (it stays so to the
    # end of this scenario), so a hold a client logs as the loser's after that
    # line was granted before it and logged late (at load 25 a client logged
    # one after the step-down, and it broke the order against the winner's).
    part["lock_fencing"] = lock_fencing(streams, (active, cut, float("inf")))
    part["locks"] = lock_holders(streams, server_state)
    part["conflicts_told"] = conflicts_told(streams, conflicted)


def judge_restarts(run: PairRun) -> list[dict[str, Any]]:
    """Each restart, with whether it came back passive: it synced, its stats
    said passive, and it sent no HUGZ until it was stopped or meant to take over."""
    out = []
    for rec in run.restarts:
        hugz = run.monitor.hugz_after(rec["server"], rec["ts"], rec["until"])
        ok = rec["synced_s"] is not None and rec["stats"].get("role") == "passive" and not hugz
        out.append({**rec, "hugz_before_takeover": len(hugz), "came_back_passive": ok})
    return out


def judge_upgrade(run: PairRun) -> dict[str, Any]:
    """--upgrade-from: the versions at the start, mixed and at the end, the order the
    servers were upgraded in, and the copies each migration kept."""
    from clone.storage.schema import DATA_FILE

    release = run.release
    assert release is not None
    start = run.notes.get("upgrade_start", {})
    kept = {}
    for name in run.servers:
        old_format = (start.get(name) or {}).get("data_format")
        data = run.out / "data" / name
        kept[name] = {
            "old_format": old_format,
            "kept": sorted(p.name for p in data.glob(f"{DATA_FILE}.v*")) if data.is_dir() else [],
        }
    return {
        **release.summary(),
        "new_version": RELEASE,
        "new_format": FORMAT_VERSION,
        "start": start,
        "mixed": run.notes.get("upgrade_mixed"),
        "end": run.notes.get("upgrade_end", {}),
        "order": [r["server"] for r in run.restarts if r.get("upgraded")],
        "migrations": kept,
    }


def _upgrade_checks(up: dict[str, Any], check: Any) -> None:
    start, end = up["start"], up["end"]
    check("the pair started on the old release",
          bool(start) and all(v.get("version") == up["version"] for v in start.values()),
          f"{ {n: v.get('version') for n, v in start.items()} }, expected {up['version']}")
    check("both servers run the new release at the end",
          bool(end) and all(v.get("version") == up["new_version"]
                            and v.get("data_format") == up["new_format"] for v in end.values()),
          f"{ {n: (v.get('version'), v.get('data_format')) for n, v in end.items()} }, "
          f"expected ({up['new_version']}, {up['new_format']})")
    check("upgraded the backup first, then the primary",
          up["order"][:2] == ["backup", "primary"], " then ".join(up["order"]) or "none")
    bad = {n: m for n, m in up["migrations"].items()
           if (m["old_format"] or 1) < up["new_format"]
           and f"clone.db.v{m['old_format'] or 1}" not in m["kept"]}
    check("each data directory migrated with its old file kept", not bad,
          "; ".join(f"{n}: {m['kept']}" for n, m in up["migrations"].items()))


def run_checks(
    run: PairRun, s: dict[str, Any], end_active: list[str]
) -> dict[str, dict[str, Any]]:
    """Each check by name, ok or not with a detail; ``s`` is the summary so far
    (the freeze-active check adds ``dual_active_s`` and ``split_brain_detected``
    to it)."""
    checks: dict[str, dict[str, Any]] = {}

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks[name] = {"ok": bool(ok), "detail": detail}

    check("no confirmed write lost", s["confirmed_lost"] == 0,
          f"{s['confirmed_lost']} of {s['confirmed_writes']}"
          + (f" ({s['confirmed_conflicts']} kept as listed split-brain conflicts)"
             if s.get("confirmed_conflicts") else ""))
    check("clients converged", s["converged"],
          f"server {s['final_server'] or 'none answered'}, "
          f"{len(set(s['final_client_hashes'].values()))} distinct client hash(es)")
    check("no duplicate applied", s["duplicates"] == 0, str(s["duplicates"]))
    check("per-writer order kept", s["out_of_order"] == 0, str(s["out_of_order"]))
    check("one active server at the end", len(end_active) == 1, ",".join(end_active) or "none")
    sc = run.cfg.scenario
    st = s["servers"]
    if sc in ("kill-active", "kill-passive", "ttl-storm") and "restart_ts" in run.notes:
        name = run.notes["killed"]
        hugz = run.monitor.hugz_after(name, run.notes["restart_ts"])
        role = st.get(name, {}).get("role", "?")
        check(f"restarted {name} came back passive", not hugz and role == "passive",
              f"{len(hugz)} HUGZ after restart; stats role {role}")
    if sc == "freeze-active" and "thaw_ts" in run.notes:
        dual = run.monitor.dual_active_seconds(run.notes["thaw_ts"])
        s["dual_active_s"] = round(dual, 3)
        detected = any("split brain" in run.group[n].log_path.read_text(errors="replace")
                       for n in run.servers)
        s["split_brain_detected"] = detected
        check("split brain detected and resolved", detected and len(end_active) == 1,
              f"logged={detected}, both active for {dual:.2f} s after SIGCONT, "
              f"active at end: {','.join(end_active) or 'none'}")
    if sc == "ttl-storm":
        check("no ephemeral key outlived its ttl", s["ttl_leftover"] == 0,
              f"{s['ttl_leftover']} of {s['ttl_writes']} left")
    roles = {n: v.get("role") for n, v in st.items()}
    seqs = {n: v.get("sequence") for n, v in st.items()}
    if all(v.get("alive") and "sequence" in v for v in st.values()):
        # A passive's pending list holds client writes the active has not (yet)
        # republished; at the end there are none, and any it still holds would
        # be applied again when it takes over.
        pending = {n: v.get("pending") for n, v in st.items()}
        check("passive in step with active", len(set(seqs.values())) == 1
              and len({v.get("keys") for v in st.values()}) == 1
              and all(pending[n] == 0 for n, role in roles.items() if role != "active"),
              f"roles {roles}, seq {seqs}, keys { {n: v.get('keys') for n, v in st.items()} }, "
              f"pending {pending}")
    if run.cfg.shared_keys > 0:
        check("every key at its last confirmed value or later", s["reverted_keys"] == 0,
              revert_detail(s))
        check("no client saw a key go back", s["reverts_seen"] == 0, seen_revert_detail(s))
    if sc == "rolling-restart":
        restarts = s["restarts"]
        bad = [r for r in restarts if not r["came_back_passive"]]
        check("every restarted server came back passive", bool(restarts) and not bad,
              f"{len(restarts)} restarts, {len(bad)} not passive"
              + "".join(f"; {r['server']} at t={r['ts'] - run.t0:.1f} s: synced "
                        f"{r['synced_s']} s, role {r['stats'].get('role')}, "
                        f"{'running' if r['stats'].get('alive') else 'exited'}, "
                        f"{r['hugz_before_takeover']} HUGZ" for r in bad[:3]))
        rounds = s["rounds"]
        took = [r for r in rounds if r.get("takeover_s") is not None]
        check("the restarted passive took over every round",
              len(rounds) >= 2 and len(took) == len(rounds),
              f"{len(took)} of {len(rounds)} rounds, takeover in "
              f"{[r.get('takeover_s') for r in rounds]} s, pending at takeover "
              f"{[r.get('pending_at_takeover') for r in rounds]}")
    if sc == "both-crash" and "crash" in s:
        crash = s["crash"]
        check("the pair came back after both crashed", crash.get("served_by") is not None,
              f"{crash.get('served_by') or 'no server'} served after "
              f"{crash.get('recovery_s')} s; kills "
              + ", ".join(f"{k['server']} ({k['role']})" for k in crash["kills"]))
        before, served = crash.get("seq_seen_before"), crash.get("served_seq")
        # The restarted pair must go on from at least the highest sequence a
        # client saw before the crash: a lower one means it lost updates and
        # would hand their sequences out again.
        check("sequence never went backwards across the restart",
              served is not None and (before is None or served >= before),
              f"clients saw up to {before} before the crash; the pair served {served} after; "
              f"loaded {crash.get('loaded')}")
    if sc in ("partition-pair", "partition-active", "partition-split") and "partition" in s:
        _partition_checks(s, end_active, check)
    if "upgrade" in s:
        _upgrade_checks(s["upgrade"], check)
    if run.cfg.lock_clients > 0:
        # partition-split: the order leaves out what the stepped-down side granted
        # during the split brain (judge_partition).
        lf = s.get("partition", {}).get("lock_fencing") or s
        split = (f", {lf['lock_holds_split']} granted by the side that stepped down during"
                 " the split brain (not ordered)" if lf.get("lock_holds_split") else "")
        check("no two lock holders with the same or a lower token",
              lf["lock_holds"] > 0 and lf["lock_token_violations"] == 0,
              f"{lf['lock_holds']} holds{split}, {lf['lock_token_violations']} with a token"
              f" not above every earlier one, {lf['lock_overlaps']} overlapping an earlier"
              f" holder's (allowed with a higher token), {lf['lock_lost']} lost"
              + "".join(f"; {v}" for v in lf["lock_token_violation_examples"][:3]))
    if sc == "client-restart":
        check("every client has a final state",
              None not in s["final_client_hashes"].values(), "")
    return checks


def _partition_checks(s: dict[str, Any], end_active: list[str], check: Any) -> None:
    part = s["partition"]
    active, passive = part["active"], part["passive"]
    brain = {n: lines for n, lines in part["split_brain"].items() if lines}
    if part["kind"] == "partition-pair":
        # Both servers lose each other's heartbeat, but every client still hears
        # the active: nobody votes for the passive, and Binary Star never fails
        # over on silence alone.  So: no takeover, no split brain.
        check("the pair noticed the cut (peer presumed dead)", all(part["presumed_dead"].values()),
              f"{part['presumed_dead']}; rules: {len(part['rules'])} DROP on the HA ports")
        took = part["passive_hugz_after_cut"] or part["became_active"][passive] or brain
        check("no takeover without a client vote", not took and s["failovers_observed"] == 0
              and end_active == [active],
              f"{passive} sent {part['passive_hugz_after_cut']} HUGZ after the cut, "
              f"became active: {part['became_active'][passive]}; split brain logged: "
              f"{sorted(brain) or 'no'}; client failovers {s['failovers_observed']}; "
              f"active at end {','.join(end_active) or 'none'} (was {active})")
    else:
        check("clients failed over during the cut",
              part["passive_hugz_during_cut"] > 0 and s["failovers_observed"] > 0,
              f"{passive} sent {part['passive_hugz_during_cut']} HUGZ during the cut; "
              f"{s['failovers_observed']} client failovers")
        resolved = (active in part["stepped_down"] and len(end_active) == 1
                    and bool(brain))
        first = next(iter(brain.values()), [""])[0]
        first = first[first.find("split brain"):][:120]
        check("split brain detected and resolved", resolved,
              f"logged by {sorted(brain) or 'nobody'}, stepped down: "
              f"{part['stepped_down'] or 'nobody'} (isolated: {active}), logged "
              f"{part.get('split_brain_after_heal_s')} s after the heal; both sent HUGZ for "
              f"{part.get('dual_active_after_heal_s')} s after it; active at end "
              f"{','.join(end_active) or 'none'}" + (f"; {first}" if first else ""))
    if part["kind"] == "partition-split" and "split_writes" in part:
        _split_checks(part, check)
    if "split_burst" in part:
        _stall_checks(s, part, check)
    stepped = part["writes_of_stepped_down"]
    bad = [w for w in stepped if w["confirmed_by_lost"] or w["applied_missing_confirmed"]]
    check("writes of a server that stepped down: applied everywhere or never confirmed",
          not bad,
          "; ".join(f"{w['server']}: {w['confirmed_by']} confirmed by it, "
                    f"{w['confirmed_by_lost_count']} of them lost; {w['seen_applied']} applied "
                    f"by it as clients saw, {w['applied_missing']} missing at the end, "
                    f"{w['applied_missing_confirmed_count']} of those confirmed"
                    + (f", {w['kept_as_conflicts']} kept as listed conflicts"
                       if w.get("kept_as_conflicts") else "")
                    + (f" {w['confirmed_by_lost'][:3] or w['applied_missing_confirmed'][:3]}"
                       if w in bad else "")
                    for w in stepped) or "no server stepped down")


def loop_stalls(s: Mapping[str, Any], part: Mapping[str, Any]) -> dict[str, str]:
    """Each server's longest loop stall after the cut, as text: the largest late
    heartbeat it logged since (each one is over an interval), else its stats'
    running maximum if that grew after the cut, else "at most" the maximum it
    had at the cut (it did not grow: every stall since was shorter)."""
    out: dict[str, str] = {}
    at_cut = part.get("max_late_ms_at_cut", {})
    for name, late in part["late_heartbeats_after_cut_ms"].items():
        end = s["servers"].get(name, {}).get("heartbeat_max_late_ms")
        before = at_cut.get(name)
        if late:
            out[name] = f"{max(late)} ms"
        elif isinstance(end, int) and isinstance(before, int) and end > before:
            out[name] = f"{end} ms"
        elif isinstance(before, int):
            out[name] = f"<= {before} ms"
        else:
            out[name] = "unknown"
    return out


def _stall_checks(s: Mapping[str, Any], part: Mapping[str, Any], check: Any) -> None:
    burst = part["split_burst"]
    late = part["late_heartbeats_after_cut_ms"]
    stalls = ", ".join(f"{n} {v}" for n, v in loop_stalls(s, part).items())
    check("no loop stalled by more than a heartbeat after the cut",
          not any(late.values()),
          f"longest loop stall after the cut: {stalls} (heartbeat {s['heartbeat_ms']} ms); "
          f"late heartbeats logged: { {n: len(v) for n, v in late.items()} }; island burst "
          f"{burst['sent']} writes in {burst['seconds']} s, {burst['kept']} in the final state")


def _split_checks(part: dict[str, Any], check: Any) -> None:
    sw = part["split_writes"]
    active, passive = part["active"], part["passive"]
    check("both sides confirmed writes during the split",
          sw["confirmed"] > 0 and part["winner_confirmed_during_split"] > 0,
          f"{active} (isolated) confirmed {sw['confirmed']} {sw['by_client']} from the cut to "
          f"its step-down ({part['isolated_step_down_after_heal_s']} s after the heal); "
          f"{passive} confirmed {part['winner_confirmed_during_split']} from the cut to the heal")
    lost = [w for w in sw["writes"] if w["fate"] == "lost"]
    check("writes the isolated server confirmed during the split: applied or a listed conflict",
          not lost,
          f"{sw['confirmed']} confirmed by {active}: {sw['kept']} kept, {sw['overwritten']} "
          f"overwritten later, {sw['conflicts']} kept as conflicts by {passive}, "
          f"{sw['lost']} LOST; {sw['reached_winner']} reached {passive} "
          f"(first {sw['at_winner_first_s']} s, last {sw['at_winner_last_s']} s after the heal), "
          f"{sw['reapplied']} applied twice by a client"
          + "".join(f"; lost {w['key']} ({w['client']}, confirmed by {active} "
                    f"{w['confirmed_s']} s after the cut)" for w in lost[:3]))
    locks = part.get("locks")
    if locks is not None and (locks["taken"] or locks["keys"]):
        bad = locks["bad"]
        check("no lock has two holders after the heal", not bad,
              f"{locks['taken']} takes, {locks['lost']} lost at the heal; "
              + "; ".join(f"{k['key']}: held by {k['believed_by'] or 'nobody'} "
                          f"(server: {k['server_holder'] or 'absent'})"
                          for k in (bad or locks["keys"])[:4]))
    told = part.get("conflicts_told")
    if told is not None:
        check("every conflict of a confirmed write was told to its client", not told["missing"],
              f"expected {told['expected'] or 'none'}, told {told['told'] or 'none'}"
              + (f"; missing {told['missing']}" if told["missing"] else ""))
