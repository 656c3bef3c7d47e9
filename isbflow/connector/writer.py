"""The JetStream stream writer: Spark tasks publish frames into a step's output buffers.

``df.writeStream.format("jetstream")`` (the ``streamWriter`` of
:class:`isbflow.connector.source.JetStreamDataSource`) writes a step's output into the buffers of
one edge ``step -> to``: one stream per partition of ``to``
(:class:`isbflow.isb.naming.EdgePartition`).

Contract of :meth:`JetStreamStreamWriter.write` (runs in an executor task):

- **Routing.** A row goes to the edge partition in its ``_isb_partition``
  column (an integer in ``[0, partitions)``, computed by the runner *in Spark*
  as ``pmod(xxhash64(<partitionKey>), partitions)``; the writer never hashes
  in Python). The column is dropped from the published records. Without the
  column, every row of a task goes to partition ``taskPartitionId mod
  partitions`` (a keyless edge: tasks spread over partitions, a task's order is
  kept). A null or out-of-range value fails the task with
  :class:`InvalidPartitionColumn`.
- **Unrouted records.** A row whose ``_isb_unrouted`` column is true matched no
  out edge's ``conditions`` (:mod:`isbflow.steps.routing` marks them on the
  first out edge's query): it is not published, it is counted as ``unrouted``,
  and, when its ``_isb_error`` is set too, dead-lettered with that reason. The
  column is dropped from the published records.
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
    TOTALS_FILE,
    UNROUTED_COLUMN,
    BufferWriteError,
    InvalidPartitionColumn,
    JetStreamWriteReport,
    OutputBufferNotFound,
    WriterOptions,
    aggregate_reports,
    read_write_stats,
    read_write_totals,
    record_write_stats,
    spark_task_identity,
)
from isbflow.isb.errors import ConnectorOptionError

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger(__name__)

# ------------------------------------------------------------------ Spark classes


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer for the buffers of one edge (module docstring states the contract).

    Created on the driver, pickled to executors. ``task_identity`` returns
    (batch id, task partition id); the default reads the Spark task's context.
    """

    def __init__(self, options: WriterOptions,
                 task_identity: Callable[[], tuple[int, int]] = spark_task_identity):
        self.options = options
        self.task_identity = task_identity

    def write(self, iterator: Iterator[pa.RecordBatch]) -> JetStreamWriteReport:
        """Executor: publish this task's rows as frames; return what was published."""
        # lazy: the publisher brings pyarrow and nats-py (~0.4 s of imports); the sink runner Spark starts
        # for each query unpickles this writer and runs commit() only, which needs neither
        from isbflow.connector.task_publisher import TaskPublisher

        batch_id, task = self.task_identity()
        return asyncio.run(TaskPublisher(self.options, batch_id, task).run(iterator))

    def commit(self, messages: list[JetStreamWriteReport | None], batchId: int) -> None:  # noqa: N803
        """Driver: sum the tasks' counts, log them, add them to ``statsDir``'s totals if set."""
        stats = aggregate_reports(messages, batchId, self.options)
        stats.update(pipeline=self.options.pipeline, step=self.options.step, to=self.options.to)
        log.info("jetstream writer %s -> %s batch %s: %s", self.options.step, self.options.to, batchId,
                 json.dumps(stats))
        if self.options.stats_dir and not record_write_stats(self.options.stats_dir, stats,
                                                             self.options.stats_keep):
            log.info("jetstream writer %s -> %s batch %s committed again: already in the totals, not counted "
                     "twice", self.options.step, self.options.to, batchId)

    def abort(self, messages: list[JetStreamWriteReport | None], batchId: int) -> None:  # noqa: N803
        """Driver: a task failed. Frames already published stay; the retried batch republishes
        the same ids, which JetStream drops as duplicates."""
        stats = aggregate_reports(messages, batchId, self.options)
        log.warning("jetstream writer %s -> %s batch %s aborted after %s task(s) published %s frames "
                    "(%s failed); the re-run deduplicates by frame id", self.options.step, self.options.to,
                    batchId, stats["tasks"], stats["frames"], stats["failedTasks"])


_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def stream_writer(options: Mapping[str, str], schema: StructType) -> JetStreamStreamWriter:
    """The writer for a ``streamWriter(schema, overwrite)`` call: options parsed, schema checked."""
    opts = WriterOptions.parse(options)
    if PARTITION_COLUMN in schema.fieldNames():
        dtype = schema[PARTITION_COLUMN].dataType
        if not isinstance(dtype, _INTEGRAL):
            raise ConnectorOptionError(f"column {PARTITION_COLUMN} must be an integer (pmod(xxhash64(key), n)), "
                                       f"got {dtype.simpleString()}")
    return JetStreamStreamWriter(opts)
