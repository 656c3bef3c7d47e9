"""``format("jetstream")``: the data source class Spark registers, pickles and unpickles.

Spark unpickles the data source in every Python process it starts for a query: the planner
processes, the streaming source runner, and the sink runner that commits each micro-batch of a
``writeStream.format("jetstream")`` query. Only the source runner and the executor tasks read
buffers, so this module imports neither pyarrow nor nats-py: a process that only writes or
commits pays no ~0.4 s of imports for the reader (:mod:`isbflow.connector.reader`, imported when
a reader is made) and the writer's task side (:mod:`isbflow.connector.task_publisher`).
The options and the reader's contract are in :mod:`isbflow.connector.reader`; the writer's in
:mod:`isbflow.connector.writer`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSource
from pyspark.sql.types import StructType

from isbflow.connector.options import ReaderOptions
from isbflow.connector.writer import JetStreamStreamWriter, stream_writer
from isbflow.isb.errors import ConnectorOptionError

if TYPE_CHECKING:
    from isbflow.connector.reader import JetStreamBatchReader, JetStreamStreamReader


class JetStreamDataSource(DataSource):
    """``format("jetstream")``: created on the driver and pickled to executors (holds options only)."""

    @classmethod
    def name(cls) -> str:
        return "jetstream"

    def schema(self) -> StructType:
        """Called only when the caller gave no ``.schema(...)``."""
        if ReaderOptions.parse(self.options).mode == "events":
            # lazy: the events schema lives with the reader's Arrow code (module docstring)
            from isbflow.connector.batches import EVENTS_SCHEMA

            return EVENTS_SCHEMA
        raise ConnectorOptionError(
            "format('jetstream') in frames mode needs the frames' schema: pass the upstream "
            "step's output schema with .schema(...), or set mode=events for one-event messages")

    def streamReader(self, schema: StructType) -> JetStreamStreamReader:  # noqa: N802
        # lazy: the reader brings pyarrow and nats-py, which a writing process never needs (module docstring)
        from isbflow.connector.reader import JetStreamStreamReader

        return JetStreamStreamReader(ReaderOptions.parse(self.options), schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> JetStreamStreamWriter:  # noqa: N802
        """Driver: the stream writer publishing frames into an edge's buffers
        (:mod:`isbflow.connector.writer`)."""

        return stream_writer(self.options, schema)

    def reader(self, schema: StructType) -> JetStreamBatchReader:
        # lazy: as streamReader
        from isbflow.connector.reader import JetStreamBatchReader

        return JetStreamBatchReader(ReaderOptions.parse(self.options), schema)
