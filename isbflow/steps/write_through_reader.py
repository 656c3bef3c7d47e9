"""The reader of ``format("isb-delta-through")`` (:mod:`isbflow.steps.write_through`): imported only
where a reader is made, as :mod:`isbflow.connector.reader` is."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.types import StructType

from isbflow.connector.options import ReaderOptions
from isbflow.connector.reader import JetStreamPartition, JetStreamStreamReader
from isbflow.sinks.delta_files import DeltaSinkError, DeltaSinkOptions, write_batch_files
from isbflow.sinks.delta_through import MESSAGE_COLUMN, message_row
from isbflow.steps.write_through import FORMAT


class WriteThroughReader(JetStreamStreamReader):
    """``format("jetstream")``'s streaming reader whose tasks write what they read into the sink."""

    def __init__(self, opts: ReaderOptions, frame_schema: StructType, delta: DeltaSinkOptions):
        super().__init__(opts, frame_schema)
        self.delta = delta

    def read(self, partition: JetStreamPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the partition's frames written as the sink's files; the commit message out."""
        return read_through(super().read(partition), self.delta)


def read_through(batches: Iterator[pa.RecordBatch], delta: DeltaSinkOptions) -> Iterator[pa.RecordBatch]:
    """Executor: write ``batches`` (one task's decoded frames) as the sink's files; yield the task's
    commit message and as many null rows as records after it (:mod:`isbflow.steps.write_through`)."""
    ctx = TaskContext.get()
    batch_id = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
    if batch_id is None:
        raise DeltaSinkError(f"format({FORMAT!r}) {delta.path}: no streaming batch id in the task; "
                             "it is read by a streaming query only")
    message = write_batch_files(delta, batches, int(batch_id), ctx.partitionId())
    if not message.actions:
        return
    rows = sum(json.loads(a.stats)["numRecords"] for a in message.actions)
    yield pa.RecordBatch.from_arrays([pa.array([message_row(message)], pa.binary())], names=[MESSAGE_COLUMN])
    if rows > 1:
        yield pa.RecordBatch.from_arrays([pa.nulls(rows - 1, pa.binary())], names=[MESSAGE_COLUMN])
