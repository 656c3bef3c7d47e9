"""Recovery on Redis buffers (real redis-server, real SparkSession): frames sit in the partition
enrich -> raw when its keys are deleted (what an eviction or an operator's DEL leaves); the loss
is detected, and `recover` recreates the region's partitions with a new incarnation, rewinds and
replays from the source's offsets, and the raw sink ends exact, as on JetStream
(tests/recovery/test_recover.py); the demo then runs on as its own ACL user with every sink exact
(raw, the errors routed by tags, the aggregates a batch recount), the malformed events dead
letters, and every edge partition released up to its downstream's commit. Then the whole server is flushed (what a restart without
persistence or a failover to an empty replica leaves): the watchdog finds every buffer the steps
had read lost and turns red, and a step run again fails naming the lost source stream instead of
reading on as if nothing had been there (the flush took the source too: nothing to replay from).
Numaflow's Redis buffer stalls in both cases."""

from __future__ import annotations

import asyncio
import json

import pytest
from deltalake import DeltaTable

from isbflow.isb import naming, reference
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.loss import detect_loss
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.isb.state import Observed, StepStatus, put_status
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import is_malformed, produce
from isbflow.ops.replay import ReplayError, replay
from isbflow.recovery.recover import recover
from isbflow.recovery.watchdog import watch
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner, StepError
from tests.conftest import ROOT
from tests.helpers.recovery import run_available_now
from tests.steps.test_runner import check_agg_is_batch_recount

MALFORMED_EVERY = 500
COUNT = 4_000


def good_ids(count):
    return {f"in/0/{i + 1}" for i in range(count) if not is_malformed(i, MALFORMED_EVERY)}


def raw_ids(data_dir) -> list[str]:
    return DeltaTable(str(data_dir / "sinks/logs-redis/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


def test_recover_after_a_redis_partition_is_deleted_and_a_flush_is_loss(spark, redis_server, tmp_path):
    specs = load_specs(ROOT / "pipelines" / "logs-redis.yaml")
    p = specs.only_pipeline()
    admin = redis_server.settings()
    ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(admin, p.name, "services", rows))
    assert asyncio.run(produce(admin, p, count=COUNT, seed=7, malformed_every=MALFORMED_EVERY)).published == COUNT
    user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
    data_dir = tmp_path
    run_available_now(spark, specs, p, user, data_dir, only=["in", "parse", "enrich"])
    lost = naming.EdgePartition(p.name, "enrich", "raw", 0).stream

    async def delete_and_detect():
        store = await connect(admin)
        try:
            before = await detect_loss(store, p, data_dir)
            held = (await store.buffers().state(lost)).messages
            await store.buffer(lost).delete()
            return before, held, await detect_loss(store, p, data_dir)
        finally:
            await store.close()

    before, held, after = asyncio.run(delete_and_detect())
    assert before == [] and held > 0
    assert [b.stream for b in after] == [lost]

    report = recover(spark, specs, p, admin, data_dir)  # recovery is the operator's, as on JetStream
    assert report.ok, json.dumps(report.to_json(), default=str)
    assert [b.stream for b in report.lost] == [lost]
    assert [ph.name for ph in report.phases] == ["detect", "drain", "recreate", "rewind", "replay", "verify"]
    assert report.replayed_records == COUNT
    raw = next(s for s in report.sinks if s.sink == "raw")
    assert (raw.verified, raw.duplicates, raw.missing) == (True, 0, 0)
    ids = raw_ids(data_dir)
    assert len(ids) == len(set(ids)) and set(ids) == good_ids(COUNT)

    # the pipeline goes on normally after recovery, and nothing reads as lost
    assert asyncio.run(produce(admin, p, count=1_000, seed=7, start=COUNT,
                               malformed_every=MALFORMED_EVERY)).published == 1_000
    out = run_available_now(spark, specs, p, user, data_dir)
    assert [out[v].state for v in p.topological_order()] == [Observed.STOPPED] * 7
    ids = raw_ids(data_dir)
    assert len(ids) == len(set(ids)) and set(ids) == good_ids(COUNT + 1_000)
    # the demo's other sinks and its dead letters, as on JetStream (tests/steps/test_runner.py)
    raw = DeltaTable(str(data_dir / "sinks/logs-redis/raw")).to_pyarrow_table()
    errors = DeltaTable(str(data_dir / "sinks/logs-redis/errors")).to_pyarrow_table().column("_isb_id").to_pylist()
    want_errors = {r["_isb_id"] for r in raw.select(["_isb_id", "level"]).to_pylist() if r["level"] == "ERROR"}
    assert want_errors and sorted(errors) == sorted(want_errors)
    letters = asyncio.run(read_dead_letters(admin, p.name, "in"))
    assert len(letters) == (COUNT + 1_000) // MALFORMED_EVERY and all(dl["step"] == "in" for dl in letters)
    check_agg_is_batch_recount(spark, data_dir, sinks="sinks/logs-redis")

    async def detect_and_held():
        store = await connect(admin)
        try:
            held = {s: (await store.buffers().state(s)).messages for s in pipeline_grants(p).buffers}
            return await detect_loss(store, p, data_dir), held
        finally:
            await store.close()

    lost_now, held = asyncio.run(detect_and_held())
    assert lost_now == []
    assert set(held.values()) == {0}  # every edge partition released up to its downstream's commit

    # then the whole server loses its data (FLUSHALL: what a restart without persistence or a
    # failover to an empty replica leaves): buffer loss, never an empty buffer
    async def flush_and_look():
        store = await connect(admin)
        try:
            await store.client.flushall()
            for v in p.topological_order():  # the steps' next heartbeats: they still run
                await put_status(store, p.name, StepStatus(vertex=v, state="running"))
            return await detect_loss(store, p, data_dir)
        finally:
            await store.close()

    lost_all = asyncio.run(flush_and_look())
    source = pipeline_grants(p).sources[0]
    assert source in {d.stream for d in lost_all}
    assert all(d.reason == "the stream no longer exists" for d in lost_all)
    assert next(d for d in lost_all if d.stream == source).first == COUNT + 1_000 + 1  # all after what was read
    report = asyncio.run(watch(admin, p, data_dir))
    assert not report.healthy and any(f.kind == "buffer-lost" for f in report.findings), report.to_json()
    # a step run again does not take the flushed source for an empty one
    runner = PipelineRunner(spark, specs, p, user, data_dir)
    try:
        with pytest.raises(StepError) as failed:
            runner.run_available_now()
    finally:
        runner.close()
    assert source in str(failed.value)
    # nor does reprocessing a range: the source stream it would read again is gone with the flush
    with pytest.raises(ReplayError, match=f"source stream {source} of 'in' does not exist"):
        replay(lambda: spark, specs, p, admin, data_dir, mode="reprocess", from_offset="in/0:1", to_offset="in/0:100")
