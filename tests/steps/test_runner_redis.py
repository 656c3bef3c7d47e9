"""The demo pipeline on Redis buffers (pipelines/logs-redis.yaml) end to end, on a real
redis-server and a real SparkSession: provisioned through the Redis store (its streams, its ACL
user), the reference table in a Redis hash, events produced into the source stream, every step
run available-now as the pipeline's own ACL user, and every sink exact: the raw sink holds each
good event once, the errors sink exactly the raw sink's ERROR events, the dead letters every
malformed one, the aggregates a batch recount; the buffers are released once committed."""

from __future__ import annotations

import asyncio
import json

from deltalake import DeltaTable

from isbflow.isb import reference
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.isb.state import Observed
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import is_malformed, produce
from isbflow.spec import load_specs
from isbflow.steps.runner import PipelineRunner
from tests.conftest import ROOT
from tests.steps.test_runner import check_agg_is_batch_recount

MALFORMED_EVERY = 500


def test_the_demo_runs_on_redis_buffers_with_every_sink_exact(spark, redis_server, tmp_path):
    specs = load_specs(ROOT / "pipelines" / "logs-redis.yaml")
    p = specs.only_pipeline()
    assert specs.service_for(p).store == "redis"
    admin = redis_server.settings()
    report = ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
    assert report.changed and {r.action.value for r in report.resources} == {"created"}
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(admin, p.name, "services", rows))
    count = 5_000
    produced = asyncio.run(produce(admin, p, count=count, seed=7, malformed_every=MALFORMED_EVERY))
    assert produced.published == count
    again = asyncio.run(produce(admin, p, count=count, seed=7, malformed_every=MALFORMED_EVERY))
    assert (again.published, again.duplicates) == (0, count)  # the same events again: stored once

    # the steps log in as the pipeline's own ACL user, as a launched driver does
    user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
    assert user.user == pipeline_user(p.name)
    data_dir = tmp_path
    runner = PipelineRunner(spark, specs, p, user, data_dir)
    try:
        out = runner.run_available_now()
    finally:
        runner.close()
    assert [out[v].state for v in p.topological_order()] == [Observed.STOPPED] * 7

    raw = DeltaTable(str(data_dir / "sinks/logs-redis/raw")).to_pyarrow_table()
    ids = raw.column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == {f"in/0/{i + 1}" for i in range(count) if not is_malformed(i, MALFORMED_EVERY)}
    errors = DeltaTable(str(data_dir / "sinks/logs-redis/errors")).to_pyarrow_table()
    want_errors = {r["_isb_id"] for r in raw.select(["_isb_id", "level"]).to_pylist() if r["level"] == "ERROR"}
    assert want_errors and sorted(errors.column("_isb_id").to_pylist()) == sorted(want_errors)
    letters = asyncio.run(read_dead_letters(admin, p.name, "in"))
    assert len(letters) == count // MALFORMED_EVERY and all(dl["step"] == "in" for dl in letters)
    assert out["in"].dlq_total == count // MALFORMED_EVERY
    check_agg_is_batch_recount(spark, data_dir, sinks="sinks/logs-redis")

    # every internal buffer was released up to what its downstream step committed
    async def held() -> dict[str, int]:
        store = await connect(admin)
        try:
            out = {}
            for s in pipeline_grants(p).buffers:
                st = await store.buffers().state(s)
                out[s] = st.messages if st is not None else -1
            return out
        finally:
            await store.close()

    assert set(asyncio.run(held()).values()) == {0}
