"""The JetStream stream writer: Spark tasks publish frames into a step's output buffers.

``df.writeStream.format("jetstream")`` (the ``streamWriter`` of
:class:`isbflow.connector.source.JetStreamDataSource`) writes a step's output into the buffers of
one edge ``step -> to``: one stream per partition of ``to``
(:class:`isbflow.isb.naming.EdgePartition`), or, with the ``targets`` option, into every out
edge of the step in one pass (a *fan-out*: one query per step, whatever its out degree).

Contract of :meth:`JetStreamStreamWriter.write` (runs in an executor task):

- **Routing.** A row goes to the edge partition in its ``_isb_partition``
  column (an integer in ``[0, partitions)``, computed by the runner *in Spark*
  as ``pmod(xxhash64(<partitionKey>), partitions)``; the writer never hashes
  in Python). The column is dropped from the published records. Without the
  column, every row of a task goes to partition ``taskPartitionId mod
  partitions`` (a keyless edge: tasks spread over partitions, a task's order is
  kept). A null or out-of-range value fails the task with
  :class:`InvalidPartitionColumn`.
- **Fan-out.** ``targets`` is a JSON list, one object per out edge, with the per-edge options
  (``to``, ``partitions``, ``bufferMaxLength``, ``bufferUsageLimit``, ``statsDir``,
  ``committedKey``; the others are shared). Row routing then comes from one column per edge,
  ``_isb_partition_<i>`` for the ``i``-th entry: the edge partition, or null when edge ``i``
  does not take the row (the runner computes it from the edge's ``conditions``). Each edge has
  its own frames, ids, full-buffer handling and stats (``statsDir``); rows are screened once
  (dead letters and unrouted rows are counted in the first edge's stats), and a task holds one
  connection for all edges.
- **Routed away.** An edge with ``routedSinks`` (the sinks it gates, comma-separated) has its
  tasks keep the ``_isb_id`` ranges of the rows it does not take, and the commit adds them to
  the offset ledger as routed away from those sinks (:mod:`isbflow.isb.routed`).
- **Unrouted records.** A row whose ``_isb_unrouted`` column is true matched no
  out edge's ``conditions`` (:mod:`isbflow.steps.routing` marks them): it is not
  published, it is counted as ``unrouted``, and, when its ``_isb_error`` is set
  too, dead-lettered with that reason. The column is dropped from the published
  records.
- **Frames.** Rows of one partition are cut into frames by
  :func:`isbflow.isb.frames.split_frames` (``frameRows`` rows, at most
  ``maxPayload`` bytes), in input order. Each frame is published with an
  acked JetStream publish, pipelined (``publishWindow`` frames in flight), and
  the deterministic ``Nats-Msg-Id`` ``<step>:<batchId>:<taskPartitionId>:<edgePartition>:<chunk>:<digest>``
  (:func:`isbflow.isb.frames.frame_id`; the digest is of the frame's bytes).
  The batch id is the Spark local property ``streaming.sql.batchId``. A
  re-executed batch (task retry, restart from the checkpoint) sees the same
  rows in the same order, so it republishes the same frames, byte for byte, under
  the same ids and JetStream's duplicates window drops them; the PubAck's
  ``duplicate`` flag is counted. A re-execution whose rows differ (a transform
  that is not deterministic: ``current_timestamp()``, ``rand()``, an order that
  depends on a shuffle) makes other frames: they land beside the first
  attempt's (at least once: duplicates for the sink's ``_isb_id`` merge to
  drop, never a lost frame). A message published earlier under a frame's
  position with other bytes (a forgery) does not suppress the real frame.
  Order within a partition is kept (see *Full buffer* for the one exception).
- **Oversized records.** A row that alone exceeds ``maxPayload`` goes to the
  dead-letter buffer (:mod:`isbflow.isb.dlq`) with the reason
  ``record of N bytes exceeds max_payload M at step S``; the rest flows on.
- **Full buffer.** With ``bufferMaxLength`` set, a partition holds at most
  ``ceil(bufferMaxLength * bufferUsageLimit / frameRows)`` frames not yet
  committed downstream: usage = the stream's last sequence minus the
  downstream's committed sequence, read from the status KV key
  ``committed.<to>.<stream>`` (missing = nothing committed). Stream info and
  the key are read only when the writer's own running estimate comes within
  ``publishWindow`` frames of capacity; near capacity frames go one at a time.
  When full, ``onFull=retryUntilSuccess`` waits with backoff (back-pressure:
  the batch takes longer; a log line at most every 5 s) and
  ``onFull=discardLatest`` drops the frame and counts its rows as discarded.
  A publish refused with "maximum messages/bytes exceeded" (a stream with
  discard ``new`` and its own limits) is handled the same way; in that case
  only, a frame already in flight behind the refused one may land before it.
- **Result.** A :class:`JetStreamWriteReport` with counts per edge partition.

:meth:`JetStreamStreamWriter.commit` (driver, once per micro-batch, batch 0
too) sums the task reports (:func:`aggregate_reports`), logs them and, with
the ``statsDir`` option, keeps them (:func:`record_write_stats`): the batch's
``<statsDir>/batch-<batchId>.json`` and the running ``<statsDir>/totals.json``
(read by :func:`read_write_totals`), each replaced atomically; a batch id
already counted (a re-committed batch) is not counted twice, and only the
newest ``statsKeep`` per-batch files are kept (:func:`read_write_stats` sums
the pruned ones into one entry). Publishing is already durable when the tasks
end: ``commit`` commits nothing to JetStream.

Options (strings): ``settings`` (JSON of NatsSettings, see
:func:`isbflow.connector.options.settings_to_json`; resolved from the
environment when absent), ``pipeline``, ``step``, ``to`` (required),
``partitions`` (default 1), ``maxPayload`` (default: the server's),
``frameRows`` (10000), ``bufferMaxLength`` (none = unbounded),
``bufferUsageLimit`` (0.8), ``onFull`` (retryUntilSuccess|discardLatest),
``committedKey`` (template, default ``committed.{to}.{stream}``),
``dlqSubject`` (default ``naming.dlq_subject(pipeline, step)``),
``statsDir``, ``statsKeep`` (100), ``publishWindow`` (32).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSourceStreamArrowWriter
from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType, StructType

from isbflow.connector.write_options import (  # noqa: F401 - the writer's public names, re-exported
    BATCH_ID_PROPERTY,
    DEFAULT_COMMITTED_KEY,
    DEFAULT_STATS_KEEP,
    DEFAULT_WINDOW,
    ERROR_COLUMN,
    PARTITION_COLUMN,
    RAW_COLUMN,
    TARGETS_OPTION,
    TOTALS_FILE,
    UNROUTED_COLUMN,
    BufferWriteError,
    FanOutReport,
    InvalidPartitionColumn,
    JetStreamWriteReport,
    OutputBufferNotFound,
    WriterOptions,
    aggregate_reports,
    partition_columns,
    read_write_stats,
    read_write_totals,
    record_write_stats,
    spark_task_identity,
    target_column,
)
from isbflow.isb.errors import ConnectorOptionError

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ Spark classes


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer for the buffers of one edge, or of every out edge of a step in one pass
    (``targets``; module docstring states the contract).

    Created on the driver, pickled to executors. ``task_identity`` returns
    (batch id, task partition id); the default reads the Spark task's context.
    """

    def __init__(self, options: WriterOptions,
                 task_identity: Callable[[], tuple[int, int]] = spark_task_identity,
                 targets: list[WriterOptions] | None = None):
        self.options = options
        self.task_identity = task_identity
        #: a fan-out writer's edges (``targets`` option), None for one edge
        self.targets = targets

    def write(self, iterator: Iterator[pa.RecordBatch]) -> JetStreamWriteReport | FanOutReport:
        """Executor: publish this task's rows as frames; return what was published."""
        # lazy: the publisher brings pyarrow and nats-py (~0.4 s of imports); the sink runner Spark starts
        # once per query unpickles this writer and runs commit() only, which needs neither
        from isbflow.connector.fan_out import FanOutPublisher
        from isbflow.connector.task_publisher import TaskPublisher

        batch_id, task = self.task_identity()
        if self.targets is not None:
            return asyncio.run(FanOutPublisher(self.targets, batch_id, task).run(iterator))
        return asyncio.run(TaskPublisher(self.options, batch_id, task).run(iterator))

    def _edges(self, messages: list) -> list[tuple[WriterOptions, list[JetStreamWriteReport | None]]]:
        """(edge options, its task reports) for every edge written."""
        if self.targets is None:
            return [(self.options, messages)]
        return [(o, [m.reports[i] if m is not None else None for m in messages])
                for i, o in enumerate(self.targets)]

    def commit(self, messages: list, batchId: int) -> None:  # noqa: N803
        """Driver: sum the tasks' counts per edge, log them, add them to the edge's ``statsDir`` totals."""
        for opts, reports in self._edges(messages):
            stats = aggregate_reports(reports, batchId, opts)
            stats.update(pipeline=opts.pipeline, step=opts.step, to=opts.to)
            log.info("jetstream writer %s -> %s batch %s: %s", opts.step, opts.to, batchId, json.dumps(stats))
            if opts.stats_dir and not record_write_stats(opts.stats_dir, stats, opts.stats_keep):
                log.info("jetstream writer %s -> %s batch %s committed again: already in the totals, not "
                         "counted twice", opts.step, opts.to, batchId)
            routed = [r.routed for r in reports if r is not None and r.routed]
            if opts.routed_sinks and routed:
                # lazy: only a step whose edge gates a sink records (isb.routed); most commits never do
                from isbflow.isb.ranges import union
                from isbflow.isb.routed import record_routed_sync

                record_routed_sync(opts.settings, opts.pipeline, opts.routed_sinks, union(*routed))

    def abort(self, messages: list, batchId: int) -> None:  # noqa: N803
        """Driver: a task failed. Frames already published stay; the retried batch republishes
        the same ids, which JetStream drops as duplicates."""
        for opts, reports in self._edges(messages):
            stats = aggregate_reports(reports, batchId, opts)
            log.warning("jetstream writer %s -> %s batch %s aborted after %s task(s) published %s frames "
                        "(%s failed); the re-run deduplicates by frame id", opts.step, opts.to,
                        batchId, stats["tasks"], stats["frames"], stats["failedTasks"])


_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def stream_writer(options: Mapping[str, str], schema: StructType) -> JetStreamStreamWriter:
    """The writer for a ``streamWriter(schema, overwrite)`` call: options parsed, schema checked."""
    targets = WriterOptions.parse_targets(options)
    fan_out = TARGETS_OPTION in options and str(options[TARGETS_OPTION]).strip()
    names = schema.fieldNames()
    if fan_out:
        missing = [target_column(i) for i in range(len(targets)) if target_column(i) not in names]
        if missing:
            raise ConnectorOptionError(f"option '{TARGETS_OPTION}' names {len(targets)} edge(s): each row needs "
                                       f"the partition of each in {', '.join(missing)} (null: the edge does "
                                       "not take the row)")
    for name in partition_columns(names):
        dtype = schema[name].dataType
        if not isinstance(dtype, _INTEGRAL):
            raise ConnectorOptionError(f"column {name} must be an integer (pmod(xxhash64(key), n)), "
                                       f"got {dtype.simpleString()}")
    return JetStreamStreamWriter(targets[0], targets=targets if fan_out else None)
