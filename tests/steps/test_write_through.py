"""A Delta sink written through (isbflow.steps.write_through, isbflow.sinks.delta_through): the read
tasks write the Parquet, the driver commits each micro-batch once. Real nats-server frames buffers,
a real SparkSession local[2], real Delta tables; the exactly-once cases of the Spark writer's
tests (tests/sinks/test_delta.py) for this path."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable
from pyspark.errors import StreamingQueryException
from pyspark.sql.types import LongType, StringType, StructField, StructType

from isbflow.isb import frames, ledger
from isbflow.ops.produce import produce
from isbflow.sinks import delta_through
from isbflow.sinks.delta import DeltaSinkOptions, read_sink, sink_app_id
from isbflow.sinks.delta_spark import DeltaBatchWriter
from isbflow.sinks.delta_through import DeltaThroughWriter
from isbflow.spec.models import Limits
from isbflow.steps import write_through
from isbflow.steps.runner import PipelineRunner
from tests.connector.test_reader import make_stream, nats_do, options
from tests.steps.test_runner import MALFORMED_EVERY, good_ids

pytestmark = pytest.mark.slow

SCHEMA = StructType([StructField("id", LongType()), StructField("msg", StringType()),
                     StructField(ledger.ID_COLUMN, StringType())])
APP = sink_app_id("logs", "raw", "0")
TOTAL = {"a": 1200, "b": 700}  # rows published into each of the two streams


def publish(settings, stream: str, partition: int, count: int) -> None:
    """``count`` rows as frames of 100 rows, ``_isb_id`` ``in/<partition>/<seq>`` from 1."""
    t = pa.table({"id": pa.array(range(partition * 10_000, partition * 10_000 + count), pa.int64()),
                  "msg": [f"m{i}" for i in range(count)],
                  ledger.ID_COLUMN: [f"in/{partition}/{i}" for i in range(1, count + 1)]})
    split = frames.split_frames(t, 1 << 20, 100)

    async def fn(nc, js):
        for f in split.frames:
            await js.publish(stream, f.payload, headers={frames.HDR_FRAME: frames.FRAME_FORMAT,
                                                          frames.HDR_ROWS: str(f.rows)})
    nats_do(settings, fn)


@pytest.fixture
def buffers(nats_server):
    for i, (name, count) in enumerate(TOTAL.items()):
        make_stream(nats_server.settings, name)
        publish(nats_server.settings, name, i, count)
    return nats_server


def sink_options(table: Path) -> dict[str, str]:
    return {"path": str(table), "appId": APP}


def run(spark, nats, table: Path, ckpt: Path, through: bool = True):
    """The buffers ``a,b`` into the table (500 rows a batch, availableNow); the query."""
    reader = spark.readStream.options(**options(nats, "a,b", readMaxRows=500, mode="frames"))
    if through:
        df = reader.format(write_through.FORMAT).options(
            **write_through.through_options(SCHEMA, sink_options(table))).load()
        writer = DeltaThroughWriter(DeltaSinkOptions.from_options(sink_options(table)))
    else:
        df = reader.format("jetstream").schema(SCHEMA).load()
        writer = DeltaBatchWriter(DeltaSinkOptions.from_options(sink_options(table)))
    q = (df.writeStream.foreachBatch(writer).option("checkpointLocation", str(ckpt))
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(180), "availableNow query did not finish"
        if q.exception() is not None:
            raise q.exception()
        return q
    finally:
        q.stop()


def parquet_files(table: Path) -> set[str]:
    return {os.path.normpath(os.path.join(d, f)) for d, _, fs in os.walk(table)
            if "_delta_log" not in d for f in fs if f.endswith(".parquet")}


def unreferenced(table: Path) -> set[str]:
    referenced = {os.path.normpath(u) for u in DeltaTable(str(table)).file_uris()}
    return {f for f in parquet_files(table) - referenced if "_isb_pending" not in f}


def assert_exactly_once(table: Path) -> None:
    got = read_sink(str(table))
    assert got.num_rows == sum(TOTAL.values())
    assert pc.count_distinct(got[ledger.ID_COLUMN]).as_py() == got.num_rows
    assert unreferenced(table) == set()
    assert not (table / "_isb_pending").exists() or not any((table / "_isb_pending").iterdir())


def test_every_record_lands_once_counted_with_its_offsets(spark, buffers, tmp_path):
    table = tmp_path / "t"
    q = run(spark, buffers, table, tmp_path / "ckpt")

    assert_exactly_once(table)
    data = [p for p in q.recentProgress if p["numInputRows"] > 0]
    # Spark counts the records (the null rows behind each task's message), not the messages
    assert sum(p["numInputRows"] for p in data) == sum(TOTAL.values())
    assert len(data) >= 4 and all(p["numInputRows"] <= 500 for p in data)
    history = sorted(DeltaTable(str(table)).history(), key=lambda h: h["version"])
    assert [h["isb.batchId"] for h in history] == [p["batchId"] for p in data]
    assert DeltaTable(str(table)).transaction_version(APP) == data[-1]["batchId"]
    held = ledger.history_offsets(history)
    assert held == {"in/0": [[1, TOTAL["a"]]], "in/1": [[1, TOTAL["b"]]]}


def test_a_table_of_the_spark_writer_goes_on_written_through(spark, buffers, tmp_path):
    """The two paths make the same table: a sink written by an older isbflow (Spark's writer)
    takes the batches written through after an upgrade."""
    spark_table, table = tmp_path / "spark", tmp_path / "t"
    run(spark, buffers, spark_table, tmp_path / "ckpt-spark", through=False)
    run(spark, buffers, table, tmp_path / "ckpt")
    assert DeltaTable(str(table)).schema().to_json() == DeltaTable(str(spark_table)).schema().to_json()
    assert read_sink(str(table)).sort_by("id").equals(read_sink(str(spark_table)).sort_by("id"))

    # the Spark writer's table, its checkpoint's last batch made to run again written through
    # (its commit is in the table: nothing is added), then new records
    shutil.rmtree(tmp_path / "ckpt-spark" / "commits")
    (tmp_path / "ckpt-spark" / "commits").mkdir()
    run(spark, buffers, spark_table, tmp_path / "ckpt-spark")
    assert_exactly_once(spark_table)


def test_a_batch_rerun_after_the_driver_died_before_its_commit_doubles_nothing(spark, buffers, tmp_path,
                                                                                monkeypatch):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    real, failed = delta_through.commit_batch, []

    def dies_once(opts, messages, batch_id, tables=None):
        if batch_id == 1 and not failed:
            failed.append(batch_id)
            assert messages and all(os.path.exists(os.path.join(opts.path, a.path))
                                    for m in messages for a in m.actions), "the tasks wrote the files"
            raise RuntimeError("injected driver failure before the Delta commit")
        return real(opts, messages, batch_id, tables)

    monkeypatch.setattr(delta_through, "commit_batch", dies_once)
    with pytest.raises(StreamingQueryException, match="injected"):
        run(spark, buffers, table, ckpt)
    assert read_sink(str(table)).num_rows == 500  # batch 0 only
    assert unreferenced(table)  # a dead driver cleans nothing up: batch 1's files stay

    run(spark, buffers, table, ckpt)
    assert_exactly_once(table)


def test_a_batch_whose_commit_landed_runs_again_and_adds_nothing(spark, buffers, tmp_path):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    run(spark, buffers, table, ckpt)
    version, files = DeltaTable(str(table)).version(), parquet_files(table)
    last = max(int(f.name) for f in (ckpt / "commits").iterdir() if f.name.isdigit())

    # the Delta commit of the last batch landed, Spark's checkpoint commit did not
    (ckpt / "commits" / str(last)).unlink()
    (ckpt / "commits" / f".{last}.crc").unlink(missing_ok=True)
    q = run(spark, buffers, table, ckpt)

    assert q.lastProgress["batchId"] == last and q.lastProgress["numInputRows"] > 0  # it ran again
    assert DeltaTable(str(table)).version() == version
    assert parquet_files(table) == files  # the re-run's files were removed
    assert_exactly_once(table)


def test_options_are_checked(spark, nats_server, tmp_path):
    from isbflow.isb.errors import ConnectorOptionError

    with pytest.raises(ConnectorOptionError, match="frameSchema"):
        write_through._parse({**options(nats_server, "a"), "delta": "{}"})
    with pytest.raises(ConnectorOptionError, match="reads frames"):
        write_through._parse({**options(nats_server, "a", mode="events", sourceName="in"),
                              **write_through.through_options(SCHEMA, sink_options(tmp_path / "t"))})


def test_the_sink_vertices_of_the_demo_are_written_through_and_a_policy_keeps_spark_s_writer(tmp_path):
    from isbflow.spec import load_specs
    from isbflow.steps.delta_sink import writes_through
    from tests.conftest import ROOT

    p = load_specs(ROOT / "pipelines" / "logs.yaml").only_pipeline()
    assert {v.name for v in p.spec.vertices if writes_through(v)} == {"raw", "agg", "errors"}

    # a sink whose failed batch goes to a fallback hands its rows on: Spark's writer, rows in the batch
    text = (ROOT / "pipelines" / "logs.yaml").read_text().replace(
        "          path: sinks/logs/raw\n",
        "          path: sinks/logs/raw\n        retryStrategy:\n          backoff:\n            interval: 10ms\n"
        "            steps: 2\n          onFailure: fallback\n        fallback:\n          delta:\n"
        "            path: sinks/logs/raw-failed\n", 1)
    (tmp_path / "logs.yaml").write_text(text)
    p = load_specs(tmp_path / "logs.yaml").only_pipeline()
    assert {v.name for v in p.spec.vertices if writes_through(v)} == {"agg", "errors"}


def test_a_replay_reads_a_written_through_sink_in_larger_batches(spark, demo):
    """Recovery's runner (``replay=True``) reads a written-through sink's buffer in batches of
    ``write_through.replay_read_rows``: with ``readBatchSize`` 10,000 (one frame of up to 10,000 rows
    a live batch) the sink's several frames are one replay batch, and land once each."""
    specs, p, settings, data_dir = demo
    small = {"in": 500, "parse": 10_000, "enrich": 10_000, "raw": 10_000}  # raw: one frame a live batch
    spec = p.spec.model_copy(update={"vertices": [
        v.model_copy(update={"limits": Limits(readBatchSize=small[v.name])}) if v.name in small else v
        for v in p.spec.vertices]})
    p = p.model_copy(update={"spec": spec})
    count = 2_000
    asyncio.run(produce(settings, p, count=count, seed=7, malformed_every=MALFORMED_EVERY))
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        runner.run_available_now(only=["in", "parse", "enrich"])  # frames into enrich -> raw, a few a batch
        [stream] = runner.input_streams("raw")
    finally:
        runner.close()

    async def messages(nc, js):
        return (await js.stream_info(stream)).state.messages

    frames_in = nats_do(settings, messages)
    assert frames_in >= 3, "the test needs a buffer a live read takes several batches for"
    replay = PipelineRunner(spark, specs, p, settings, data_dir, replay=True)
    try:
        replay.run_available_now(only=["raw"])
        commits = Path(replay.checkpoint("raw", p.query_to("raw"))) / "commits"
    finally:
        replay.close()
    assert sorted(int(f.name) for f in commits.iterdir() if f.name.isdigit()) == [0]  # one batch, not frames_in
    ids = DeltaTable(str(data_dir / "sinks/logs/raw")).to_pyarrow_table().column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids))
    assert set(ids) == good_ids(0, count)
