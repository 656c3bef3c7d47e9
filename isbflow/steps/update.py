"""Steps with ``udf.output: update``: a streaming aggregation's changing rows into an edge's buffers.

A windowed aggregation in Spark's *append* output mode emits a window only once
the watermark closes it, and windows still open when a run ends stay in the
state store (Spark has no final watermark). In *update* mode every micro-batch
emits the current value of each key it changed, so every window, open or not,
reaches the sink, which upserts it on the step's ``keys``
(:mod:`isbflow.sinks.delta`, ``mode=upsert``).

Spark's Python data source writers take append or complete mode only (their
write builder lacks ``SupportsStreamingUpdateAsAppend``: "isb-delta does not
support Update mode", checked with PySpark 4.3), so the runner writes such a
step with ``foreachBatch`` in update mode and :class:`UpdatePublisher`
publishes each micro-batch with the same JetStream writer the append steps use
(:class:`isbflow.connector.writer.JetStreamStreamWriter`): one Spark job whose
tasks publish their rows as frames from the executors (``mapInArrow``), then the
writer's driver-side commit (stats). Frame ids stay deterministic
(``<step>:<batchId>:<task>:<partition>:<chunk>``), so a re-executed batch is
dropped by JetStream's duplicates window as before.

**Versions.** Each row gets :data:`VERSION_COLUMN` = :func:`row_version` of
the pipeline's checkpoint epoch and the Spark batch id, so a sink that reads
several upstream micro-batches at once keeps, per key, the row of the latest
one (``versionColumn``). Versions grow with the batch id and, after a recovery
(a new checkpoint starts at batch 0), with the epoch.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Mapping
from functools import partial

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import functions as F

from isbflow.connector.writer import JetStreamStreamWriter, stream_writer

#: The column an update step's rows carry on the wire (not in the sink): the row's version.
VERSION_COLUMN = "_isb_version"
#: Batch ids per checkpoint epoch in a version number.
EPOCH_FACTOR = 10**12


def row_version(epoch: int, batch_id: int) -> int:
    """The version of rows emitted by micro-batch ``batch_id`` under checkpoint ``epoch``."""
    return epoch * EPOCH_FACTOR + batch_id


def _publish_task(writer, batch_id: int, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Executor (``mapInArrow``): publish this task's rows, yield the pickled report as one row."""
    ctx = TaskContext.get()
    task = ctx.partitionId() if ctx else 0
    report = JetStreamStreamWriter(writer.options, task_identity=lambda: (batch_id, task),
                                    targets=writer.targets).write(batches)
    yield pa.RecordBatch.from_pydict({"report": [pickle.dumps(report)]},
                                     schema=pa.schema([("report", pa.binary())]))


class UpdatePublisher:
    """The ``foreachBatch`` function of one output edge of an update step.

    ``options`` are the ``jetstream`` writer's options (as for
    ``writeStream.format("jetstream")``); ``epoch`` the pipeline's checkpoint
    epoch. Runs on the driver once per micro-batch.
    """

    def __init__(self, options: Mapping[str, str], epoch: int):
        self.options = dict(options)
        self.epoch = epoch

    def __call__(self, df, batch_id: int) -> None:
        df = df.withColumn(VERSION_COLUMN, F.lit(row_version(self.epoch, batch_id)).cast("long"))
        writer = stream_writer(self.options, df.schema)
        rows = df.mapInArrow(partial(_publish_task, writer, batch_id), "report binary").collect()
        writer.commit([pickle.loads(r["report"]) for r in rows], batch_id)
