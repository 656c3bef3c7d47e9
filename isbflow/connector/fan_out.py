"""One executor task of a fan-out writer: every out edge of a step from one pass over its rows
(the ``targets`` option of :mod:`isbflow.connector.writer`), each edge a
:class:`isbflow.connector.task_publisher.TaskPublisher` on one shared connection."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from isbflow.connector.task_publisher import TaskPublisher
from isbflow.connector.write_options import (
    FanOutReport,
    InvalidPartitionColumn,
    WriterOptions,
    partition_columns,
    target_column,
)
from isbflow.isb.connect import connect


class FanOutPublisher:
    """One task of a fan-out writer: every out edge of a step from one pass over its rows.

    One connection; rows are screened once (unrouted counted, errors dead-lettered: in the first
    edge's report), then each edge takes the rows whose ``_isb_partition_<i>`` is set, into the
    partition it names, with its own frames, ids, full-buffer handling and report.
    """

    def __init__(self, targets: list[WriterOptions], batch_id: int, task: int):
        self.pubs = [TaskPublisher(o, batch_id, task) for o in targets]
        self.columns = [target_column(i) for i in range(len(targets))]

    async def run(self, batches: Iterator[pa.RecordBatch]) -> FanOutReport:
        lead = self.pubs[0]
        batches = iter(batches)
        first = next((b for b in batches if b.num_rows), None)
        if first is not None:
            nc = await connect(lead.opts.settings, name=f"isbflow-writer-{lead.opts.step}-{lead.task}")
            try:
                for pub in self.pubs:
                    await pub.attach(nc)
                for batch in itertools.chain([first], batches):
                    self._check(batch)
                    for pub, name in zip(self.pubs, self.columns, strict=True):
                        if pub.opts.routed_sinks:
                            pub.note_routed(batch, pc.is_valid(batch.column(name)))
                    await self._fan_out(await lead.screen(batch))
                for pub in self.pubs:
                    await pub.finish()
            finally:
                await nc.close()
        return FanOutReport([pub.report for pub in self.pubs])

    def _check(self, batch: pa.RecordBatch) -> None:
        missing = [c for c in self.columns if c not in batch.schema.names]
        if missing:
            raise InvalidPartitionColumn(f"step {self.pubs[0].opts.step}: a fan-out writer of "
                                         f"{len(self.pubs)} edges needs the columns {', '.join(self.columns)} "
                                         f"(missing: {', '.join(missing)})")

    async def _fan_out(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        data = batch.drop_columns(partition_columns(batch.schema.names))
        for pub, name in zip(self.pubs, self.columns, strict=True):
            col = batch.column(name)
            if col.null_count == batch.num_rows:
                continue
            if col.null_count:
                take = pc.is_valid(col)
                await pub.feed(data.filter(take), col.filter(take))
            else:
                await pub.feed(data, col)
