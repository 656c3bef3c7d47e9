"""Fault injection on Redis buffers (issue #44): scenarios c and e of tests/recovery/test_faults.py
in one run of a detached driver on a real redis-server, ending with the same sink checks.

e. a slow step behind a tiny buffer: ``minutely`` lets one frame wait in front of it
(tests/specs/fault-redis.yaml), so ``parse``'s writer, having stored a batch's frame for ``raw``,
waits for room (back-pressure, never a dropped frame);
c. the driver is SIGKILLed (driver, JVM and Python workers at once) at such a moment, with
records still arriving, and started again on the same checkpoints: the batch it was running runs
again, writes its ``raw`` frame again, and the partition's dedup index stores it once.

Then every raw record is in the raw sink exactly once, each malformed event is one dead letter,
and the aggregate sink equals a batch recount of the raw sink.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from isbflow.connector.writer import read_write_stats
from isbflow.isb import naming
from isbflow.isb.connect import connect
from isbflow.isb.redis.keys import BufferKeys
from isbflow.isb.roles import pipeline_user
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from isbflow.spec.paths import DataDir
from isbflow.steps.launch import launch_pipeline, stop_launch
from tests.helpers import recovery as h

SPEC = h.SPECS / "fault-redis.yaml"
MALFORMED_EVERY = 250
#: frames the partition parse -> minutely may hold: ceil(bufferMaxLength 400 x 50% / 10000 rows a frame)
CAPACITY = 1


def _partitions(settings, p) -> tuple[list[str], set[str]]:
    """The frame ids parse -> minutely holds, and those the dedup index of parse -> raw holds."""
    async def go():
        store = await connect(settings, name="isbflow-tests")
        try:
            held = await store.client.xrange(BufferKeys(naming.EdgePartition(p.name, "parse", "minutely", 0).stream).stream)
            ids = await store.client.zrange(BufferKeys(naming.EdgePartition(p.name, "parse", "raw", 0).stream).ids, 0, -1)
            return [f[b"id"].decode() for _, f in held], {i.decode() for i in ids}
        finally:
            await store.close()

    return asyncio.run(go())


def _batch_of(frame_id: str) -> int:
    """The micro-batch a frame id names (``<step>:<batch>:<task>:<partition>:<chunk>:<digest>``)."""
    return int(frame_id.split(":")[1])


def _all_running(settings, p, pid: int) -> bool:
    return all(s is not None and s.pid == pid and s.state == "running" for s in h.statuses(settings, p).values())


@pytest.mark.timeout(900)
def test_redis_driver_killed_while_its_writer_waits_for_room_restarts_exact(spark, redis_server, tmp_path):
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    admin = redis_server.settings()
    ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
    assert user.user == pipeline_user(p.name)  # the driver runs as the pipeline's ACL user
    data_dir = tmp_path / "data"
    source = naming.source_stream(p, "in")
    first, rate = 1000, 100
    h.publish(admin, p, first, malformed_every=MALFORMED_EVERY)
    producer = h.Producer(admin, p, first, rate, malformed_every=MALFORMED_EVERY)
    parse_checkpoint = DataDir(data_dir).checkpoint(p.name, "parse")
    fullest = 0
    try:
        rec = launch_pipeline(SPEC, data_dir, user, workdir=h.ROOT)
        h.wait_for(lambda: _all_running(admin, p, rec.pid), 300,
                   lambda: f"every step of the driver to run: {h.driver_report(admin, p, rec)}")
        producer.start()
        h.wait_for(lambda: h.committed(admin, p, "in", source) > first, 300,
                   lambda: f"the driver to read the live records: {h.driver_report(admin, p, rec)}")

        def waiting_for_room() -> int | None:
            """parse's running batch once it has stored its raw frame and minutely's partition is full
            of earlier batches' frames (its writer waits for room), else None."""
            nonlocal fullest
            running = h.in_flight(parse_checkpoint)
            held, raw_ids = _partitions(admin, p)
            fullest = max(fullest, len(held))
            if (running and len(held) >= CAPACITY and all(_batch_of(f) < running[-1] for f in held)
                    and any(_batch_of(i) == running[-1] for i in raw_ids)):
                return running[-1]
            return None

        batch = h.wait_for(waiting_for_room, 120, lambda: f"parse's writer to wait for room in minutely's "
                           f"partition: {h.driver_report(admin, p, rec)}", every=0.1)
        assert producer.is_alive() and producer.error is None, "records must still flow at the kill"

        h.kill_group(rec.pid)

        assert batch in h.in_flight(parse_checkpoint), (
            f"parse's batch {batch} committed before the kill: its writer did not wait for room")
        at_kill = producer.published
        h.wait_for(lambda: producer.published >= at_kill + 2 * rate or producer.error, 60,
                   "the producer to publish while the driver is down")
        published = first + producer.stop(60)
        h.relaunch_and_drain(SPEC, data_dir, user, p, rec, source, published)
    finally:
        producer.stopped.set()
        stop_launch(data_dir, p.name, grace=20)

    bad = h.malformed_seqs(1, 0, published, MALFORMED_EVERY)
    raw = h.sink_path(data_dir, p, "raw")
    h.assert_raw_exact(raw, h.expected_ids(published, bad))
    assert len(h.dead_letters(admin, p)) == len(bad)  # each once, though batches ran twice
    h.assert_aggregates_match(spark, raw, h.sink_path(data_dir, p, "agg"))
    stats = DataDir(data_dir).stats
    to_minutely = read_write_stats(stats(p.name, "parse", "minutely"))
    assert sum(s["blockedSeconds"] for s in to_minutely) > 0  # the writer did wait for room ...
    assert sum(s["discarded_rows"] for s in to_minutely) == 0  # ... dropped nothing ...
    assert fullest <= CAPACITY  # ... and the partition, looked at every 0.1 s, never held more than its limit
    # the batch that ran again stored nothing twice: its raw frame was a duplicate of the first run's
    assert sum(s["duplicate_frames"] for s in read_write_stats(stats(p.name, "parse", "raw"))) > 0


def test_produce_on_redis_keeps_to_its_rate(redis_server):
    """``produce`` with a rate on a Redis source writes at that rate however few events it sends
    (the producer above sends a second's worth a call)."""
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    admin = redis_server.settings()
    ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    t0 = time.monotonic()
    report = asyncio.run(produce(admin, p, count=300, seed=h.SEED, rate=200))
    took = time.monotonic() - t0
    # 300 events at 200/s: 1.4 s after the first burst of 20 (a tenth of a second's worth)
    assert report.published == 300 and took >= 1.2, (report.to_json(), took)
