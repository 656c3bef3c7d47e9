"""A Delta sink vertex written through: its read tasks write the sink's Parquet.

A sink vertex (Numaflow's sink) transforms nothing: it reads its input buffer and writes its
sink. Through Spark's Parquet writer (:class:`isbflow.sinks.delta_spark.DeltaBatchWriter`) every
row the frames hold in Arrow is converted into the JVM's rows and encoded there, row by row; the
profile of issue 14 had that write job bound every Delta path (A into ``noop`` 1.6M rec/s, into
Delta 0.5M). Written through, ``format("isb-delta-through")`` reads the buffer as
``format("jetstream")`` does, and each task writes the Arrow batches it decoded as Parquet files in
the same Python process (:func:`isbflow.sinks.delta_files.write_batch_files`: pyarrow, one file per
partition value, their stats and the ``_isb_id`` offset ranges) and hands Spark one commit message
instead of the rows (:mod:`isbflow.sinks.delta_through`, whose ``foreachBatch`` function commits the
batch's messages once through delta-rs, as every Delta path does).

The task knows its micro-batch from Spark's local property ``streaming.sql.batchId``; its files go
where the Python writer always put them, noted in the batch's pending folder, so a failed or re-run
batch leaves nothing the commit does not remove. Spark still counts records: a task yields its
message in the first row of a ``message`` column of nulls as long as the records it wrote, so
``numInputRows`` (the step's rates, totals and metrics) is unchanged.

Options: those of ``format("jetstream")`` in frames mode, plus ``frameSchema`` (the frames' Spark
schema as JSON) and ``delta`` (the sink's :class:`~isbflow.sinks.delta_files.DeltaSinkOptions` as
a JSON object of its options).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import BinaryType, StructField, StructType

from isbflow.connector.options import ReaderOptions
from isbflow.isb.errors import ConnectorOptionError
from isbflow.sinks.delta_files import DeltaSinkOptions
from isbflow.sinks.delta_through import MESSAGE_COLUMN

FORMAT = "isb-delta-through"
MESSAGE_SCHEMA = StructType([StructField(MESSAGE_COLUMN, BinaryType(), True)])

#: A replay (recovery's, :class:`~isbflow.steps.runner.PipelineRunner` with ``replay=True``) reads a
#: written-through sink's buffer in micro-batches of this many ``readBatchSize``: what it reads is
#: committed already and waits for nobody, so the batch is sized for throughput, not latency. Nothing
#: grows with it but the redo after a crash: a task streams its frames into its Parquet files (one
#: frame in memory at a time) and hands the driver one commit message, and the driver commits one Delta
#: version a batch. Each batch pays a fixed cost (job, tasks, each task's NATS connection and first
#: fetch, the commit): ~250 ms a batch against ~0.45 us a row here (2M records in frames of 10,000,
#: ``local[2]``, written-through: 400K rows a batch 420-590 ms, 800K 590, 1.6M 990, 2M 1,150).
REPLAY_BATCHES = 10


def replay_read_rows(read_batch_size: int) -> int:
    """The rows a replay's written-through sink reads a micro-batch (:data:`REPLAY_BATCHES`)."""
    return read_batch_size * REPLAY_BATCHES


def through_options(frame_schema: StructType, delta: Mapping[str, str]) -> dict[str, str]:
    """The options naming what a written-through read decodes and where it writes."""
    return {"frameSchema": frame_schema.json(), "delta": json.dumps(dict(delta))}


def _parse(options: Mapping[str, str]) -> tuple[ReaderOptions, StructType, DeltaSinkOptions]:
    opts = ReaderOptions.parse(options)
    if opts.mode != "frames":
        raise ConnectorOptionError(f"format({FORMAT!r}) reads frames (an internal edge), not mode={opts.mode}")
    try:
        schema = StructType.fromJson(json.loads(options["frameSchema"]))
        delta = DeltaSinkOptions.from_options(json.loads(options["delta"]))
    except KeyError as e:
        raise ConnectorOptionError(f"format({FORMAT!r}) needs the option {e.args[0]!r}") from None
    return opts, schema, delta


class WriteThroughDataSource(DataSource):
    """``format("isb-delta-through")``: streaming reads only (a sink vertex's query)."""

    @classmethod
    def name(cls) -> str:
        return FORMAT

    def schema(self) -> StructType:
        return MESSAGE_SCHEMA

    def streamReader(self, schema: StructType):  # noqa: N802
        # lazy: the reader brings pyarrow and nats-py (isbflow.connector.source's docstring)
        from isbflow.steps.write_through_reader import WriteThroughReader

        return WriteThroughReader(*_parse(self.options))
