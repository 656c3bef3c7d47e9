"""The jetstream reader (isbflow.connector.reader, offsets, fastread, release) against a real
nats-server and a real SparkSession local[2]."""

from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pytest
from nats.js.api import RetentionPolicy, StreamConfig
from pyspark.errors import StreamingQueryException
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows
from pyspark.sql.types import LongType, StringType, StructField, StructType

from isbflow.connector import offsets as off
from isbflow.connector.options import ReaderOptions
from isbflow.connector.reader import EVENTS_SCHEMA, JetStreamPartition
from isbflow.connector.source import JetStreamDataSource
from isbflow.isb import frames
from isbflow.isb.connect import connect, settings_from_json, settings_to_json
from isbflow.isb.errors import BufferLost, BufferNotFound, ConnectorOptionError
from isbflow.isb.read import consume_range, read_range, stream_state
from isbflow.isb.release import interest_hold_consumer, release

SCHEMA = StructType([StructField("id", LongType()), StructField("msg", StringType())])
ROWS_PER_FRAME = 100


# ---------------------------------------------------------------- helpers

def nats_do(settings, fn):
    """Run ``await fn(nc, js)`` on a fresh connection; returns its result."""
    async def go():
        nc = await connect(settings)
        try:
            return await fn(nc, nc.jetstream())
        finally:
            await nc.close()
    return asyncio.run(go())


def make_stream(settings, name, retention="limits", hold_consumer=False):
    async def fn(nc, js):
        await js.add_stream(StreamConfig(name=name, subjects=[name], allow_direct=True,
                                         retention=RetentionPolicy(retention)))
        if hold_consumer:
            await js.add_consumer(name, interest_hold_consumer())
    nats_do(settings, fn)


def rows(lo, hi):
    return pa.table({"id": pa.array(range(lo, hi), pa.int64()),
                     "msg": [f"m{i}" for i in range(lo, hi)]})


def publish_frames(settings, stream, lo, hi):
    """Rows lo..hi-1 as frames of ROWS_PER_FRAME rows, acked publishes with frame headers."""
    split = frames.split_frames(rows(lo, hi), 1 << 20, ROWS_PER_FRAME)

    async def fn(nc, js):
        for f in split.frames:
            await js.publish(stream, f.payload, headers={frames.HDR_FRAME: frames.FRAME_FORMAT,
                                                          frames.HDR_ROWS: str(f.rows)})
    nats_do(settings, fn)
    return len(split.frames)


def publish_events(settings, stream, payloads):
    async def fn(nc, js):
        for p in payloads:
            await js.publish(stream, p)
    nats_do(settings, fn)


def state(settings, stream):
    return nats_do(settings, lambda nc, js: stream_state(nc, stream))


def options(nats, streams, **kw):
    o = {"streams": streams, "settings": settings_to_json(nats.settings),
         "frameRows": str(ROWS_PER_FRAME)}
    o.update({k: str(v) for k, v in kw.items()})
    return o


def stream_reader(nats, streams, schema=SCHEMA, **kw):
    return JetStreamDataSource(options(nats, streams, **kw)).streamReader(schema)


def read_all(reader, parts):
    return pa.Table.from_batches([b for p in parts for b in reader.read(p)])


# ---------------------------------------------------------------- pure parts

def test_fair_share_splits_a_cap_across_streams():
    assert off.fair_share({"a": 10, "b": 1, "c": 10}, 15) == {"a": 7, "b": 1, "c": 7}
    assert off.fair_share({"a": 10, "b": 1}, 100) == {"a": 10, "b": 1}
    assert off.fair_share({"a": 0, "b": 5}, 3) == {"a": 0, "b": 3}
    assert sum(off.fair_share({"a": 3, "b": 3, "c": 3}, 2).values()) == 2


def test_batch_range_follows_rebase_and_idles():
    a = off.StreamOffset("inc1", 10)
    assert off.batch_range(a, off.StreamOffset("inc1", 15)) == (11, 15)
    assert off.batch_range(a, a) == (11, 10)  # empty
    rebased = off.StreamOffset("inc2", 7, rebased_from=0, lost={"first": 11, "last": None, "reason": "x"})
    assert off.batch_range(a, rebased) == (1, 7)
    assert off.batch_range(rebased, rebased) == (8, 7)  # an idle rebased stream reads nothing again
    assert off.from_json(off.to_json({"s": rebased})) == {"s": rebased}


def test_options_are_checked_and_settings_round_trip(nats_server):
    s = nats_server.settings
    assert settings_from_json(settings_to_json(s)) == s
    with pytest.raises(ConnectorOptionError, match="'streams' is required"):
        ReaderOptions.parse({"settings": settings_to_json(s)})
    with pytest.raises(ConnectorOptionError, match="'sourceName' is required"):
        ReaderOptions.parse({"streams": "a", "mode": "events", "settings": settings_to_json(s)})
    with pytest.raises(ConnectorOptionError, match="'readMaxRows': must be >= 1"):
        ReaderOptions.parse({"streams": "a", "readMaxRows": "0", "settings": settings_to_json(s)})
    with pytest.raises(ConnectorOptionError, match="'settings'"):
        ReaderOptions.parse({"streams": "a", "settings": "{\"nope\": 1}"})
    o = ReaderOptions.parse({"streams": "a, b", "settings": settings_to_json(s), "frameRows": "100"})
    assert o.streams == ("a", "b") and o.read_max_rows == 100_000
    assert o.max_messages(250) == 3
    with pytest.raises(ConnectorOptionError, match="needs the frames' schema"):
        JetStreamDataSource({"streams": "a", "settings": settings_to_json(s)}).schema()


# ---------------------------------------------------------------- range reads

def test_frames_range_read_is_exact_and_repeatable(nats_server):
    s = nats_server.settings
    make_stream(s, "f0")
    assert publish_frames(s, "f0", 0, 2500) == 25
    r = stream_reader(nats_server, "f0")
    inc = state(s, "f0").incarnation
    part = JetStreamPartition("f0", 0, inc, 3, 7)
    first = read_all(r, [part])
    assert first.column("id").to_pylist() == list(range(200, 700))
    assert first.schema.equals(pa.schema([("id", pa.int64()), ("msg", pa.string())]))
    assert read_all(r, [part]).equals(first)

    # tiny chunks and byte budgets force pipelined and re-issued direct gets: same messages
    async def chunks(nc, js):
        return [m[0] async for msgs in read_range(nc, "f0", 1, 25, chunk_msgs=4, chunk_bytes=1,
                                                   inflight=3) for m in msgs]
    assert nats_do(s, chunks) == list(range(1, 26))


def test_events_read_carries_ids_sequence_stream_and_time(nats_server):
    s = nats_server.settings
    make_stream(s, "ev")
    payloads = [json.dumps({"i": i}).encode() for i in range(30)] + [b"\xff\xfenot utf8"]
    publish_events(s, "ev", payloads)
    r = stream_reader(nats_server, "other,ev", EVENTS_SCHEMA, mode="events", sourceName="logs")
    inc = state(s, "ev").incarnation
    t = read_all(r, [JetStreamPartition("ev", 1, inc, 5, 31)])
    assert t.num_rows == 27
    assert t.column("_isb_id").to_pylist()[:2] == ["logs/1/5", "logs/1/6"]
    assert t.column("_isb_seq").to_pylist() == list(range(5, 32))
    assert set(t.column("_isb_stream").to_pylist()) == {"ev"}
    assert json.loads(t.column("value")[0].as_py()) == {"i": 4}
    assert t.column("value")[-1].as_py().endswith("not utf8")  # kept, for the dead-letter path
    assert t.column("_isb_ts").null_count == 0


def test_a_missing_sequence_inside_the_range_is_buffer_loss(nats_server):
    s = nats_server.settings
    make_stream(s, "ev")
    publish_events(s, "ev", [b"x%d" % i for i in range(10)])
    nats_do(s, lambda nc, js: js.delete_msg("ev", 5))
    inc = state(s, "ev").incarnation
    part = JetStreamPartition("ev", 0, inc, 1, 10)
    with pytest.raises(BufferLost, match=r"buffer ev lost sequences 5: .*removed"):
        read_all(stream_reader(nats_server, "ev", EVENTS_SCHEMA, mode="events", sourceName="x"), [part])
    replay = stream_reader(nats_server, "ev", EVENTS_SCHEMA, mode="events", sourceName="x",
                           onBufferLoss="replay")
    assert read_all(replay, [part]).column("_isb_seq").to_pylist() == [1, 2, 3, 4, 6, 7, 8, 9, 10]
    # a partition of an incarnation that is gone
    gone = JetStreamPartition("ev", 0, "2000-01-01T00:00:00Z", 1, 3)
    with pytest.raises(BufferLost, match="recreated"):
        read_all(stream_reader(nats_server, "ev", EVENTS_SCHEMA, mode="events", sourceName="x"), [gone])
    assert list(replay.read(gone)) == []


@pytest.mark.parametrize("path", [read_range, consume_range])
def test_both_read_paths_give_the_range_and_name_gaps(nats_server, path):
    s = nats_server.settings
    make_stream(s, "ev")
    publish_events(s, "ev", [b"x%d" % i for i in range(30)])

    def seqs(first, last, **kw):
        async def fn(nc, js):
            return [m[0] async for msgs in path(nc, "ev", first, last, chunk_msgs=7, **kw) for m in msgs]
        return nats_do(s, fn)

    assert seqs(3, 25) == list(range(3, 26))
    for seq in (10, 11, 29, 30):  # a run inside the range, and the stream's tail
        nats_do(s, lambda nc, js, seq=seq: js.delete_msg("ev", seq))
    with pytest.raises(BufferLost, match="buffer ev lost sequences 10-11: "):
        seqs(1, 30)
    gaps = []
    got = seqs(1, 30, on_gap=lambda a, b: gaps.append((a, b)))
    assert got == [i for i in range(1, 29) if i not in (10, 11)]
    assert gaps == [(10, 11), (29, 30)]


def test_consumer_path_receives_only_its_range(nats_server):
    """A read task of a long stream must not be sent the rest of the stream (a push
    consumer did: every task of a 1M-event stream received everything after its start)."""
    s = nats_server.settings
    make_stream(s, "long")
    publish_events(s, "long", [b"e%d" % i for i in range(3000)])

    async def fn(nc, js):
        before = nc.stats["in_msgs"]
        got = [m[0] async for msgs in consume_range(nc, "long", 101, 600, chunk_msgs=100) for m in msgs]
        await asyncio.sleep(0.5)  # anything still in flight would arrive now
        return got, nc.stats["in_msgs"] - before

    got, received = nats_do(s, fn)
    assert got == list(range(101, 601))
    assert received < 600, f"received {received} messages for a 500-message range"


def test_consumer_path_keeps_headers_times_and_the_connection_usable(nats_server):
    """The consumer path takes deliveries off nats-py's parser as raw bytes (raw.deliver_raw):
    each message keeps its payload, headers and store time, nats-py still counts what arrives,
    and the same connection still answers requests during and after the read."""
    s = nats_server.settings
    make_stream(s, "hdr")

    async def publish(nc, js):
        for i in range(40):
            await js.publish("hdr", b"e%d" % i, headers={"Nats-Msg-Id": f"id-{i}", "X-Kind": "log"}
                             if i % 2 else None)
    nats_do(s, publish)

    async def fn(nc, js):
        before = nc.stats["in_msgs"]
        got = []
        async for msgs in consume_range(nc, "hdr", 1, 40, chunk_msgs=16):
            got += msgs
            assert (await stream_state(nc, "hdr")).last_seq == 40  # a request beside the read
        return got, nc.stats["in_msgs"] - before

    got, received = nats_do(s, fn)
    assert [m[0] for m in got] == list(range(1, 41))
    assert [m[1] for m in got] == [b"e%d" % i for i in range(40)]
    assert got[1][2] == {"Nats-Msg-Id": "id-1", "X-Kind": "log"} and got[0][2] == {}
    assert all(isinstance(m[3], int) and m[3] > 1.7e18 for m in got)  # store time, ns since the epoch
    assert received >= 40

    async def bare(nc, js):
        return [m async for msgs in consume_range(nc, "hdr", 1, 40, keep_headers=False) for m in msgs]
    assert [m[2] for m in nats_do(s, bare)] == [{}] * 40  # the events path reads no headers


# ---------------------------------------------------------------- offsets and admission control

def test_latest_offset_caps_by_read_limit_fairly_and_idles(nats_server):
    s = nats_server.settings
    make_stream(s, "a")
    make_stream(s, "b")
    publish_frames(s, "a", 0, 1000)      # 10 frames
    publish_frames(s, "b", 1000, 1300)   # 3 frames
    r = stream_reader(nats_server, "a,b", maxMessagesPerPartition=2)
    try:
        start = r.initialOffset()
        assert {k: v["seq"] for k, v in start.items()} == {"a": 0, "b": 0}
        assert r.getDefaultReadLimit() == ReadMaxRows(100_000)
        end = r.latestOffset(start, ReadMaxRows(800))  # 8 frames: b has 3, a gets the rest
        assert {k: v["seq"] for k, v in end.items()} == {"a": 5, "b": 3}
        parts = r.partitions(start, end)
        assert [(p.stream, p.first, p.last) for p in parts] == [
            ("a", 1, 2), ("a", 3, 4), ("a", 5, 5), ("b", 1, 2), ("b", 3, 3)]
        assert sorted(read_all(r, parts).column("id").to_pylist()) == list(range(500)) + list(range(1000, 1300))
        last = r.latestOffset(end, ReadAllAvailable())
        assert {k: v["seq"] for k, v in last.items()} == {"a": 10, "b": 3}
        assert r.partitions(end, last)[0].first == 6
        assert r.latestOffset(last, ReadMaxRows(800)) == last  # nothing new: start comes back
        assert r.partitions(last, last) == []
    finally:
        r.stop()


def test_task_size_fills_the_task_slots_only_for_a_batch_worth_splitting():
    from isbflow.connector.offsets import task_size

    assert task_size([40], 100, 2, 4) == 20  # one buffer partition, 40 frames: two tasks, not one
    assert task_size([40], 100, 1, 4) == 100  # minPartitions 1: as before
    assert task_size([30, 10], 100, 2, 4) == 100  # two streams: two tasks already
    # more than min_tasks: whole rounds of the slots (4 tasks of 63: 2 rounds of 63, not 100 then 100 || 50)
    assert task_size([250], 100, 2, 4) == 63
    assert task_size([500], 100, 2, 4) == 84  # 6 tasks in 3 rounds, not 5 whose last round is one task
    assert task_size([250, 250], 100, 2, 4) == 84  # 3 + 3
    assert task_size([120, 10], 100, 2, 4) == 100  # no size makes 2 rounds of 2 of these streams
    assert task_size([250], 100, 1, 4) == 100  # minPartitions 1: as before
    assert task_size([7], 100, 2, 4) == 100  # under 4 frames a task: one task
    assert task_size([8], 100, 2, 4) == 4
    assert task_size([900], 50_000, 2, 5_000) == 50_000  # a few hundred events: one task
    assert task_size([30_000], 50_000, 4, 5_000) == 7_500
    assert task_size([0, 0], 100, 2, 4) == 100


def test_a_large_batch_of_one_stream_is_read_by_min_partitions_tasks(nats_server):
    s = nats_server.settings
    make_stream(s, "a")
    publish_frames(s, "a", 0, 1200)  # 12 frames
    r = stream_reader(nats_server, "a", minPartitions="3")
    try:
        start = r.initialOffset()
        end = r.latestOffset(start, ReadAllAvailable())
        parts = r.partitions(start, end)
        assert [(p.first, p.last) for p in parts] == [(1, 4), (5, 8), (9, 12)]  # one task without the option
        assert sorted(read_all(r, parts).column("id").to_pylist()) == list(range(1200))
        small = r.latestOffset(end, ReadAllAvailable())
        publish_frames(s, "a", 1200, 1500)  # 3 frames: under 4 a task, one task
        more = r.latestOffset(small, ReadAllAvailable())
        assert [(p.first, p.last) for p in r.partitions(small, more)] == [(13, 15)]
    finally:
        r.stop()


def test_available_now_freezes_the_end(nats_server):
    s = nats_server.settings
    make_stream(s, "a")
    publish_frames(s, "a", 0, 500)
    r = stream_reader(nats_server, "a")
    try:
        start = r.initialOffset()
        r.prepareForTriggerAvailableNow()
        publish_frames(s, "a", 500, 900)
        end = r.latestOffset(start, ReadMaxRows(300))
        assert end["a"]["seq"] == 3
        end = r.latestOffset(end, ReadMaxRows(300))
        assert end["a"]["seq"] == 5
        assert r.latestOffset(end, ReadMaxRows(300)) == end
    finally:
        r.stop()


def test_buffer_loss_is_detected_and_replay_rebases(nats_server):
    s = nats_server.settings
    make_stream(s, "ev")
    publish_events(s, "ev", [b"e%d" % i for i in range(10)])
    r = stream_reader(nats_server, "ev", EVENTS_SCHEMA, mode="events", sourceName="x")
    try:
        start = r.initialOffset()
        mid = r.latestOffset(start, ReadMaxRows(3))
        assert mid["ev"]["seq"] == 3
        # first sequence moved past the offset (purged before being read)
        nats_do(s, lambda nc, js: js.purge_stream("ev", seq=7))
        with pytest.raises(BufferLost, match=r"buffer ev lost sequences 4-6: the stream's first sequence moved"):
            r.latestOffset(mid, ReadMaxRows(3))
        # stream deleted
        nats_do(s, lambda nc, js: js.delete_stream("ev"))
        with pytest.raises(BufferLost, match=r"buffer ev lost sequences 4-10: the stream no longer exists"):
            r.latestOffset(mid, ReadMaxRows(3))
        # recreated: a new incarnation
        make_stream(s, "ev")
        publish_events(s, "ev", [b"n%d" % i for i in range(4)])
        with pytest.raises(BufferLost, match=r"lost sequences 4-10: the stream was recreated"):
            r.latestOffset(mid, ReadMaxRows(3))
        with pytest.raises(BufferLost, match="recreated"):
            read_all(r, r.partitions(start, mid))  # the old range is gone too
    finally:
        r.stop()

    replay = stream_reader(nats_server, "ev", EVENTS_SCHEMA, mode="events", sourceName="x",
                           onBufferLoss="replay")
    try:
        end = replay.latestOffset(mid, ReadMaxRows(3))
        new_inc = state(s, "ev").incarnation
        assert end["ev"]["inc"] == new_inc and end["ev"]["seq"] == 3 and end["ev"]["from"] == 0
        assert end["ev"]["lost"]["first"] == 4 and "recreated" in end["ev"]["lost"]["reason"]
        got = read_all(replay, replay.partitions(mid, end))
        assert got.column("value").to_pylist() == ["n0", "n1", "n2"]
        nxt = replay.latestOffset(end, ReadMaxRows(3))
        assert nxt["ev"] == {"inc": new_inc, "seq": 4}
        assert read_all(replay, replay.partitions(end, nxt)).column("value").to_pylist() == ["n3"]
    finally:
        replay.stop()


def test_missing_stream_at_start_is_named(nats_server):
    r = stream_reader(nats_server, "nope")
    try:
        with pytest.raises(BufferNotFound, match="buffer nope does not exist"):
            r.initialOffset()
    finally:
        r.stop()


# ---------------------------------------------------------------- release

def _seqs(settings, stream):
    st = state(settings, stream)
    return (st.first_seq, st.last_seq, st.messages)


@pytest.mark.parametrize("retention", ["limits", "workqueue", "interest"])
def test_release_frees_only_committed_messages(nats_server, retention):
    s = nats_server.settings
    make_stream(s, "buf", retention, hold_consumer=retention == "interest")
    publish_events(s, "buf", [b"m%d" % i for i in range(10)])
    # committed-but-not-released messages stay readable, whatever the retention
    assert _seqs(s, "buf") == (1, 10, 10)
    inc = state(s, "buf").incarnation
    r = stream_reader(nats_server, "buf", EVENTS_SCHEMA, mode="events", sourceName="x")
    assert read_all(r, [JetStreamPartition("buf", 0, inc, 1, 10)]).num_rows == 10
    assert _seqs(s, "buf") == (1, 10, 10)  # reading removed nothing

    purged = asyncio.run(release(s, "buf", 6, retention, incarnation=inc))
    if retention == "limits":
        assert purged == 0 and _seqs(s, "buf") == (1, 10, 10)
    else:
        assert purged == 6 and _seqs(s, "buf") == (7, 10, 4)
        assert read_all(r, [JetStreamPartition("buf", 0, inc, 7, 10)]).num_rows == 4
        assert asyncio.run(release(s, "buf", 6, retention, incarnation=inc)) == 0  # idempotent
    # a stale incarnation never purges the new stream's messages
    assert asyncio.run(release(s, "buf", 9, retention, incarnation="2000-01-01T00:00:00Z")) == 0


def test_interest_stream_without_consumer_keeps_nothing(nats_server):
    """Why provisioning needs interest_hold_consumer() on Interest streams."""
    s = nats_server.settings
    make_stream(s, "bare", "interest")
    publish_events(s, "bare", [b"m"] * 5)
    assert state(s, "bare").messages == 0


# ---------------------------------------------------------------- through Spark

def _run_available_now(spark, df, checkpoint, on_batch=None):
    """Run df to completion with availableNow; returns ({batch id: sorted ids}, progress)."""
    got: dict[int, list] = {}

    def each(batch_df, batch_id):
        got[batch_id] = sorted(r[0] for r in batch_df.select(batch_df.columns[0]).collect())
        if on_batch is not None:
            on_batch(batch_id)

    q = (df.writeStream.foreachBatch(each).option("checkpointLocation", str(checkpoint))
         .trigger(availableNow=True).start())
    try:
        assert q.awaitTermination(180), "availableNow query did not finish"
        if q.exception() is not None:
            raise q.exception()
        return got, q.recentProgress
    finally:
        q.stop()


def test_spark_available_now_honours_the_read_limit_and_replays_exactly(spark, nats_server, tmp_path):
    s = nats_server.settings
    make_stream(s, "a")
    make_stream(s, "b")
    publish_frames(s, "a", 0, 1200)       # 12 frames
    publish_frames(s, "b", 5000, 5700)    # 7 frames
    df = (spark.readStream.format("jetstream").options(**options(nats_server, "a,b", readMaxRows=500))
          .schema(SCHEMA).load())
    got, progress = _run_available_now(spark, df, tmp_path / "ckpt")
    data = [p for p in progress if p["numInputRows"] > 0]
    assert len(data) == 4 and all(p["numInputRows"] <= 500 for p in data)
    all_ids = sorted(i for ids in got.values() for i in ids)
    assert all_ids == list(range(1200)) + list(range(5000, 5700))

    # the same offset range read again (batch read) gives the same rows
    p1 = next(p for p in data if p["batchId"] == 1)
    src = p1["sources"][0]
    again = (spark.read.format("jetstream")
             .options(**options(nats_server, "a,b", startingOffsets=src["startOffset"],
                                endingOffsets=src["endOffset"]))
             .schema(SCHEMA).load())
    assert sorted(r[0] for r in again.select("id").collect()) == got[1]


def test_spark_processing_time_is_capped_and_events_parse(spark, nats_server, tmp_path):
    from pyspark.sql import functions as F

    s = nats_server.settings
    make_stream(s, "ev")
    publish_events(s, "ev", [json.dumps({"n": i, "level": "info"}).encode() for i in range(1000)])
    df = (spark.readStream.format("jetstream")
          .options(**options(nats_server, "ev", mode="events", sourceName="logs", readMaxRows=300))
          .load())
    assert df.schema == EVENTS_SCHEMA
    parsed = df.select(F.from_json("value", "n INT, level STRING").alias("e"), "_isb_id").select("e.n", "_isb_id")
    q = (parsed.writeStream.format("memory").queryName("events_capped")
         .option("checkpointLocation", str(tmp_path / "ckpt"))
         .trigger(processingTime="200 milliseconds").start())
    try:
        q.processAllAvailable()
        sizes = [p["numInputRows"] for p in q.recentProgress if p["numInputRows"] > 0]
        assert sum(sizes) == 1000 and max(sizes) <= 300 and len(sizes) >= 4
        out = spark.table("events_capped")
        assert out.count() == 1000
        assert out.filter(F.col("_isb_id") == F.concat(F.lit("logs/0/"), (F.col("n") + 1).cast("string"))).count() == 1000
    finally:
        q.stop()


def test_spark_query_fails_with_the_lost_range(spark, nats_server, tmp_path):
    s = nats_server.settings
    make_stream(s, "ev")
    publish_events(s, "ev", [b"{}"] * 100)
    df = (spark.readStream.format("jetstream")
          .options(**options(nats_server, "ev", mode="events", sourceName="x", readMaxRows=30))
          .load())

    def delete_after_first(batch_id):
        if batch_id == 0:
            nats_do(s, lambda nc, js: js.delete_stream("ev"))

    with pytest.raises(StreamingQueryException, match=r"buffer ev lost sequences 31-100: the stream no longer exists"):
        _run_available_now(spark, df, tmp_path / "ckpt", on_batch=delete_after_first)
