"""Recovery on Redis buffers (real redis-server, real SparkSession): frames sit in the partition
enrich -> raw when its keys are deleted (what an eviction or an operator's DEL leaves); the loss
is detected, and `recover` recreates the region's partitions with a new incarnation, rewinds and
replays from the source's offsets, and the raw sink ends exact, as on JetStream
(tests/recovery/test_recover.py). Numaflow's Redis buffer stalls in this case."""

from __future__ import annotations

import asyncio
import json

from deltalake import DeltaTable

from isbflow.isb import naming, reference
from isbflow.isb.connect import connect
from isbflow.isb.loss import detect_loss
from isbflow.isb.roles import pipeline_user
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import is_malformed, produce
from isbflow.recovery.recover import recover
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.helpers.recovery import run_available_now

MALFORMED_EVERY = 500
COUNT = 5_000


def good_ids(count):
    return {f"in/0/{i + 1}" for i in range(count) if not is_malformed(i, MALFORMED_EVERY)}


def raw_ids(data_dir) -> list[str]:
    return DeltaTable(str(data_dir / "sinks/logs-redis/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


def test_recover_after_a_redis_partition_is_deleted(spark, redis_server, tmp_path):
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
    run_available_now(spark, specs, p, user, data_dir)
    ids = raw_ids(data_dir)
    assert len(ids) == len(set(ids)) and set(ids) == good_ids(COUNT + 1_000)

    async def detect():
        store = await connect(admin)
        try:
            return await detect_loss(store, p, data_dir)
        finally:
            await store.close()

    assert asyncio.run(detect()) == []
