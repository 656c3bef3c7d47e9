"""A deterministic in-memory streaming source for tests and benchmarks: ``isb-memory``.

Contract: row ``i`` (0-based) is a pure function of ``i`` and ``seed``, so a test
can compute exactly what a query read (:func:`memory_rows`). Offsets are
``{"row": n}`` (rows ``< n`` are read). With ``batchRows`` the source admits at
most that many rows per micro-batch (``ReadMaxRows``), also under
``trigger(availableNow=True)``; after ``rows`` rows it has no more data.

Options (all optional):

- ``rows``: total rows (default 1000)
- ``batchRows``: max rows per micro-batch (default: all at once)
- ``seed``: varies ``key``, ``service`` and ``value`` (default 0)
- ``partitions``: input partitions (Spark tasks) per micro-batch (default 2)
- ``columns``: comma list out of ``id,key,service,value,ts``
  (default ``id,service,value,ts``; the benchmark shape is ``id,key,service``)
- ``services``: distinct ``service`` values (default 8)
- ``chunkRows``: rows per Arrow record batch a task yields (default 65536)

Register it with ``spark.dataSource.register(MemoryDataSource)``. ``read``
runs in executor tasks and builds Arrow batches with vectorised pyarrow, so
it costs little next to the sink under test.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

COLUMNS = {
    "id": "id long",
    "key": "key long",
    "service": "service string",
    "value": "value double",
    "ts": "ts timestamp",
}
DEFAULT_COLUMNS = "id,service,value,ts"
TS_BASE_US = 1_704_067_200_000_000  # 2024-01-01T00:00:00Z; row i is i milliseconds later


def _columns(spec: str) -> list[str]:
    cols = [c.strip() for c in spec.split(",") if c.strip()]
    unknown = [c for c in cols if c not in COLUMNS]
    if unknown or not cols:
        raise ValueError(
            f"isb-memory: unknown columns {unknown} in option columns={spec!r}; "
            f"choose from {', '.join(COLUMNS)}"
        )
    return cols


def memory_rows(
    start: int,
    end: int,
    *,
    seed: int = 0,
    columns: str = DEFAULT_COLUMNS,
    services: int = 8,
) -> pa.Table:
    """Rows ``start <= i < end`` exactly as the source yields them."""
    ids = pa.array(range(start, end), pa.int64())
    out: dict[str, pa.Array] = {}
    for c in _columns(columns):
        if c == "id":
            out[c] = ids
        elif c == "key":
            out[c] = pc.bit_wise_and(pc.add(pc.multiply(ids, 2654435761), seed), 0xFFFFFFFF)
        elif c == "service":
            names = pa.array([f"svc-{k}" for k in range(services)])
            out[c] = pc.take(names, pc.remainder(pc.add(ids, seed), services))
        elif c == "value":
            out[c] = pc.divide(
                pc.cast(pc.remainder(pc.add(pc.multiply(ids, 31), seed), 10000), pa.float64()),
                100.0,
            )
        elif c == "ts":
            us = pc.add(pc.multiply(ids, 1000), TS_BASE_US)
            out[c] = pc.cast(us, pa.timestamp("us", tz="UTC"))
    return pa.table(out)


@dataclass
class RowRange(InputPartition):
    start: int
    end: int


class MemoryStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets ``{"row": n}``; everything but ``read`` runs on the driver."""

    def __init__(self, options: dict[str, str]):
        self.rows = int(options.get("rows", 1000))
        batch_rows = options.get("batchRows")
        self.batch_rows = int(batch_rows) if batch_rows else None
        self.seed = int(options.get("seed", 0))
        self.partitions_per_batch = max(1, int(options.get("partitions", 2)))
        self.columns = options.get("columns", DEFAULT_COLUMNS)
        self.services = int(options.get("services", 8))
        self.chunk_rows = max(1, int(options.get("chunkRows", 65536)))
        self.target = self.rows

    def initialOffset(self) -> dict:
        return {"row": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.batch_rows) if self.batch_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = self.rows

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        end = self.target
        if isinstance(limit, ReadMaxRows):
            end = min(end, start["row"] + limit.max_rows)
        return {"row": max(start["row"], end)}

    def reportLatestOffset(self) -> dict:
        return {"row": self.target}

    def partitions(self, start: dict, end: dict) -> list[RowRange]:
        lo, hi = start["row"], end["row"]
        if hi <= lo:
            return []
        n = self.partitions_per_batch
        step = -(-(hi - lo) // n)
        return [RowRange(s, min(s + step, hi)) for s in range(lo, hi, step)]

    def read(self, partition: RowRange) -> Iterator[pa.RecordBatch]:
        for s in range(partition.start, partition.end, self.chunk_rows):
            e = min(s + self.chunk_rows, partition.end)
            table = memory_rows(s, e, seed=self.seed, columns=self.columns, services=self.services)
            yield from table.to_batches()

    def commit(self, end: dict) -> None:
        pass


class MemoryDataSource(DataSource):
    """``spark.readStream.format("isb-memory")``: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "isb-memory"

    def schema(self) -> str:
        return ", ".join(COLUMNS[c] for c in _columns(self.options.get("columns", DEFAULT_COLUMNS)))

    def streamReader(self, schema) -> MemoryStreamReader:
        return MemoryStreamReader(self.options)
