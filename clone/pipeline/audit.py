"""The audit: states, changes, write rates and differences from the update history.

How this works: every input is a run of updates (one row per sequence, in
:data:`~clone.pipeline.history.HISTORY_COLUMNS`) that it holds *completely*
from one sequence to another, and perhaps the state at one sequence (a data
directory's ``kv`` table).  :func:`coverage` merges those spans into the one
range held without a hole, ending at the newest sequence held.

The state at sequence N is then exact in two cases, and refused otherwise
(:class:`~clone.pipeline.errors.HistoryIncomplete`, naming the oldest
sequence held):

- the history reaches back to sequence 1: the latest update at or before N of
  each key, deletes removed;
- a state at sequence B is held and every update between N and B is held:
  the keys no update between N and B touched are as in that state; a touched
  key is as its latest update at or before N -- which must be held too, since
  an update does not carry the value it replaced.  Going forward (N > B) that
  always holds; going back, a key first written before the oldest update held
  and changed after N is unknown, and the state is refused, with their count.

:func:`plan_state` makes the decision (plain Python); the rest are pure
DataFrame -> DataFrame transforms.

Write rates need the time each update was applied, which only a data
directory's log records (``at``); a history taken over the network has
none, so :func:`prefix_write_rates` leaves such updates out and the report
says so, while :func:`prefix_writes_per_block` counts writes per block of
sequences, which needs no time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from clone.pipeline.errors import HistoryIncomplete
from clone.pipeline.history import STATE_COLUMNS, HistorySpan

__all__ = [
    "Coverage",
    "coverage",
    "plan_state",
    "distinct_updates",
    "state_at",
    "key_changes",
    "prefix_write_rates",
    "prefix_writes_per_block",
    "state_diff",
    "key_prefix",
]


@dataclass(frozen=True, slots=True)
class Coverage:
    """Every update ``first``..``last`` is held; ``state_seq``: a state held
    inside that range (None: none), from which others can be derived."""

    first: int
    last: int
    state_seq: int | None

    def describe(self) -> str:
        if self.first > self.last:
            return f"no updates held; the state at {self.state_seq}"
        held = f"updates {self.first}..{self.last}"
        return held if self.state_seq is None else f"{held} and the state at {self.state_seq}"


def coverage(spans: Sequence[HistorySpan]) -> Coverage:
    """The range held without a hole that ends at the newest sequence held."""
    if not spans:
        raise ValueError("no inputs")
    last = max(s.last for s in spans)
    first = last + 1
    grown = True
    while grown:  # extend downwards through every span that overlaps or touches
        grown = False
        for s in spans:
            if s.first <= s.last and s.last >= first - 1 and s.first < first:
                first, grown = s.first, True
    states = [s.state_seq for s in spans if s.state_seq is not None and s.state_seq >= first - 1]
    return Coverage(first, last, max(states) if states else None)


def plan_state(cov: Coverage, at: int) -> int:
    """The sequence of the state to start from for the state at ``at`` (0:
    the empty state before sequence 1), or :class:`HistoryIncomplete`."""
    if at < 0:
        raise ValueError(f"a sequence is >= 0, not {at}")
    if at > cov.last:
        raise HistoryIncomplete(
            f"the state at {at} is after the newest update held ({cov.last}; {cov.describe()})"
        )
    if cov.first <= 1:
        return 0
    if cov.state_seq is None:
        raise HistoryIncomplete(
            f"the state at {at} cannot be reconstructed: the oldest update held is "
            f"{cov.first} (older ones were compacted away, see --history, or the export "
            f"starts there) and no state (a data directory's kv table) is held to start "
            f"from; audit a data directory, or export the history with --since 0"
        )
    if at < cov.first - 1:
        raise HistoryIncomplete(
            f"the state at {at} cannot be reconstructed: the oldest update held is "
            f"{cov.first}, so nothing at or before {cov.first - 1} can be undone "
            f"({cov.describe()})"
        )
    return cov.state_seq


def distinct_updates(updates: DataFrame) -> DataFrame:
    """One row per sequence (both servers' logs, or a log and an export, overlap).

    Copies of one update differ only in what their source knows: a data
    directory's has the time it was applied, a network export's has none.
    The copy with a time is kept, so that mixing the two never loses times."""
    return (
        updates.groupBy("seq")
        .agg(
            F.max_by(F.struct(*updates.columns), F.col("at").isNotNull().cast("int")).alias("u")
        )
        .select("u.*")
    )


def state_at(
    updates: DataFrame, base: DataFrame, base_seq: int, at: int, first: int
) -> tuple[DataFrame, DataFrame]:
    """``(state, unknown)``: the state at ``at`` from the state ``base`` at
    ``base_seq`` and the updates held from ``first`` on, and the keys whose
    value at ``at`` the history cannot tell (must be empty for the state to
    be exact; see the module's comment)."""
    lo, hi = min(at, base_seq), max(at, base_seq)
    held = updates.filter(F.col("seq") >= first)
    touched = held.filter((F.col("seq") > lo) & (F.col("seq") <= hi)).select("key").distinct()
    kept = base.join(touched, "key", "left_anti").select(*STATE_COLUMNS)
    latest = (
        held.filter(F.col("seq") <= at)
        .groupBy("key")
        .agg(F.max_by(F.struct("seq", "value", "uuid", "props", "deleted"), "seq").alias("u"))
        .select("key", "u.*")
    )
    resolved = touched.join(latest, "key", "left")
    unknown = resolved.filter(F.col("seq").isNull()).select("key")
    present = resolved.filter(F.col("seq").isNotNull() & ~F.col("deleted"))
    return kept.unionByName(present.select(*STATE_COLUMNS)), unknown


def key_changes(updates: DataFrame) -> DataFrame:
    """Every change of every key: who wrote it (uuid), when, a delete or not."""
    return updates.select(
        "key",
        "seq",
        "uuid",
        "at",
        "term",
        "deleted",
        F.coalesce(F.octet_length("value"), F.lit(0)).alias("size"),
        "props",
    )


def key_prefix(depth: int) -> Column:
    """The key up to its ``depth``-th ``/`` after a leading one (``/a/b/c`` at
    depth 1 is ``/a/``, at 2 ``/a/b/``); shallower keys give their parent."""
    if depth < 0:
        raise ValueError(f"prefix depth must be >= 0, not {depth}")
    return F.regexp_extract("key", f"^(/?(?:[^/]*/){{0,{depth}}})", 1)


def prefix_write_rates(updates: DataFrame, depth: int, window: float) -> DataFrame:
    """Writes per second per key prefix of ``depth``, per ``window`` seconds of
    the time the updates were applied (windows aligned to multiples of
    ``window`` since the epoch; deletes count as writes, and separately).

    Updates whose time is unknown (a history export taken over the network)
    are left out; a window in which a prefix had no write has no row."""
    if not window > 0:
        raise ValueError(f"rate window must be > 0 seconds, not {window}")
    start = F.floor(F.col("at") / F.lit(float(window))) * F.lit(float(window))
    return (
        updates.filter(F.col("at").isNotNull())
        .withColumn("prefix", key_prefix(depth))
        .withColumn("window_start", start.cast("double"))
        .groupBy("prefix", "window_start")
        .agg(
            F.count(F.lit(1)).alias("writes"),
            F.sum(F.col("deleted").cast("long")).alias("deletes"),
            F.countDistinct("key").alias("keys"),
        )
        .select(
            "prefix",
            "window_start",
            (F.col("window_start") + F.lit(float(window))).alias("window_end"),
            "writes",
            "deletes",
            "keys",
            (F.col("writes") / F.lit(float(window))).alias("writes_per_s"),
        )
        .orderBy("window_start", "prefix")
    )


def prefix_writes_per_block(updates: DataFrame, depth: int, bucket: int) -> DataFrame:
    """Writes and deletes per key prefix of ``depth`` per block of ``bucket``
    sequences (a count, not a rate: it needs no times), with the time the
    block's first and last write were applied (null when unknown)."""
    if bucket < 1:
        raise ValueError(f"bucket must be >= 1, not {bucket}")
    return (
        updates.withColumn("prefix", key_prefix(depth))
        .withColumn("bucket", (F.floor(F.col("seq") / bucket) * bucket).cast("long"))
        .groupBy("prefix", "bucket")
        .agg(
            F.count(F.lit(1)).alias("writes"),
            F.sum(F.col("deleted").cast("long")).alias("deletes"),
            F.countDistinct("key").alias("keys"),
            F.min("at").alias("first_at"),
            F.max("at").alias("last_at"),
        )
        .orderBy("bucket", "prefix")
    )


def state_diff(before: DataFrame, after: DataFrame) -> DataFrame:
    """Keys ``added``, ``removed`` or ``changed`` (value or properties) between two states."""
    b = before.select(
        "key",
        F.col("seq").alias("from_seq"),
        F.col("value").alias("from_value"),
        F.col("props").alias("from_props"),
    )
    a = after.select(
        "key",
        F.col("seq").alias("to_seq"),
        F.col("value").alias("to_value"),
        F.col("props").alias("to_props"),
        F.col("uuid").alias("to_uuid"),
    )
    status = (
        F.when(F.col("from_seq").isNull(), F.lit("added"))
        .when(F.col("to_seq").isNull(), F.lit("removed"))
        .when(
            ~F.col("from_value").eqNullSafe(F.col("to_value"))
            | ~F.col("from_props").eqNullSafe(F.col("to_props")),
            F.lit("changed"),
        )
    )
    return (
        b.join(a, "key", "full_outer")
        .withColumn("status", status)
        .filter(F.col("status").isNotNull())
        .select("key", "status", "from_seq", "to_seq", "from_value", "to_value", "to_uuid")
    )
