"""Confirmed writes from a Spark executor, a bounded number in flight.

How this works: each partition opens its own
:class:`clone.client.writeonly.WriteOnlyClone`: a client that keeps no copy
of the store (no snapshot, whatever the store's size), hears the servers'
HUGZ only, and sends each row as a ``set`` call that the active server
answers once the update is committed.  So a partition starts writing as soon
as it has heard one heartbeat, and a load puts no snapshot pressure on the
pair (at a million rows: eight partitions each copying a 1.1M-key store first).

The partition's one thread keeps up to ``max_in_flight`` writes outstanding;
their futures (completed by the client's I/O thread) report back on a
queue, which is also where a full window waits.  No worker threads, no
semaphore: more threads would only fight over the GIL.  Across a failover
the client sends unanswered writes to the new active server by itself (same
uuid, the servers deduplicate); a write that still times out is tried again
with a fresh uuid up to ``attempts`` times.  When no server has sent a
heartbeat for ``dead_after`` seconds every unanswered write fails at once;
after ``max_failures`` rows failed for good, the partition stops taking new
rows and counts the rest as failed, so a dead pair ends the job in seconds.

:func:`write_partition` is plain Python over an iterator of rows (tests drive
it with a fake client); :func:`arrow_partition_writer` adapts it to Spark's
``mapInArrow``.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from clone.errors import CloneError, ConfirmTimeout

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "WriterConfig",
    "PartitionResult",
    "RESULT_SCHEMA",
    "ClientLike",
    "write_partition",
    "arrow_partition_writer",
]

log = logging.getLogger(__name__)

#: One row per partition, as mapInArrow returns it.
RESULT_SCHEMA = (
    "partition long, rows long, written long, failed long, retries long, skipped long, "
    "seconds double, error string, confirmed_through string"
)

Row = tuple[str, bytes, float]


class ClientLike(Protocol):
    """What the writer needs of :class:`clone.client.writeonly.BulkWriter`."""

    @property
    def outstanding(self) -> int: ...  # writes sent and not yet settled

    def wait_synced(self, timeout: float = ...) -> None: ...

    def submit(self, key: str, value: bytes | str, ttl: float = ...) -> bytes: ...

    def poll(self, timeout: float) -> list[tuple[bytes, int | BaseException]]: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class WriterConfig:
    """How a partition connects and writes (pickled to the executors)."""

    servers: tuple[str, ...]
    #: The load's --subtree (the write-only client subscribes to HUGZ only:
    #: the keys were checked against it when the rows were validated).
    subtree: str | None = None
    #: 256: a quarter less server CPU per row than 64 (bigger turns, fewer
    #: commits per row); measured in docs/benchmarks.md.
    max_in_flight: int = 256
    #: Rows per ``set-many`` call (0: a ``set`` call per row); measured in
    #: docs/benchmarks.md.
    batch_rows: int = 64
    confirm_timeout: float = 30.0
    attempts: int = 3
    max_failures: int = 10
    heartbeat: float = 1.0
    #: Seconds to wait for the first heartbeat of an active server.
    sync_timeout: float = 30.0
    #: Seconds without a heartbeat from any server after which the pair is
    #: taken for dead and every unanswered write fails.
    dead_after: float = 10.0
    #: Resuming: per partition, the key through which every row was confirmed
    #: by an earlier run (rows come sorted by key: those up to it are skipped).
    resume: tuple[tuple[int, str], ...] = ()
    #: CURVE: the client's secret certificate and the server's public one, as
    #: paths (never the keys themselves: they would travel inside the tasks).
    curve_secret: str | None = None
    server_key: str | None = None


def executor_curve_files(config: WriterConfig) -> tuple[str | None, str | None]:
    """The CURVE files on this executor: the driver's paths if they exist here
    (local mode, a shared file system), else ``$CLONE_CURVE_SECRET`` and
    ``$CLONE_SERVER_KEY`` of the executor (``spark.executorEnv.*`` pointing
    at the copies ``--files`` put in its working directory)."""
    import os

    from clone.client.frontend import default_curve_files

    given = (config.curve_secret, config.server_key)
    if given == (None, None):
        return given
    if all(path is not None and os.path.exists(path) for path in given):
        return given
    env = default_curve_files()
    if env != (None, None):
        return env
    return given  # Clone says which file is missing


@dataclass(slots=True)
class PartitionResult:
    """What one partition did."""

    partition: int
    rows: int = 0
    written: int = 0
    failed: int = 0
    retries: int = 0
    skipped: int = 0
    seconds: float = 0.0
    error: str | None = None
    #: Every row of the partition up to this key (rows come in key order) was
    #: confirmed, by this run or the one resumed; None: none yet.
    confirmed_through: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "rows": self.rows,
            "written": self.written,
            "failed": self.failed,
            "retries": self.retries,
            "skipped": self.skipped,
            "seconds": self.seconds,
            "error": self.error,
            "confirmed_through": self.confirmed_through,
        }


def _default_client(config: WriterConfig) -> ClientLike:
    from clone.client.frontend import load_curve_keys
    from clone.client.writeonly import BulkWriter

    curve_secret, server_key = executor_curve_files(config)
    return BulkWriter(
        list(config.servers),
        curve=load_curve_keys(curve_secret, server_key),
        # At least half a second of silence before failing over: with a fast
        # heartbeat a busy executor would otherwise fail over by accident.
        server_timeout=max(2.5 * config.heartbeat, 0.5),
        confirm_timeout=config.confirm_timeout,
        dead_after=config.dead_after,
        batch_rows=config.batch_rows,
    )


class _Slot:
    """A row's place in the partition's order, for the confirmed-through mark."""

    __slots__ = ("done", "key")

    def __init__(self, key: str) -> None:
        self.key = key
        self.done = False


#: How long one wait for answers lasts before the loop looks again.
_POLL_S = 1.0


class _Window:
    """At most ``max_in_flight`` writes outstanding, settled as answers come."""

    def __init__(self, client: ClientLike, config: WriterConfig, result: PartitionResult) -> None:
        self._client = client
        self._config = config
        self._result = result
        self._writes: dict[bytes, tuple[Row, int, _Slot]] = {}
        self._order: deque[_Slot] = deque()

    def submit(self, row: Row, attempt: int = 1, slot: _Slot | None = None) -> None:
        key, value, ttl = row
        if slot is None:
            slot = _Slot(key)
            self._order.append(slot)
        try:
            uuid = self._client.submit(key, value, ttl)
        except (CloneError, ValueError, TypeError) as exc:  # closed client, bad row
            self._fail(key, exc)
            return
        self._writes[uuid] = (row, attempt, slot)

    def wait_for_room(self) -> None:
        while self._client.outstanding >= self._config.max_in_flight:
            self._settle(self._client.poll(_POLL_S))

    def drain(self) -> None:
        while self._writes:
            self._settle(self._client.poll(_POLL_S))

    def _settle(self, settled: list[tuple[bytes, int | BaseException]]) -> None:
        result = self._result
        for uuid, outcome in settled:
            entry = self._writes.pop(uuid, None)
            if entry is None:
                continue
            row, attempt, slot = entry
            if not isinstance(outcome, BaseException):
                result.written += 1
                slot.done = True
                continue
            config = self._config
            if isinstance(outcome, ConfirmTimeout) and attempt < config.attempts:
                log.warning("write %d/%d of %r not confirmed: %s",
                            attempt, config.attempts, row[0], outcome)  # fmt: skip
                result.retries += 1
                self.submit(row, attempt + 1, slot)  # a fresh uuid: a new write, not a resend
                continue
            self._fail(row[0], outcome)
        order = self._order
        while order and order[0].done:  # rows confirmed in order so far
            result.confirmed_through = order.popleft().key

    def _fail(self, key: str, exc: BaseException) -> None:
        self._result.failed += 1
        self._result.error = self._result.error or f"{key[:80]!r}: {exc}"


def write_partition(
    rows: Iterable[Row],
    config: WriterConfig,
    partition: int = 0,
    client_factory: Callable[[WriterConfig], ClientLike] = _default_client,
    clock: Callable[[], float] = time.monotonic,
) -> PartitionResult:
    """Write ``(key, value, ttl)`` rows with confirmation; never raises for a
    failed write (it is counted, with the first error kept).  The client is
    made here, in the thread (and forked worker process) that uses it."""
    result = PartitionResult(partition)
    started = clock()
    try:
        client = client_factory(config)
    except Exception as exc:
        result.failed = sum(1 for _ in rows)
        result.rows = result.failed
        result.error = f"cannot open a client: {exc}"
        return result
    try:
        try:
            client.wait_synced(config.sync_timeout)
        except Exception as exc:
            result.failed = result.rows = sum(1 for _ in rows)
            result.error = f"no server answered: {exc}"
            return result
        window = _Window(client, config, result)
        through = dict(config.resume).get(partition)
        result.confirmed_through = through
        for row in rows:
            result.rows += 1
            if through is not None and row[0] <= through:
                result.skipped += 1  # confirmed by the run resumed
                continue
            window.wait_for_room()
            if result.failed >= config.max_failures:
                result.failed += 1
                continue
            window.submit(row)
        window.drain()
    finally:
        client.close()
        result.seconds = clock() - started
    if result.failed:
        log.warning(
            "partition %d: %d of %d rows not stored: %s",
            partition,
            result.failed,
            result.rows,
            result.error,
        )
    return result


def _rows_of(batches: Iterator[pa.RecordBatch]) -> Iterator[Row]:
    for batch in batches:
        keys = batch.column("key").to_pylist()
        values = batch.column("value").to_pylist()
        ttls = batch.column("ttl").to_pylist()
        yield from zip(keys, values, ttls, strict=True)


def arrow_partition_writer(
    config: WriterConfig,
) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """A ``mapInArrow`` function: rows (key, value, ttl) in, one
    :data:`RESULT_SCHEMA` row per partition out."""

    def run(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        import pyarrow as pa
        from pyspark import TaskContext

        ctx = TaskContext.get()
        partition = ctx.partitionId() if ctx is not None else 0
        result = write_partition(_rows_of(batches), config, partition)
        schema = pa.schema(
            [
                (name, pa.int64())
                for name in ("partition", "rows", "written", "failed", "retries", "skipped")
            ]
            + [
                ("seconds", pa.float64()),
                ("error", pa.string()),
                ("confirmed_through", pa.string()),
            ]
        )
        yield pa.RecordBatch.from_pylist([result.as_dict()], schema=schema)

    return run
