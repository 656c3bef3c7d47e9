"""The fan-out writer: one pass over a step's rows writes every out edge (the ``targets`` option),
against a real nats-server, called directly (a fixed task identity) and from a Spark query."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from nats.js.api import StreamConfig

from isbflow.connector.write_options import (
    ERROR_COLUMN,
    UNROUTED_COLUMN,
    FanOutReport,
    target_column,
)
from isbflow.connector.writer import (
    JetStreamStreamWriter,
    WriterOptions,
    read_write_totals,
    stream_writer,
)
from isbflow.isb import dlq, naming
from isbflow.isb.connect import connect, settings_to_json
from isbflow.isb.errors import ConnectorOptionError
from tests.connector.test_writer import read_stream, run
from tests.helpers.memory_source import memory_rows

PIPE, STEP = "wp", "enrich"
EDGES = {"raw": 1, "minutely": 2}  # to -> partitions


async def _provision(settings) -> None:
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        for to, n in EDGES.items():
            for p in range(n):
                e = naming.EdgePartition(PIPE, STEP, to, p)
                await js.add_stream(StreamConfig(name=e.stream, subjects=[e.subject], duplicate_window=120.0))
        await js.add_stream(StreamConfig(name=naming.dlq_stream(PIPE), subjects=[f"isb.{PIPE}.dlq.>"],
                                         duplicate_window=120.0, allow_direct=True))
        await js.create_key_value(bucket=naming.status_bucket(PIPE))
    finally:
        await nc.close()


def options(settings, tmp_path) -> dict[str, str]:
    return {"settings": settings_to_json(settings), "pipeline": PIPE, "step": STEP, "frameRows": "100",
            "targets": json.dumps([{"to": to, "partitions": n, "statsDir": str(tmp_path / f"stats-{to}")}
                                   for to, n in EDGES.items()])}


def stored(settings, to: str, p: int) -> list[int]:
    """The ids of the rows edge ``to``'s partition ``p`` holds, in stream order."""
    stream = naming.EdgePartition(PIPE, STEP, to, p).stream
    out = []
    for _seq, _h, t in read_stream(settings, stream):
        assert t.column_names == ["id", "service", "value"]  # routing columns never published
        out += t.column("id").to_pylist()
    return out


def routed_rows(n: int) -> pa.Table:
    """Rows ``0..n``: ``raw`` takes the even ones, ``minutely`` (partition id mod 2) multiples of 3;
    every 7th row is marked bad, and a row neither edge takes is marked unrouted."""
    t = memory_rows(0, n, columns="id,service,value")
    ids = range(n)
    raw = [0 if i % 2 == 0 else None for i in ids]
    minutely = [i % 2 if i % 3 == 0 else None for i in ids]
    error = ["bad record" if i % 7 == 0 and i else None for i in ids]
    unrouted = [r is None and m is None for r, m in zip(raw, minutely, strict=True)]
    return (t.append_column(target_column(0), pa.array(raw, pa.int32()))
            .append_column(target_column(1), pa.array(minutely, pa.int32()))
            .append_column(ERROR_COLUMN, pa.array(error, pa.string()))
            .append_column(UNROUTED_COLUMN, pa.array(unrouted)))


def test_one_pass_writes_each_edge_its_rows_and_counts_dead_letters_and_unrouted_once(nats_server, tmp_path):
    settings = nats_server.settings
    run(_provision(settings))
    n = 1000
    writer = stream_writer(options(settings, tmp_path), _schema(routed_rows(1)))
    assert [o.to for o in writer.targets] == list(EDGES)
    table = routed_rows(n)
    direct = JetStreamStreamWriter(writer.options, task_identity=lambda: (5, 0), targets=writer.targets)
    report = direct.write(iter(table.to_batches(max_chunksize=128)))
    assert isinstance(report, FanOutReport) and len(report.reports) == 2

    bad = {i for i in range(1, n) if i % 7 == 0}
    assert stored(settings, "raw", 0) == [i for i in range(0, n, 2) if i not in bad]
    for p in (0, 1):
        assert stored(settings, "minutely", p) == [i for i in range(0, n, 3) if i not in bad and i % 2 == p]
    unrouted = [i for i in range(n) if i % 2 and i % 3]
    raw, minutely = report.reports
    assert raw.total("dead_lettered") == len(bad) and minutely.total("dead_lettered") == 0
    assert raw.total("unrouted") == len(unrouted) and minutely.total("unrouted") == 0
    assert raw.total("rows") == len(stored(settings, "raw", 0))
    assert minutely.total("rows") == len(stored(settings, "minutely", 0)) + len(stored(settings, "minutely", 1))
    letters = run(dlq.read_dead_letters(settings, PIPE, STEP))
    assert sorted(x["record"]["id"] for x in letters) == sorted(bad)  # once each, not once per edge

    direct.commit([report, None], 5)  # the driver's commit: stats per edge
    totals = {to: read_write_totals(tmp_path / f"stats-{to}") for to in EDGES}
    assert totals["raw"]["rows"] == raw.total("rows") and totals["raw"]["dead_lettered"] == len(bad)
    assert totals["minutely"]["rows"] == minutely.total("rows") and totals["minutely"]["failedTasks"] == 1

    again = direct.write(iter(table.to_batches(max_chunksize=300)))  # a re-executed task: all duplicates
    assert sum(r.total("frames") for r in again.reports) == 0
    assert sum(r.total("duplicate_rows") for r in again.reports) == raw.total("rows") + minutely.total("rows")


def _schema(t: pa.Table):
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(t.schema)


def test_fan_out_options_are_checked(nats_server, tmp_path):
    opts = options(nats_server.settings, tmp_path)
    schema = _schema(routed_rows(1).drop_columns([target_column(1)]))
    with pytest.raises(ConnectorOptionError, match=r"2 edge\(s\).*_isb_partition_1"):
        stream_writer(opts, schema)
    with pytest.raises(ConnectorOptionError, match=r"unknown key\(s\) frameRows"):
        WriterOptions.parse_targets({**opts, "targets": json.dumps([{"to": "raw", "frameRows": 5}])})
    with pytest.raises(ConnectorOptionError, match="named twice"):
        WriterOptions.parse_targets({**opts, "targets": json.dumps([{"to": "raw"}, {"to": "raw"}])})
    with pytest.raises(ConnectorOptionError, match="not JSON"):
        WriterOptions.parse_targets({**opts, "targets": "[raw"})


def test_spark_query_fans_out_in_one_pass(spark, nats_server, tmp_path):
    from pyspark.sql import functions as F

    settings = nats_server.settings
    run(_provision(settings))
    n = 3000
    df = (spark.readStream.format("isb-memory").option("rows", str(n)).option("batchRows", "1000")
          .option("columns", "id,service,value").load())
    df = (df.withColumn(target_column(0), F.when(F.col("id") % 2 == 0, F.lit(0)))
          .withColumn(target_column(1), F.pmod(F.col("id"), F.lit(2)).cast("int")))
    w = df.writeStream.format("jetstream").option("checkpointLocation", str(tmp_path / "ckpt"))
    for k, v in options(settings, tmp_path).items():
        w = w.option(k, v)
    q = w.trigger(availableNow=True).start()
    assert q.awaitTermination(240), "query did not finish"
    assert q.exception() is None, q.exception()
    assert sorted(stored(settings, "raw", 0)) == list(range(0, n, 2))
    assert sorted(stored(settings, "minutely", 0) + stored(settings, "minutely", 1)) == list(range(n))
    assert set(stored(settings, "minutely", 1)) == set(range(1, n, 2))
    totals = {to: read_write_totals(tmp_path / f"stats-{to}") for to in EDGES}
    assert (totals["raw"]["rows"], totals["minutely"]["rows"]) == (n // 2, n)
    assert totals["raw"]["batches"] == totals["minutely"]["batches"] == 3
