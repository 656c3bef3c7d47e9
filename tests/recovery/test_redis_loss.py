"""A Redis that loses its data is buffer loss, never an empty buffer (real redis-server, real
SparkSession): the demo on Redis runs once, the server is flushed (FLUSHALL: what a restart
without persistence or a failover to an empty replica leaves), and then the watchdog finds every
buffer the steps had read lost and turns red, a step run again fails naming the lost stream
instead of reading on as if nothing had been there. (A flush takes the source stream with it:
recovery replays from a source, tests/recovery/test_recover_redis.py.) Numaflow's Redis buffer
stalls in this case."""

from __future__ import annotations

import asyncio
import json

import pytest

from isbflow.isb import reference
from isbflow.isb.connect import connect
from isbflow.isb.loss import detect_loss
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.isb.state import StepStatus, put_status
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import produce
from isbflow.ops.replay import ReplayError, replay
from isbflow.recovery.watchdog import watch
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner, StepError
from tests.conftest import ROOT


def test_a_flushed_redis_is_buffer_loss_the_watchdog_turns_red(spark, redis_server, tmp_path):
    specs = load_specs(ROOT / "pipelines" / "logs-redis.yaml")
    p = specs.only_pipeline()
    admin = redis_server.settings()
    ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(admin, p.name, "services", rows))
    asyncio.run(produce(admin, p, count=2_000, seed=5))
    user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
    runner = PipelineRunner(spark, specs, p, user, tmp_path)
    try:
        runner.run_available_now()
    finally:
        runner.close()

    async def flush_and_look():
        store = await connect(admin)
        try:
            await store.client.flushall()
            for v in p.topological_order():  # the steps' next heartbeats: they still run
                await put_status(store, p.name, StepStatus(vertex=v, state="running"))
            return await detect_loss(store, p, tmp_path)
        finally:
            await store.close()

    lost = asyncio.run(flush_and_look())
    source = pipeline_grants(p).sources[0]
    assert source in {d.stream for d in lost}
    assert all(d.reason == "the stream no longer exists" for d in lost)
    assert next(d for d in lost if d.stream == source).first == 2_001  # everything after what was read

    report = asyncio.run(watch(admin, p, tmp_path))
    assert not report.healthy
    assert any(f.kind == "buffer-lost" for f in report.findings), report.to_json()

    # a step run again does not take the flushed source for an empty one
    runner = PipelineRunner(spark, specs, p, user, tmp_path)
    try:
        with pytest.raises(StepError) as failed:
            runner.run_available_now()
    finally:
        runner.close()
    assert source in str(failed.value)

    # reprocessing a range (and shadow runs) read JetStream buffers only
    with pytest.raises(ReplayError, match="reprocessing and shadow runs is not available on Redis buffers yet"):
        replay(lambda: spark, specs, p, admin, tmp_path, mode="reprocess", from_offset="in/0/1")
