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
from pyspark.sql.types import LongType, StructField, StructType

from isbflow.connector.writer import JetStreamStreamWriter, stream_writer

#: The column an update step's rows carry on the wire (not in the sink): the row's version.
VERSION_COLUMN = "_isb_version"
#: Batch ids per checkpoint epoch in a version number.
EPOCH_FACTOR = 10**12


def row_version(epoch: int, batch_id: int) -> int:
    """The version of rows emitted by micro-batch ``batch_id`` under checkpoint ``epoch``."""
    return epoch * EPOCH_FACTOR + batch_id


#: :data:`VERSION_COLUMN` as Spark's ``lit(version).cast("long")`` gave it to the tasks
VERSION_FIELD = pa.field(VERSION_COLUMN, pa.int64(), nullable=False)


def with_version(batches: Iterator[pa.RecordBatch], version: int) -> Iterator[pa.RecordBatch]:
    """Each batch with :data:`VERSION_COLUMN` = ``version`` as its last column."""
    value = pa.scalar(version, pa.int64())
    for b in batches:
        yield b.append_column(VERSION_FIELD, pa.repeat(value, b.num_rows))


def _publish_task(writer, batch_id: int, version: int,
                  batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    """Executor (``mapInArrow``): publish this task's rows with their version, yield the pickled
    report as one row."""
    ctx = TaskContext.get()
    task = ctx.partitionId() if ctx else 0
    report = JetStreamStreamWriter(writer.options, task_identity=lambda: (batch_id, task),
                                    targets=writer.targets).write(with_version(batches, version))
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
        # the version is added in the tasks (with_version), not as a literal in the plan: Spark
        # generates and compiles code for a plan, and code holding a literal that changes every
        # batch is new code every batch (Janino in the stream thread, then the JIT): the demo's
        # minutely step compiled a stage a batch for its version alone
        schema = StructType([*df.schema.fields, StructField(VERSION_COLUMN, LongType(), nullable=False)])
        writer = stream_writer(self.options, schema)
        version = row_version(self.epoch, batch_id)
        rows = df.mapInArrow(partial(_publish_task, writer, batch_id, version), "report binary").collect()
        writer.commit([pickle.loads(r["report"]) for r in rows], batch_id)
