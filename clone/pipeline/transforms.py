"""Pure DataFrame -> DataFrame steps of the pipeline jobs.

Every function here takes DataFrames (and plain parameters) and returns a
DataFrame; none reads, writes, collects or builds a session, so each one is
tested on a few literal rows.  Built-in column functions only: no Python UDF
runs anywhere in this module.

Three groups:

- **load**: :func:`with_reject_reason` decides, row by row, whether a row can be
  stored and why not; :func:`rejected_rows` and :func:`write_records` split the
  result;
- **export / audit**: :func:`snapshot_to_export`, :func:`export_to_updates`,
  :func:`state_at_sequence` (point-in-time reconstruction from update events)
  and :func:`state_differences` (compare two states);
- **drill analysis**: :func:`failover_gaps`, :func:`failover_percentiles`,
  :func:`client_delivery_stats`, :func:`run_convergence`, :func:`run_overview`,
  :func:`confirmed_write_rate`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    DataType,
    MapType,
    NumericType,
    StringType,
    StructType,
)

from clone.pipeline.errors import InputError
from clone.pipeline.sources import INPUT_FILE, INPUT_LINE, INPUT_REASON, INPUT_TEXT
from clone.wire.codec import RESERVED_KEYS
from clone.wire.protocol import MAX_KEY_BYTES, MAX_TTL_SECONDS, MAX_VALUE_BYTES

__all__ = [
    "LoadColumns",
    "REJECT_REASON",
    "with_client_life",
    "with_reject_reason",
    "rejected_rows",
    "write_records",
    "snapshot_to_export",
    "export_to_updates",
    "drill_events_to_updates",
    "state_at_sequence",
    "state_differences",
    "failover_gaps",
    "failover_percentiles",
    "client_delivery_stats",
    "run_convergence",
    "run_overview",
    "confirmed_write_rate",
    "fault_marks",
]

REJECT_REASON = "reject_reason"
# Internal columns of the load transform; dropped before anything is written.
_KEY = "__clone_key"
_VALUE = "__clone_value"
_TTL = "__clone_ttl"
_DUPES = "__clone_dupes"
_INPUT_REASON = INPUT_REASON
# The server's rule for a ttl given as text (clone.server.ttl.parse_ttl).
_DECIMAL_RE = r"^(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)$"
_PERCENTILES = (0.5, 0.9, 0.99)
# Keys every drill client overwrites on purpose (clone.tools.drill.client.SHARED_PREFIX).
# Many writes to one key: a client rightly misses the ones overwritten while it
# resynced, and sees an older sequence after a failover that lost an
# unconfirmed write, so the per-write counts below leave them out; the drill
# judges those keys itself (docs/drills.md).
_OVERWRITTEN_PREFIX = "/drill/shared/"


@dataclass(frozen=True, slots=True)
class LoadColumns:
    """Which input columns hold the key, the value and (optionally) the ttl,
    and the subtree every key must lie in ('' = anywhere)."""

    key: str = "key"
    value: str = "value"
    ttl: str | None = None
    subtree: str = ""


# --------------------------------------------------------------------------
# Load


def _as_text(col: Column, dtype: DataType, what: str) -> Column:
    """A key column as text.  Binary is reinterpreted byte for byte (so invalid
    UTF-8 stays detectable); numbers and the like are formatted."""
    if isinstance(dtype, StringType | BinaryType):
        return col.cast("string")
    if isinstance(dtype, StructType | ArrayType | MapType):
        raise InputError(f"{what} has type {dtype.simpleString()}, which cannot be a key")
    return col.cast("string")


def _as_bytes(col: Column, dtype: DataType) -> Column:
    """A value column as bytes: binary as is, text as UTF-8, nested types as
    JSON, anything else in its text form."""
    if isinstance(dtype, BinaryType):
        return col
    if isinstance(dtype, StructType | ArrayType | MapType):
        return F.encode(F.to_json(col), "UTF-8")
    return F.encode(col.cast("string"), "UTF-8")


def _as_ttl(col: Column, dtype: DataType, what: str) -> tuple[Column, Column]:
    """(ttl as a double, the reason it is unusable or null)."""
    limit = f"{MAX_TTL_SECONDS:.0f}"
    if isinstance(dtype, StringType):
        text = F.trim(col)
        seconds = text.try_cast("double")
        bad = (
            F.when(col.isNull(), F.lit(None))
            .when(
                ~text.rlike(_DECIMAL_RE),
                F.concat(
                    F.lit("ttl '"),
                    F.substring(col, 1, 40),
                    F.lit("' is not a decimal number of seconds"),
                ),
            )
            .when(
                seconds > MAX_TTL_SECONDS,
                F.concat(F.lit("ttl "), text, F.lit(f" is over the {limit}-second limit")),
            )
        )
        return seconds, bad
    if isinstance(dtype, NumericType):
        seconds = col.cast("double")
        bad = (
            F.when(col.isNull(), F.lit(None))
            .when(F.isnan(seconds), F.lit("ttl is not a number"))
            .when(
                seconds < 0, F.concat(F.lit("ttl "), seconds.cast("string"), F.lit(" is negative"))
            )
            .when(
                seconds > MAX_TTL_SECONDS,
                F.concat(
                    F.lit("ttl "),
                    seconds.cast("string"),
                    F.lit(f" is over the {limit}-second limit"),
                ),
            )
        )
        return seconds, bad
    raise InputError(f"{what} has type {dtype.simpleString()}; a ttl must be a number or text")


def with_reject_reason(df: DataFrame, cols: LoadColumns) -> DataFrame:
    """``df`` with a ``reject_reason`` column: null when the row can be stored,
    otherwise the first rule it breaks, in words.

    The rules are the server's (``docs/protocol.md``): a key is 1 to
    ``MAX_KEY_BYTES`` bytes of valid UTF-8 and not a reserved word; a value is
    at most ``MAX_VALUE_BYTES`` and not empty (an empty value would delete the
    key); a ttl is a decimal number of seconds from 0 to one year.  On top,
    a key must lie in ``cols.subtree`` and appear once in the input, since two
    rows for one key would race and the survivor would be arbitrary.
    """
    schema = {f.name: f.dataType for f in df.schema.fields}
    for name in (cols.key, cols.value, cols.ttl):
        if name is not None and name not in schema:
            added = {INPUT_FILE, INPUT_LINE, INPUT_TEXT, INPUT_REASON}
            given = [c for c in df.columns if c not in added]
            raise InputError(f"input has no column {name!r} (columns: {', '.join(given)})")
    key = _as_text(F.col(cols.key), schema[cols.key], f"key column {cols.key!r}")
    value = _as_bytes(F.col(cols.value), schema[cols.value])
    if cols.ttl is not None:
        ttl, ttl_reason = _as_ttl(F.col(cols.ttl), schema[cols.ttl], f"ttl column {cols.ttl!r}")
    else:
        ttl, ttl_reason = F.lit(0.0), F.lit(None).cast("string")

    staged = (
        df.withColumn(_KEY, key)
        .withColumn(_VALUE, value)
        .withColumn(_TTL, F.coalesce(ttl, F.lit(0.0)))
    )
    staged = staged.withColumn(
        _DUPES,
        F.when(F.col(_KEY).isNull(), F.lit(1)).otherwise(
            F.count(F.lit(1)).over(Window.partitionBy(_KEY))
        ),
    )
    k, v = F.col(_KEY), F.col(_VALUE)
    key_bytes, value_bytes = F.octet_length(k), F.octet_length(v)
    # The reader's verdict first (a CSV record with the wrong field count, bytes
    # that are not UTF-8, a JSON line that is not JSON): its columns are null.
    if _INPUT_REASON in schema:
        first = F.when(F.col(_INPUT_REASON).isNotNull(), F.col(_INPUT_REASON)).when(
            k.isNull(), F.lit("key is null")
        )
    else:
        first = F.when(k.isNull(), F.lit("key is null"))
    reason = (
        first
        .when(~F.is_valid_utf8(k), F.lit("key is not valid UTF-8"))
        .when(key_bytes == 0, F.lit("key is empty"))
        .when(
            key_bytes > MAX_KEY_BYTES,
            F.concat(
                F.lit("key is "),
                key_bytes.cast("string"),
                F.lit(f" bytes, over the {MAX_KEY_BYTES}-byte limit"),
            ),
        )
        .when(k.isin(*sorted(RESERVED_KEYS)), F.concat(F.lit("key '"), k, F.lit("' is reserved")))
        .when(
            F.lit(bool(cols.subtree)) & ~k.startswith(cols.subtree),
            F.lit(f"key is outside subtree '{cols.subtree}'"),
        )
        .when(
            F.col(_DUPES) > 1,
            F.concat(
                F.lit("key appears "), F.col(_DUPES).cast("string"), F.lit(" times in the input")
            ),
        )
        .when(v.isNull(), F.lit("value is null"))
        .when(value_bytes == 0, F.lit("value is empty (an empty value deletes the key)"))
        .when(
            value_bytes > MAX_VALUE_BYTES,
            F.concat(
                F.lit("value is "),
                value_bytes.cast("string"),
                F.lit(f" bytes, over the {MAX_VALUE_BYTES}-byte limit"),
            ),
        )
        .otherwise(ttl_reason)
    )
    return staged.withColumn(REJECT_REASON, reason).drop(_DUPES, _INPUT_REASON)


def rejected_rows(checked: DataFrame) -> DataFrame:
    """The input rows that cannot be stored, with their ``reject_reason``."""
    return checked.filter(F.col(REJECT_REASON).isNotNull()).drop(_KEY, _VALUE, _TTL)


def write_records(checked: DataFrame) -> DataFrame:
    """The rows to write, as ``key`` (string), ``value`` (binary), ``ttl`` (double, 0 = none)."""
    return checked.filter(F.col(REJECT_REASON).isNull()).select(
        F.col(_KEY).alias("key"), F.col(_VALUE).alias("value"), F.col(_TTL).alias("ttl")
    )


# --------------------------------------------------------------------------
# Export and audit


def snapshot_to_export(snapshot: DataFrame) -> DataFrame:
    """Snapshot rows (key, value, sequence, uuid, properties) with ``ttl``
    (seconds, 0 = none) and ``expires`` (Unix seconds or null) from their
    properties."""
    props = F.col("properties")
    return snapshot.select(
        "key",
        "value",
        "sequence",
        "uuid",
        "properties",
        F.coalesce(props.getItem("ttl").try_cast("double"), F.lit(0.0)).alias("ttl"),
        props.getItem("expires").try_cast("double").alias("expires"),
    )


def export_to_updates(export: DataFrame, ts: float | None) -> DataFrame:
    """An export as update events: each key's last update, stamped ``ts``."""
    return export.select(
        "key", "value", "sequence", "uuid", "properties", F.lit(ts).cast("double").alias("ts")
    )


def drill_events_to_updates(events: DataFrame) -> DataFrame:
    """The ``update`` events of drill logs as update events (no values: the
    drill logs keys, sequences and uuids only), one per distinct sequence."""
    return (
        events.filter(
            (F.col("event") == "update") & F.col("key").isNotNull() & F.col("seq").isNotNull()
        )
        .groupBy("key", F.col("seq").alias("sequence"))
        .agg(F.min_by("uuid", "ts").alias("uuid"), F.min("ts").alias("ts"))
        .select(
            "key",
            F.lit(None).cast("binary").alias("value"),
            "sequence",
            "uuid",
            F.create_map().cast("map<string,string>").alias("properties"),
            "ts",
        )
    )


def state_at_sequence(updates: DataFrame, sequence: int | None = None) -> DataFrame:
    """The store as it was after update ``sequence`` (None = after the last).

    Point-in-time reconstruction: for each key, the update with the highest
    sequence not above ``sequence``; keys whose last such update is a delete
    (empty value) are gone.  Works on any update-event source.
    """
    if sequence is not None:
        updates = updates.filter(F.col("sequence") <= sequence)
    latest = updates.groupBy("key").agg(
        F.max_by(F.struct("value", "sequence", "uuid", "properties", "ts"), "sequence").alias("u")
    )
    return latest.select("key", "u.*").filter(
        F.col("value").isNull() | (F.octet_length("value") > 0)
    )


def state_differences(left: DataFrame, right: DataFrame) -> DataFrame:
    """Keys whose value or sequence differ between two states (each with
    ``key``, ``value``, ``sequence``), and keys present on one side only.

    ``difference`` is ``only_left``, ``only_right``, ``value`` or ``sequence``.
    An empty result means the states are equal.
    """
    lsel = left.select(
        "key", F.col("value").alias("left_value"), F.col("sequence").alias("left_sequence")
    )
    rsel = right.select(
        "key", F.col("value").alias("right_value"), F.col("sequence").alias("right_sequence")
    )
    joined = lsel.join(rsel, "key", "full_outer")
    difference = (
        F.when(F.col("right_sequence").isNull(), F.lit("only_left"))
        .when(F.col("left_sequence").isNull(), F.lit("only_right"))
        .when(~F.col("left_value").eqNullSafe(F.col("right_value")), F.lit("value"))
        .when(F.col("left_sequence") != F.col("right_sequence"), F.lit("sequence"))
    )
    return joined.withColumn("difference", difference).filter(F.col("difference").isNotNull())


# --------------------------------------------------------------------------
# Drill analysis


def failover_gaps(events: DataFrame) -> DataFrame:
    """One row per client failover: run, scenario, client, ts, gap_s, from, to."""
    return events.filter((F.col("event") == "failover_done") & F.col("gap_s").isNotNull()).select(
        "run", "scenario", "client", "ts", "gap_s", "from", "to"
    )


def failover_percentiles(gaps: DataFrame) -> DataFrame:
    """Failover time per scenario: count, p50, p90, p99 (exact, linear
    interpolation between ranks), max and mean, in seconds."""
    return (
        gaps.groupBy("scenario")
        .agg(
            F.countDistinct("run").alias("runs"),
            F.count("gap_s").alias("failovers"),
            *[F.percentile("gap_s", F.lit(p)).alias(f"p{round(p * 100)}_s") for p in _PERCENTILES],
            F.max("gap_s").alias("max_s"),
            F.mean("gap_s").alias("mean_s"),
        )
        .orderBy("scenario")
    )


def with_client_life(events: DataFrame) -> DataFrame:
    """Add ``life``: how many times the harness had restarted this event's client
    by then.  A restarted client is a new process under the same id: it starts a
    new stream and legitimately receives the snapshot again, so duplicates and
    ordering are judged per life, not per id."""
    restarts = events.filter((F.col("event") == "restart") & F.col("target").isNotNull()).select(
        "run", F.col("target").alias("client"), F.col("ts").alias("restart_ts")
    )
    lives = (
        events.select("run", "client", "line", "ts")
        .join(restarts, ["run", "client"], "inner")
        .groupBy("run", "line")
        .agg(F.count_if(F.col("restart_ts") <= F.col("ts")).alias("life"))
    )
    return events.join(lives, ["run", "line"], "left").fillna(0, subset=["life"])


def _observed(events: DataFrame, *by: str) -> DataFrame:
    """update events with a uuid: (run, client, *by, uuid, n) = times applied."""
    return (
        events.filter(
            (F.col("event") == "update") & F.col("uuid").isNotNull() & (F.col("uuid") != "")
        )
        .groupBy("run", "client", *by, "uuid")
        .agg(F.count(F.lit(1)).alias("n"))
    )


def _per_write(events: DataFrame) -> DataFrame:
    """Events without those of overwritten keys: what per-write counts can judge."""
    key = F.col("key")
    return events.filter(key.isNull() | ~key.startswith(_OVERWRITTEN_PREFIX))


def client_delivery_stats(events: DataFrame) -> DataFrame:
    """Per run and client: what it wrote, what it received and what went wrong.

    Writes and updates of the keys a drill overwrites on purpose (under
    ``/drill/shared/``) are left out of every count: a key written once per
    write is what makes a write "lost" or "out of order" decidable here.

    - ``writes_sent``, ``writes_confirmed``, ``write_timeouts``: its own writes;
    - ``updates``: KVPUBs it applied; ``failovers``: its ``failover_done`` events;
    - ``duplicates``: updates whose uuid it had already applied (in the same
      process: a restarted client starts afresh, see :func:`with_client_life`);
    - ``out_of_order``: updates (other than duplicates) of a key whose sequence
      is not above every sequence it applied before for that key (same process);
    - ``confirmed_lost``: writes confirmed (by any client of the run) whose uuid
      this client never applied; ``unconfirmed_lost``: the same for writes sent
      but never confirmed.  Both are null for a client that applied nothing
      (a writer without a subscription, or the harness).
    """
    events = _per_write(events)
    ev = F.col("event")
    per_client = (
        events.filter(F.col("client").isNotNull() & (F.col("client") != "drill"))
        .groupBy("run", "scenario", "client")
        .agg(
            F.count_if(ev == "write_sent").alias("writes_sent"),
            F.count_if(ev == "write_confirmed").alias("writes_confirmed"),
            F.count_if(ev == "write_timeout").alias("write_timeouts"),
            F.count_if(ev == "update").alias("updates"),
            F.count_if(ev == "failover_done").alias("failovers"),
        )
    )

    lived = with_client_life(events)
    duplicates = (
        _observed(lived, "life")
        .groupBy("run", "client")
        .agg(F.sum(F.col("n") - 1).alias("duplicates"))
    )
    observed = _observed(events)

    # Order per key: a client must never apply an older update of a key after a
    # newer one.  (Per key, not across keys: after a resync the client reports
    # the keys that changed in key order, whatever their sequences.)  A
    # redelivered uuid is a duplicate, counted above, not also out of order.
    before = (
        Window.partitionBy("run", "client", "life", "key")
        .orderBy("ts", "line")
        .rowsBetween(Window.unboundedPreceding, -1)
    )
    first_time = Window.partitionBy("run", "client", "life", "uuid").orderBy("ts", "line")
    repeat = (
        F.col("uuid").isNotNull() & (F.col("uuid") != "") & (F.row_number().over(first_time) > 1)
    )
    ordered = (
        # Sequence 0 is "unknown": a key found gone when a resync's snapshot
        # replaced the map has no update of its own to order.
        lived.filter((ev == "update") & (F.col("seq") > 0) & F.col("key").isNotNull())
        .withColumn("prev_max", F.max("seq").over(before))
        .withColumn("repeat", repeat)
        .groupBy("run", "client")
        .agg(
            F.count_if((F.col("seq") <= F.col("prev_max")) & ~F.col("repeat")).alias("out_of_order")
        )
    )

    # Lost writes: every write of the run against every client that applied something.
    writes = (
        events.filter(ev.isin("write_sent", "write_confirmed") & F.col("uuid").isNotNull())
        .groupBy("run", "uuid")
        .agg(F.max(F.when(ev == "write_confirmed", 1).otherwise(0)).alias("confirmed"))
    )
    observers = observed.select("run", "client").distinct()
    lost = (
        writes.join(observers, "run")
        .join(observed, ["run", "client", "uuid"], "left_anti")
        .groupBy("run", "client")
        .agg(
            F.count_if(F.col("confirmed") == 1).alias("confirmed_lost"),
            F.count_if(F.col("confirmed") == 0).alias("unconfirmed_lost"),
        )
    )
    lost_or_zero = observers.join(lost, ["run", "client"], "left").fillna(
        0, subset=["confirmed_lost", "unconfirmed_lost"]
    )
    return (
        per_client.join(duplicates, ["run", "client"], "left")
        .join(ordered, ["run", "client"], "left")
        .join(lost_or_zero, ["run", "client"], "left")
        .fillna(0, subset=["duplicates", "out_of_order"])
        .orderBy("run", "client")
    )


def run_convergence(events: DataFrame) -> DataFrame:
    """Per run: how many clients reported a final state, how many distinct
    hashes they reported, key counts, and ``converged`` (exactly one hash)."""
    finals = events.filter(F.col("event") == "final_state")
    latest = finals.groupBy("run", "client").agg(
        F.max_by(F.struct("hash", "keys"), F.struct("ts", "line")).alias("f")
    )
    return latest.groupBy("run").agg(
        F.count(F.lit(1)).alias("final_states"),
        F.countDistinct("f.hash").alias("distinct_hashes"),
        F.min("f.keys").alias("min_keys"),
        F.max("f.keys").alias("max_keys"),
        (F.countDistinct("f.hash") == 1).alias("converged"),
    )


def run_overview(events: DataFrame) -> DataFrame:
    """One row per run: scenario, clients, faults, failover p50/p99/max,
    confirmed writes, lost (confirmed and unconfirmed, distinct writes missed
    by at least one client), duplicates, out-of-order, converged.  Like
    :func:`client_delivery_stats`, it leaves out the overwritten keys."""
    events = _per_write(events)
    stats = client_delivery_stats(events)
    gaps = (
        failover_gaps(events)
        .groupBy("run")
        .agg(
            F.percentile("gap_s", F.lit(0.5)).alias("failover_p50_s"),
            F.percentile("gap_s", F.lit(0.99)).alias("failover_p99_s"),
            F.max("gap_s").alias("failover_max_s"),
        )
    )
    faults = events.groupBy("run").agg(F.count_if(F.col("event") == "fault").alias("faults"))
    observed = _observed(events)
    observers = observed.select("run", "client").distinct()
    writes = (
        events.filter(
            F.col("event").isin("write_sent", "write_confirmed") & F.col("uuid").isNotNull()
        )
        .groupBy("run", "uuid")
        .agg(F.max(F.when(F.col("event") == "write_confirmed", 1).otherwise(0)).alias("confirmed"))
    )
    missed = (
        writes.join(observers, "run")
        .join(observed, ["run", "client", "uuid"], "left_anti")
        .select("run", "uuid", "confirmed")
        .distinct()
        .groupBy("run")
        .agg(
            F.count_if(F.col("confirmed") == 1).alias("confirmed_lost"),
            F.count_if(F.col("confirmed") == 0).alias("unconfirmed_lost"),
        )
    )
    totals = stats.groupBy("run", "scenario").agg(
        F.count(F.lit(1)).alias("clients"),
        F.sum("writes_confirmed").alias("confirmed_writes"),
        F.sum("duplicates").alias("duplicates"),
        F.sum("out_of_order").alias("out_of_order"),
    )
    return (
        totals.join(faults, "run", "left")
        .join(gaps, "run", "left")
        .join(missed, "run", "left")
        .join(run_convergence(events), "run", "left")
        .fillna(0, subset=["confirmed_lost", "unconfirmed_lost", "faults"])
        .select(
            "run",
            "scenario",
            "clients",
            "faults",
            "failover_p50_s",
            "failover_p99_s",
            "failover_max_s",
            "confirmed_writes",
            "confirmed_lost",
            "unconfirmed_lost",
            "duplicates",
            "out_of_order",
            "converged",
        )
        .orderBy("scenario", "run")
    )


def confirmed_write_rate(events: DataFrame, bucket_s: float = 0.5) -> DataFrame:
    """Confirmed writes per second over time, per run, in ``bucket_s`` buckets
    (``t`` in seconds from the run's first event), for the timeline plot."""
    start = events.groupBy("run").agg(F.min("ts").alias("t0"))
    return (
        events.filter(F.col("event") == "write_confirmed")
        .join(start, "run")
        .withColumn("t", F.floor((F.col("ts") - F.col("t0")) / bucket_s) * bucket_s)
        .groupBy("run", "scenario", "t")
        .agg((F.count(F.lit(1)) / bucket_s).alias("rate"))
        .orderBy("run", "t")
    )


def fault_marks(events: DataFrame) -> DataFrame:
    """Faults and restarts the harness injected: run, ``t`` (seconds from the
    run's first event), ``event``, ``kind``, ``target``."""
    start = events.groupBy("run").agg(F.min("ts").alias("t0"))
    return (
        events.filter(F.col("event").isin("fault", "restart"))
        .join(start, "run")
        .select("run", (F.col("ts") - F.col("t0")).alias("t"), "event", "kind", "target")
        .orderBy("run", "t")
    )
