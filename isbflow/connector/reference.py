"""``isb-ref``: a reference table (KV bucket, one value per key) as a Spark batch source.

Used on the static side of a stream-static join::

    services = spark.read.format("isb-ref").option("pipeline", "logs") \\
        .option("name", "services").option("key", "service").load()
    enriched = events.join(F.broadcast(services), "service", "left")

Spark plans the static side again for every micro-batch, and a Python batch
source's ``read`` runs again each time (checked on PySpark 4.3: a value
changed in the source between batches showed up in the next batch). So the
table is loaded once per micro-batch, broadcast, and picks up changes with
no per-record call to anything. The schema is taken from the table when the
query is planned; a column added later needs a restart of the step. A pipeline's
step does not pay that read every batch: its runner caches the table and reads
it again when the bucket's revision moves (``PipelineRunner._references``).

A load that does not finish within the ``timeout`` option (seconds, default
:data:`isbflow.isb.reference.LOAD_TIMEOUT`) fails the planning or the batch with
an error naming the KV bucket, and a row that is not an object of scalar columns
fails with an error naming its key (:func:`isbflow.isb.reference.load`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.types import StructType

from isbflow.isb import reference
from isbflow.isb.connect import settings_from_json
from isbflow.isb.errors import ConnectorOptionError


def _timeout(options: dict[str, str]) -> float:
    raw = str(options.get("timeout") or "").strip()
    if not raw:
        return reference.LOAD_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConnectorOptionError(f"option 'timeout': expected seconds > 0, got {raw!r}")
    return value


class ReferenceDataSource(DataSource):
    """Options: ``pipeline``, ``name`` (the reference), ``key`` (key column), ``settings``,
    ``timeout`` (seconds a load may take)."""

    @classmethod
    def name(cls) -> str:
        return "isb-ref"

    def _load(self) -> pa.Table:
        settings = settings_from_json(self.options["settings"])
        _, table = asyncio.run(reference.load(settings, self.options["pipeline"], self.options["name"],
                                              key=self.options.get("key", "key"),
                                              timeout=_timeout(self.options)))
        return table

    def schema(self) -> StructType:
        return from_arrow_schema(self._load().schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        return ReferenceReader(self, schema)


class ReferenceReader(DataSourceReader):
    def __init__(self, source: ReferenceDataSource, schema: StructType):
        self.source = source
        self.names = schema.fieldNames()

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(0)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        table = self.source._load()
        for c in self.names:  # a column dropped since planning: nulls, not a crash
            if c not in table.column_names:
                table = table.append_column(c, pa.nulls(table.num_rows))
        yield from table.select(self.names).to_batches()
