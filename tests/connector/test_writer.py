"""The JetStream stream writer and the dead-letter buffer, against a real nats-server and Spark.

Spark queries (``isb-memory`` source -> ``jetstream``) check routing by
``_isb_partition``, frame ids, commit stats and dead letters end to end; the
writer object called directly on the driver (with a fixed task identity)
checks deduplication of a re-executed batch and the full-buffer policies.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time

import pyarrow as pa
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from isbflow.connector.writer import (
    PARTITION_COLUMN,
    InvalidPartitionColumn,
    JetStreamStreamWriter,
    OutputBufferNotFound,
    WriterOptions,
    read_write_stats,
    read_write_totals,
)
from isbflow.isb import dlq, frames, naming
from isbflow.isb.connect import connect, session, settings_to_json
from isbflow.isb.errors import ConnectorOptionError
from isbflow.spec.models import OnFull
from tests.helpers.memory_source import memory_rows

PIPE, STEP, TO = "wp", "parse", "agg"
WAIT = 60.0  # bound on every wait in this file


# ----------------------------------------------------------------------------- fixtures and helpers


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, WAIT))


def ep(p: int) -> naming.EdgePartition:
    return naming.EdgePartition(PIPE, STEP, TO, p)


async def _provision(settings, partitions: int, **stream_kw) -> None:
    """What provisioning creates for the edge STEP -> TO: streams, the DLQ, the status KV."""
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        for p in range(partitions):
            await js.add_stream(StreamConfig(name=ep(p).stream, subjects=[ep(p).subject], duplicate_window=120.0,
                                             allow_direct=True, **stream_kw))
        await js.add_stream(StreamConfig(name=naming.dlq_stream(PIPE), subjects=[f"isb.{PIPE}.dlq.>"],
                                         duplicate_window=120.0, allow_direct=True))
        await js.create_key_value(bucket=naming.status_bucket(PIPE))
    finally:
        await nc.close()


def provision(settings, partitions: int = 2, **stream_kw) -> None:
    run(_provision(settings, partitions, **stream_kw))


async def _read_stream(settings, stream: str) -> list[tuple[int, dict, pa.Table]]:
    nc = await connect(settings)
    try:
        jsm = nc.jsm()
        state = (await jsm.stream_info(stream)).state
        out = []
        for seq in range(state.first_seq, state.last_seq + 1):
            m = await jsm.get_msg(stream, seq)
            out.append((m.seq, m.headers or {}, frames.decode(m.data)))
        return out
    finally:
        await nc.close()


def read_stream(settings, stream: str) -> list[tuple[int, dict, pa.Table]]:
    """Every frame of a stream: (seq, headers, records)."""
    return run(_read_stream(settings, stream))


def stream_msgs(settings, stream: str) -> int:
    async def go():
        nc = await connect(settings)
        try:
            return (await nc.jsm().stream_info(stream)).state.messages
        finally:
            await nc.close()

    return run(go())


def set_committed(settings, stream: str, seq: int) -> None:
    async def go():
        nc = await connect(settings)
        try:
            kv = await nc.jetstream().key_value(naming.status_bucket(PIPE))
            await kv.put(f"committed.{TO}.{stream}", str(seq).encode())
        finally:
            await nc.close()

    run(go())


def options(settings, **kw) -> WriterOptions:
    return WriterOptions(settings=settings, pipeline=PIPE, step=STEP, to=TO, **kw)


def rows_table(n: int, start: int = 0, partitions: int = 2) -> pa.Table:
    """n rows with a test-chosen partition column (id mod partitions)."""
    t = memory_rows(start, start + n, columns="id,service,value")
    return t.append_column(PARTITION_COLUMN, pa.array([i % partitions for i in range(start, start + n)], pa.int64()))


def write_direct(opts: WriterOptions, table: pa.Table, batch_id: int = 7, task: int = 0,
                 chunk: int = 2500):
    """The writer's task path, on the driver, as a Spark task with this batch id would run it."""
    writer = JetStreamStreamWriter(opts, task_identity=lambda: (batch_id, task))
    return writer.write(iter(table.to_batches(max_chunksize=chunk)))


def spark_write(spark, settings, checkpoint, source: dict, sink: dict, transform=None):
    from pyspark.sql import functions as F

    reader = spark.readStream.format("isb-memory")
    for k, v in source.items():
        reader = reader.option(k, str(v))
    df = reader.load()
    if transform is not None:
        df = transform(df)
    df = df.withColumn(PARTITION_COLUMN, F.pmod(F.xxhash64(F.col("service")), F.lit(2)))
    w = (df.writeStream.format("jetstream").option("checkpointLocation", str(checkpoint))
         .option("settings", settings_to_json(settings)).option("pipeline", PIPE).option("step", STEP)
         .option("to", TO).option("partitions", "2"))
    for k, v in sink.items():
        w = w.option(k, str(v))
    q = w.trigger(availableNow=True).start()
    assert q.awaitTermination(240), "query did not finish"
    assert q.exception() is None, q.exception()
    return q


# ----------------------------------------------------------------------------- Spark end to end

ID_RE = re.compile(rf"^{STEP}:(\d+):(\d+):(\d+):(\d+):([0-9a-f]{{16}})$")


def test_spark_query_routes_by_partition_column_with_deterministic_frame_ids(spark, nats_server, tmp_path):
    from pyspark.sql import functions as F

    settings = nats_server.settings
    provision(settings)
    n = 20_000
    stats_dir = tmp_path / "stats"
    spark_write(spark, settings, tmp_path / "ckpt",
                source={"rows": n, "batchRows": 10_000, "columns": "id,service,value", "services": 8,
                        "chunkRows": 3000},
                sink={"frameRows": 1000, "statsDir": stats_dir})

    expected = {r["service"]: r["p"] for r in spark.createDataFrame(
        [(f"svc-{k}",) for k in range(8)], "service string").select(
        "service", F.pmod(F.xxhash64("service"), F.lit(2)).alias("p")).collect()}
    assert len(set(expected.values())) == 2, "test data must hit both partitions"

    ids: list[int] = []
    seen_service: dict[str, set[int]] = {}
    for p in (0, 1):
        frames_p = read_stream(settings, ep(p).stream)
        assert frames_p, f"partition {p} got nothing"
        chunks_by_task: dict[tuple[int, int], list[int]] = {}
        for _seq, headers, t in frames_p:
            m = ID_RE.match(headers["Nats-Msg-Id"])
            assert m, headers["Nats-Msg-Id"]
            batch, task, part, chunk = map(int, m.groups()[:4])
            assert part == p
            chunks_by_task.setdefault((batch, task), []).append(chunk)
            assert headers[frames.HDR_ROWS] == str(t.num_rows)
            assert headers[frames.HDR_FRAME] == frames.FRAME_FORMAT
            assert t.num_rows <= 1000
            assert t.column_names == ["id", "service", "value"]  # partition column dropped
            ids.extend(t.column("id").to_pylist())
            for s in set(t.column("service").to_pylist()):
                seen_service.setdefault(s, set()).add(p)
        # chunks of one task are numbered 0.. in publish order
        for chunks in chunks_by_task.values():
            assert chunks == list(range(len(chunks)))
        assert {b for b, _ in chunks_by_task} == {0, 1}
    assert sorted(ids) == list(range(n))
    assert {s: ps for s, ps in seen_service.items()} == {s: {p} for s, p in expected.items()}

    stats = read_write_stats(stats_dir)
    assert [s["batchId"] for s in stats] == [0, 1]
    assert sum(s["rows"] for s in stats) == n
    assert sum(s["frames"] for s in stats) == stream_msgs(settings, ep(0).stream) + stream_msgs(settings, ep(1).stream)
    assert all(s["duplicate_frames"] == 0 and s["discarded_rows"] == 0 and s["failedTasks"] == 0 for s in stats)
    assert set(stats[0]["partitions"]) == {ep(0).stream, ep(1).stream}


def test_spark_oversized_record_goes_to_dead_letters_while_the_rest_flows(spark, nats_server, tmp_path):
    from pyspark.sql import functions as F

    settings = nats_server.settings
    provision(settings)
    n, big_id, max_payload = 3000, 777, 64 * 1024

    def add_payload(df):
        return (df.withColumn("_isb_id", F.concat(F.lit("mem/0/"), F.col("id").cast("string")))
                .withColumn("blob", F.when(F.col("id") == big_id, F.repeat(F.lit("x"), 200_000))
                            .otherwise(F.lit("small"))))

    spark_write(spark, settings, tmp_path / "ckpt",
                source={"rows": n, "columns": "id,service,value"},
                sink={"frameRows": 500, "maxPayload": max_payload, "statsDir": tmp_path / "stats"},
                transform=add_payload)

    ids = [i for p in (0, 1) for _, _, t in read_stream(settings, ep(p).stream) for i in t.column("id").to_pylist()]
    assert sorted(ids) == [i for i in range(n) if i != big_id]

    letters = run(dlq.read_dead_letters(settings, PIPE, STEP))
    assert len(letters) == 1
    letter = letters[0]
    assert letter["origin"] == f"mem/0/{big_id}"
    assert letter["step"] == STEP
    assert re.fullmatch(rf"record of \d+ bytes exceeds max_payload {max_payload} at step {STEP}", letter["reason"])
    assert letter["size"] > max_payload
    assert letter["truncated"] is True and letter["record"].startswith('{"id":777')
    assert letter["subject"] == naming.dlq_subject(PIPE, STEP)
    stats = read_write_stats(tmp_path / "stats")
    assert sum(s["dead_lettered"] for s in stats) == 1
    assert sum(s["rows"] for s in stats) == n - 1


def test_spark_many_batches_keep_running_totals_and_prune_batch_files(spark, nats_server, tmp_path):
    settings = nats_server.settings
    provision(settings)
    n, batch_rows, keep = 6000, 500, 4
    stats_dir = tmp_path / "stats"
    spark_write(spark, settings, tmp_path / "ckpt",
                source={"rows": n, "batchRows": batch_rows, "columns": "id,service,value"},
                sink={"frameRows": 100, "statsDir": stats_dir, "statsKeep": keep})

    batches = n // batch_rows
    assert len(list(stats_dir.iterdir())) <= keep + 1
    assert sorted(p.name for p in stats_dir.glob("batch-*.json")) == sorted(
        f"batch-{b}.json" for b in range(batches - keep, batches))
    totals = read_write_totals(stats_dir)
    stored = [t.num_rows for p in (0, 1) for _, _, t in read_stream(settings, ep(p).stream)]
    assert totals["rows"] == sum(stored) == n
    assert totals["frames"] == len(stored)
    assert (totals["batches"], totals["firstBatchId"], totals["lastBatchId"]) == (batches, 0, batches - 1)
    assert totals["dead_lettered"] == totals["duplicate_frames"] == totals["failedTasks"] == 0
    stats = read_write_stats(stats_dir)
    assert stats[0]["pruned"] and stats[0]["batches"] == batches - keep
    assert sum(s["rows"] for s in stats) == n and sum(s["frames"] for s in stats) == len(stored)


# ----------------------------------------------------------------------------- the writer called directly


def test_reexecuted_batch_is_dropped_as_duplicates(nats_server):
    settings = nats_server.settings
    provision(settings)
    opts = options(settings, partitions=2, frame_rows=1000)
    table = rows_table(10_000)

    first = write_direct(opts, table, batch_id=3, task=1)
    assert first.total("rows") == 10_000 and first.total("duplicate_frames") == 0
    stored = [stream_msgs(settings, ep(p).stream) for p in (0, 1)]
    assert sum(stored) == first.total("frames") == 10

    again = write_direct(opts, table, batch_id=3, task=1, chunk=777)  # Spark batches cut differently
    assert again.total("frames") == 0
    assert again.total("duplicate_frames") == 10 and again.total("duplicate_rows") == 10_000
    assert [stream_msgs(settings, ep(p).stream) for p in (0, 1)] == stored

    # a different batch id is new data: proves the drop above is by frame id
    later = write_direct(opts, table, batch_id=4, task=1)
    assert later.total("frames") == 10
    heads = [h["Nats-Msg-Id"].rsplit(":", 1)[0] for _, h, _ in read_stream(settings, ep(0).stream)]
    assert heads[:2] == [f"{STEP}:3:1:0:0", f"{STEP}:3:1:0:1"] and heads[5] == f"{STEP}:4:1:0:0"


def test_a_forged_frame_under_a_frames_position_does_not_suppress_it(nats_server):
    """Someone who can publish to the buffer pre-publishes frames under the ids the next batch
    will use (the position alone, as ids were before the digest, and the position with the
    digest of other bytes): the real frames still land, every real row is in the buffer."""
    settings = nats_server.settings
    provision(settings, partitions=1)
    stream = ep(0).stream
    opts = options(settings, partitions=1, frame_rows=1000)
    table = rows_table(3000, partitions=1)
    forged = frames.encode(pa.table({"id": [-1], "service": ["forged"], "value": [0.0]}))

    async def forge() -> None:
        async with session(settings) as nc:
            js = nc.jetstream()
            for c in range(3):
                for msg_id in (f"{STEP}:7:0:0:{c}", frames.frame_id(STEP, 7, 0, 0, c, forged)):
                    ack = await js.publish(ep(0).subject, forged, headers={
                        "Nats-Msg-Id": msg_id, frames.HDR_FRAME: frames.FRAME_FORMAT, frames.HDR_ROWS: "1"})
                    assert not ack.duplicate

    run(forge())
    report = write_direct(opts, table, batch_id=7, task=0)
    assert report.total("frames") == 3 and report.total("duplicate_frames") == 0
    got = read_stream(settings, stream)
    real = [i for _, _, t in got for i in t.column("id").to_pylist() if i >= 0]
    assert real == list(range(3000))  # nothing suppressed, order kept
    assert sum(1 for _, _, t in got if t.column("service").to_pylist() == ["forged"]) == 6
    # the same frames again (a re-executed batch) are still dropped as duplicates
    again = write_direct(opts, table, batch_id=7, task=0)
    assert again.total("duplicate_frames") == 3 and again.total("frames") == 0


def test_retry_until_success_waits_for_the_downstream_commit(nats_server):
    settings = nats_server.settings
    provision(settings, partitions=1)
    stream = ep(0).stream
    # capacity: ceil(3000 * 1.0 / 1000) = 3 frames; 10 frames to write
    opts = options(settings, partitions=1, frame_rows=1000, buffer_max_length=3000, buffer_usage_limit=1.0,
                   on_full=OnFull.RETRY_UNTIL_SUCCESS, window=4)
    table = rows_table(10_000, partitions=1)
    result: dict = {}

    def writer():
        try:
            result["report"] = write_direct(opts, table)
        except BaseException as e:  # surfaced by the assertion below
            result["error"] = e

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    deadline = time.monotonic() + WAIT
    while stream_msgs(settings, stream) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stream_msgs(settings, stream) == 3
    time.sleep(1.0)  # nothing committed downstream: the writer must still be waiting
    assert t.is_alive() and stream_msgs(settings, stream) == 3

    while t.is_alive() and time.monotonic() < deadline:  # the downstream consumes and commits
        set_committed(settings, stream, stream_msgs(settings, stream))
        time.sleep(0.1)
    t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not t.is_alive(), "writer did not finish after the downstream committed"
    assert "error" not in result, result.get("error")
    report = result["report"]
    assert report.total("rows") == 10_000 and report.total("discarded_rows") == 0
    got = read_stream(settings, stream)
    assert [h["Nats-Msg-Id"].rsplit(":", 1)[0] for _, h, _ in got] == [f"{STEP}:7:0:0:{c}" for c in range(10)]  # order kept
    assert [i for _, _, f in got for i in f.column("id").to_pylist()] == list(range(10_000))


def test_discard_latest_drops_and_counts(nats_server):
    settings = nats_server.settings
    provision(settings, partitions=1)
    set_committed(settings, ep(0).stream, 0)
    opts = options(settings, partitions=1, frame_rows=1000, buffer_max_length=3000, buffer_usage_limit=1.0,
                   on_full=OnFull.DISCARD_LATEST)
    report = write_direct(opts, rows_table(10_000, partitions=1))
    assert stream_msgs(settings, ep(0).stream) == 3
    assert report.total("frames") == 3 and report.total("rows") == 3000
    assert report.total("discarded_frames") == 7 and report.total("discarded_rows") == 7000


def test_stream_refusing_a_full_buffer_counts_as_full(nats_server):
    """A stream with discard NEW and its own max_msgs refuses frames; discardLatest counts them."""
    settings = nats_server.settings
    provision(settings, partitions=1, max_msgs=2, discard=DiscardPolicy.NEW)
    opts = options(settings, partitions=1, frame_rows=1000, on_full=OnFull.DISCARD_LATEST)
    report = write_direct(opts, rows_table(5000, partitions=1))
    assert stream_msgs(settings, ep(0).stream) == 2
    assert report.total("rows") == 2000 and report.total("discarded_rows") == 3000


def test_partition_column_out_of_range_fails_with_the_reason(nats_server):
    settings = nats_server.settings
    provision(settings)
    with pytest.raises(InvalidPartitionColumn, match=r"_isb_partition=2 but the edge has 2 partition"):
        write_direct(options(settings, partitions=2), rows_table(10, partitions=3))


def test_rows_without_partition_column_go_to_the_task_partition(nats_server):
    settings = nats_server.settings
    provision(settings)
    table = memory_rows(0, 100, columns="id,service,value")
    report = write_direct(options(settings, partitions=2), table, task=3)
    assert set(report.partitions) == {1}
    assert stream_msgs(settings, ep(1).stream) == 1 and stream_msgs(settings, ep(0).stream) == 0


def test_options_parse_and_reject(nats_server):
    base = {"settings": settings_to_json(nats_server.settings), "pipeline": PIPE, "step": STEP, "to": TO}
    o = WriterOptions.parse({**base, "partitions": "3", "bufferMaxLength": "25000", "onFull": "discardLatest"})
    assert (o.partitions, o.on_full, o.capacity_frames) == (3, OnFull.DISCARD_LATEST, 2)  # ceil(25000*0.8/10000)
    assert o.settings == nats_server.settings
    for bad, match in (({"onFull": "dropOldest"}, "onFull"), ({"partitions": "0"}, "partitions"),
                       ({"bufferUsageLimit": "1.5"}, "bufferUsageLimit"), ({"to": ""}, "'to' is required"),
                       ({"committedKey": "c.{nope}"}, "committedKey")):
        with pytest.raises(ConnectorOptionError, match=match):
            WriterOptions.parse({**base, **bad})


def test_dead_letter_is_never_larger_than_max_payload():
    record = {"_isb_id": "src/0/9", "text": "\n\"" * 50_000}
    letter = dlq.DeadLetter(record=record, reason="record of 1 bytes\nexceeds", size=1)
    headers, body = dlq.encode_dead_letter(letter, STEP, max_payload=8192)
    assert len(body) <= 8192 - frames.HEADER_ROOM
    assert headers[dlq.HDR_ORIGIN] == "src/0/9" and "\n" not in headers[dlq.HDR_REASON]
    small = dlq.encode_dead_letter(dlq.DeadLetter(record={"a": b"\x00"}, reason="r"), STEP, 8192)[1]
    assert b'"truncated":false' in small and b'"record":{"a":"AA=="}' in small


def test_missing_output_buffer_is_named(nats_server):
    settings = nats_server.settings
    with pytest.raises(OutputBufferNotFound, match=r"output buffer isb-wp-parse-agg-0 does not exist.*isbflow isb apply"):
        write_direct(options(settings, partitions=1), rows_table(10, partitions=1))


def test_dead_letters_from_plain_code_are_read_back_by_vertex(nats_server):
    settings = nats_server.settings
    provision(settings, partitions=1)
    stored = dlq.publish_dead_letters_sync(settings, PIPE, "enrich", [{"_isb_id": "src/1/5", "n": 1}, {"n": 2}],
                                           reason="value out of range")
    assert stored == 2
    assert run(dlq.read_dead_letters(settings, PIPE, STEP)) == []
    letters = run(dlq.read_dead_letters(settings, PIPE))
    assert [(x["origin"], x["record"], x["reason"], x["step"]) for x in letters] == [
        ("src/1/5", {"_isb_id": "src/1/5", "n": 1}, "value out of range", "enrich"),
        ("", {"n": 2}, "value out of range", "enrich")]


def test_empty_task_publishes_nothing(nats_server):
    settings = nats_server.settings
    provision(settings)
    report = write_direct(options(settings, partitions=2), rows_table(0))
    assert report.partitions == {} and stream_msgs(settings, ep(0).stream) == 0


def test_missing_dead_letter_buffer_is_named(nats_server):
    with pytest.raises(dlq.DeadLetterBufferNotFound, match=r"isb-wp-dlq does not store isb\.wp\.dlq\.x.*isb apply"):
        dlq.publish_dead_letters_sync(nats_server.settings, PIPE, "x", [{"n": 1}], reason="r")
