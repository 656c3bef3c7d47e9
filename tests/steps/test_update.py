"""An update step's publisher (isbflow.steps.update): the row version travels with the rows, and the
plan Spark compiles is the same for every batch (a literal that changes per batch is new code per
batch: Janino in the stream thread, then the JIT)."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa

from isbflow.steps import update
from isbflow.steps.update import VERSION_COLUMN, UpdatePublisher, row_version, with_version


def test_each_batch_gets_the_version_as_its_last_column():
    batches = [pa.RecordBatch.from_pydict({"k": ["a", "b"]}), pa.RecordBatch.from_pydict({"k": ["c"]})]
    out = list(with_version(iter(batches), row_version(2, 7)))
    assert [b.schema.names for b in out] == [["k", VERSION_COLUMN]] * 2
    assert out[0].schema.field(VERSION_COLUMN) == pa.field(VERSION_COLUMN, pa.int64(), nullable=False)
    assert [b.column(1).to_pylist() for b in out] == [[2 * 10**12 + 7] * 2, [2 * 10**12 + 7]]


def test_the_plan_is_the_same_for_every_batch(spark, monkeypatch):
    plans, schemas = [], []

    def writer(options, schema):
        schemas.append(schema)
        return SimpleNamespace(options=options, targets=None, commit=lambda reports, batch_id: None)

    def map_in_arrow(self, fn, schema):
        plans.append(self._jdf.queryExecution().optimizedPlan().toString())
        return SimpleNamespace(collect=lambda: [])

    df = spark.createDataFrame([("a", 1)], "k string, n long")
    monkeypatch.setattr(update, "stream_writer", writer)
    monkeypatch.setattr(type(df), "mapInArrow", map_in_arrow)
    publish = UpdatePublisher({"to": "agg"}, epoch=3)
    publish(df, 41)
    publish(df, 42)
    assert len(plans) == 2 and plans[0] == plans[1]
    # a version no expression id reaches (ids like k#41040 hold "41")
    assert str(row_version(3, 41)) not in plans[0]
    assert [s.fieldNames() for s in schemas] == [["k", "n", VERSION_COLUMN]] * 2
