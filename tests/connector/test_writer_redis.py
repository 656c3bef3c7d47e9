"""The stream writer's task path on a Redis store (a real redis-server): the same contract as on
JetStream (tests/connector/test_writer.py), through the store's writer role: a re-executed batch
is stored once, a full partition holds the writer back until the downstream releases
(retryUntilSuccess) or drops and counts (discardLatest), order is kept, and a record too large
for a frame goes to the dead-letter buffer; a partition that does not exist (lost) is refused,
never made again by the writer."""

from __future__ import annotations

import asyncio
import threading
import time

import pyarrow as pa
import pytest

from isbflow.connector.writer import PARTITION_COLUMN, JetStreamStreamWriter, WriterOptions
from isbflow.isb import dlq, frames, naming
from isbflow.isb.connect import connect
from isbflow.isb.store import BufferMissing
from isbflow.spec.models import OnFull
from tests.helpers.memory_source import memory_rows

PIPE, STEP, TO = "wr", "parse", "agg"
WAIT = 60.0


def ep(p: int) -> naming.EdgePartition:
    return naming.EdgePartition(PIPE, STEP, TO, p)


def options(settings, **kw) -> WriterOptions:
    return WriterOptions(settings=settings, pipeline=PIPE, step=STEP, to=TO, **kw)


def rows_table(n: int, start: int = 0, partitions: int = 2) -> pa.Table:
    t = memory_rows(start, start + n, columns="id,service,value")
    return t.append_column(PARTITION_COLUMN, pa.array([i % partitions for i in range(start, start + n)], pa.int64()))


def write_direct(opts: WriterOptions, table: pa.Table, batch_id: int = 7, task: int = 0, chunk: int = 2500):
    writer = JetStreamStreamWriter(opts, task_identity=lambda: (batch_id, task))
    return writer.write(iter(table.to_batches(max_chunksize=chunk)))


def stored(settings, stream: str) -> list[tuple[int, str, list[int]]]:
    """(offset, frame id, row ids) of every frame the partition holds."""

    async def go():
        store = await connect(settings)
        try:
            st = await store.buffers().state(stream)
            if st is None:
                return []
            out = []
            async for chunk in store.buffers().read_range(stream, st.first_seq, st.last_seq):
                for seq, data, headers, _ in chunk:
                    ids = [i for b in frames.read_frame(data, headers[frames.HDR_ROWS]) for i in b.column("id").to_pylist()]
                    out.append((seq, headers["Isb-Frame-Id"], ids))
            return out
        finally:
            await store.close()

    return asyncio.run(asyncio.wait_for(go(), WAIT))


def release(settings, stream: str, upto: int) -> int:
    async def go():
        store = await connect(settings)
        try:
            return await store.buffers().release(stream, upto, "WorkQueue")
        finally:
            await store.close()

    return asyncio.run(go())


async def _on_partitions(settings, verb: str, partitions: range = range(2)) -> None:
    store = await connect(settings)
    try:
        for p in partitions:
            await getattr(store.buffer(ep(p).stream), verb)()
    finally:
        await store.close()


@pytest.fixture(autouse=True)
def provisioned(redis_server):
    """The edge's partitions, made as provisioning makes them (a writer never makes one)."""
    asyncio.run(_on_partitions(redis_server.settings(), "create"))


def test_a_partition_lost_is_refused_and_not_made_again(redis_server):
    settings = redis_server.settings()
    asyncio.run(_on_partitions(settings, "delete", range(1, 2)))  # what a flush or a DEL leaves
    with pytest.raises(BufferMissing, match=ep(1).stream):
        write_direct(options(settings, partitions=2, frame_rows=1000), rows_table(4_000))

    async def created():
        store = await connect(settings)
        try:
            return await store.buffer(ep(1).stream).created()
        finally:
            await store.close()

    assert asyncio.run(created()) is False  # still lost: detected as such, recovered by recover


def test_a_reexecuted_batch_is_stored_once_and_another_batch_is_new(redis_server):
    settings = redis_server.settings()
    opts = options(settings, partitions=2, frame_rows=1000)
    table = rows_table(10_000)
    first = write_direct(opts, table, batch_id=3, task=1)
    assert first.total("rows") == 10_000 and first.total("frames") == 10 and first.total("duplicate_frames") == 0
    again = write_direct(opts, table, batch_id=3, task=1, chunk=777)  # Spark batches cut differently
    assert again.total("frames") == 0 and again.total("duplicate_frames") == 10
    assert again.total("duplicate_rows") == 10_000
    held = [stored(settings, ep(p).stream) for p in (0, 1)]
    assert [len(h) for h in held] == [5, 5]
    assert sorted(i for h in held for _, _, ids in h for i in ids) == list(range(10_000))
    later = write_direct(opts, table, batch_id=4, task=1)
    assert later.total("frames") == 10
    heads = [fid.rsplit(":", 1)[0] for _, fid, _ in stored(settings, ep(0).stream)]
    assert heads[:2] == [f"{STEP}:3:1:0:0", f"{STEP}:3:1:0:1"] and heads[5] == f"{STEP}:4:1:0:0"


def test_retry_until_success_waits_for_the_downstream_release_and_keeps_order(redis_server):
    settings = redis_server.settings()
    stream = ep(0).stream
    # capacity: ceil(3000 * 1.0 / 1000) = 3 frames; 10 frames to write
    opts = options(settings, partitions=1, frame_rows=1000, buffer_max_length=3000, buffer_usage_limit=1.0,
                   on_full=OnFull.RETRY_UNTIL_SUCCESS)
    result: dict = {}

    def writer():
        try:
            result["report"] = write_direct(opts, rows_table(10_000, partitions=1))
        except BaseException as e:  # surfaced by the assertion below
            result["error"] = e

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    deadline = time.monotonic() + WAIT
    while len(stored(settings, stream)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # nothing released downstream: the writer must still be waiting
    assert t.is_alive() and len(stored(settings, stream)) == 3
    seen: list[tuple[int, str, list[int]]] = []
    while t.is_alive() and time.monotonic() < deadline:  # the downstream reads, commits and releases
        held = stored(settings, stream)
        seen += [h for h in held if not seen or h[0] > seen[-1][0]]
        if held:
            release(settings, stream, held[-1][0])
        time.sleep(0.1)
    t.join(timeout=max(0.0, deadline - time.monotonic()))
    seen += [h for h in stored(settings, stream) if not seen or h[0] > seen[-1][0]]
    assert not t.is_alive() and "error" not in result, result.get("error")
    report = result["report"]
    assert report.total("rows") == 10_000 and report.total("discarded_rows") == 0 and report.blocked_seconds > 0
    assert [fid.rsplit(":", 1)[0] for _, fid, _ in seen] == [f"{STEP}:7:0:0:{c}" for c in range(10)]
    assert [i for _, _, ids in seen for i in ids] == list(range(10_000))


def test_discard_latest_drops_and_counts(redis_server):
    settings = redis_server.settings()
    opts = options(settings, partitions=1, frame_rows=1000, buffer_max_length=3000, buffer_usage_limit=1.0,
                   on_full=OnFull.DISCARD_LATEST)
    report = write_direct(opts, rows_table(10_000, partitions=1))
    assert len(stored(settings, ep(0).stream)) == 3
    assert report.total("frames") == 3 and report.total("rows") == 3000
    assert report.total("discarded_frames") == 7 and report.total("discarded_rows") == 7000


def test_a_record_too_large_for_a_frame_is_dead_lettered_and_the_rest_flows(redis_server):
    settings = redis_server.settings()
    table = memory_rows(0, 50, columns="id,service,value")
    big = pa.table({"id": [50], "service": ["x" * 40_000], "value": [1.0]}).cast(table.schema)
    table = pa.concat_tables([table, big])
    report = write_direct(options(settings, partitions=1, max_payload=16_384), table)
    assert report.total("rows") == 50 and report.total("dead_lettered") == 1
    letters = asyncio.run(dlq.read_dead_letters(settings, PIPE, STEP))
    assert len(letters) == 1 and "exceeds max_payload 16384" in letters[0]["reason"]
    assert letters[0]["truncated"] and letters[0]["step"] == STEP
    assert [i for _, _, ids in stored(settings, ep(0).stream) for i in ids] == list(range(50))
