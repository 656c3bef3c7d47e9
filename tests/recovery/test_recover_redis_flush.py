"""Loss on Redis buffers, recovered (real redis-server, real SparkSession), for a pipeline whose
source is outside Redis (landed files, tests/specs/flush-redis.yaml):

- a partition is deleted while the pipeline drains: the step writing into it (refused, as on
  JetStream, instead of making it again) or the one reading it fails, the drain stops, and
  `recover` (which drains what still runs) makes the raw sink exact;
- the redis-server, started without persistence, restarts and comes back empty (what a FLUSHALL
  or a failover to an empty replica leaves too): every buffer, the ledger's keys, the steps'
  statuses, the dead letters and the reference table are gone. The loss is detected on every
  partition, the watchdog turns red, and recovery refuses to replay through a step whose
  reference table is gone (naming it; the dry run says so too);
- once the table is put again, a partition lost as the replay begins stops `recover`, naming it;
  the next `recover` takes what the sinks hold from their own Delta history, replays the landed
  files into new partitions, and every sink ends exact: each well-formed line once in the raw
  sink (a file landed during the outage too), the malformed ones dead letters again, the
  aggregates a batch recount. Numaflow's Redis buffer stalls here."""

from __future__ import annotations

import asyncio
import json

import pytest
from deltalake import DeltaTable

from isbflow.connector.files import land
from isbflow.isb import naming, reference
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.loss import detect_loss
from isbflow.isb.roles import pipeline_grants, pipeline_user
from isbflow.isb.state import StepStatus, put_status
from isbflow.ops import isb as ops_isb
from isbflow.ops.produce import is_malformed, payload
from isbflow.recovery.plan import plan_recover
from isbflow.recovery.recover import RecoveryError, recover
from isbflow.recovery.watchdog import watch
from isbflow.spec import load_specs
from isbflow.steps.drain import DrainTimeout, drain_pipeline
from tests.conftest import ROOT
from tests.helpers.recovery import ContinuousRun, wait_for
from tests.helpers.redis_server import running_redis
from tests.steps.test_runner import check_agg_is_batch_recount

SPEC = ROOT / "tests" / "specs" / "flush-redis.yaml"
MALFORMED_EVERY = 250
LINES = 1_500  # a file


def land_file(data_dir, n: int) -> set[str]:
    """Lands file ``n`` (events n*LINES ..); returns the ids of its well-formed lines."""
    name = f"{n:04d}.jsonl"
    start = n * LINES
    land(data_dir / "landing" / "landed", name,
         [payload(7, i, MALFORMED_EVERY) for i in range(start, start + LINES)])
    return {f"files/{name}/{i - start + 1}" for i in range(start, start + LINES) if not is_malformed(i, MALFORMED_EVERY)}


async def delete_partition(settings, stream: str) -> None:
    store = await connect(settings)
    try:
        await store.buffer(stream).delete()
    finally:
        await store.close()


def raw_ids(data_dir) -> list[str]:
    return DeltaTable(str(data_dir / "sinks/landed/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


def test_loss_while_draining_then_a_redis_restarted_empty_then_loss_while_recovering(spark, tmp_path):
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    services = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    data_dir = tmp_path
    with running_redis(persistence="none") as redis_server:
        admin = redis_server.settings()
        ops_isb.apply(admin, specs, p.name, data_dir=redis_server.data_dir)
        asyncio.run(reference.put(admin, p.name, "services", services))
        want = land_file(data_dir, 0)
        user = ops_isb.role_settings(admin, redis_server.data_dir, pipeline_user(p.name))
        lost_draining = naming.EdgePartition(p.name, "enrich", "raw", 0).stream

        async def drain_losing_a_partition():
            """Drain; at its first look (file 1 just landed, upstream of raw) enrich -> raw is deleted."""
            store = await connect(admin)
            deleted: list[asyncio.Future] = []

            def on_update(statuses) -> None:
                if not deleted:
                    deleted.append(asyncio.ensure_future(store.buffer(lost_draining).delete()))

            try:
                with pytest.raises(DrainTimeout) as e:
                    await drain_pipeline(store, p, timeout=300, on_update=on_update)
                await asyncio.gather(*deleted)
                return e.value
            finally:
                await store.close()

        with ContinuousRun(spark, specs, p, user, data_dir) as run:  # each step its own runner
            wait_for(lambda: "error" in run.result or (data_dir / "sinks/landed/raw/_delta_log").is_dir(), 300,
                     "the raw sink's first commit")
            want |= land_file(data_dir, 1)
            stopped = asyncio.run(drain_losing_a_partition())
            # the step writing into the lost partition (or the one reading it) failed: the drain stopped
            assert stopped.vertex in ("enrich", "raw") and "failed" in str(stopped), str(stopped)
            report = recover(spark, specs, p, admin, data_dir, pipelined=False)  # drains what still runs
            run.join(120)
        assert report.ok and [b.stream for b in report.lost] == [lost_draining], report.to_json()
        ids = raw_ids(data_dir)
        assert len(ids) == len(set(ids)) and set(ids) == want

        redis_server.restart()  # no persistence: it comes back empty
        want |= land_file(data_dir, 2)  # landed while the buffers were gone

        async def detect():
            store = await connect(admin)
            try:
                for v in p.topological_order():  # a running driver's next heartbeats (the watchdog judges those)
                    await put_status(store, p.name, StepStatus(vertex=v, state="running"))
                return await detect_loss(store, p, data_dir)
            finally:
                await store.close()

        lost = asyncio.run(detect())
        edges = {ep.stream for ep in naming.edge_partitions(p)}
        assert {d.stream for d in lost} == edges, lost
        report = asyncio.run(watch(admin, p, data_dir))
        assert not report.healthy and any(f.kind == "buffer-lost" for f in report.findings), report.to_json()


        async def driver_stopped():  # its steps fail on the lost buffers; recover then has nothing to drain
            store = await connect(admin)
            try:
                for v in p.topological_order():
                    await put_status(store, p.name, StepStatus(vertex=v, state="failed"))
            finally:
                await store.close()

        asyncio.run(driver_stopped())
        # the replay would enrich through an empty reference table: refused, naming it
        with pytest.raises(RecoveryError, match="reference table 'services' \\(step enrich\\) no longer exists"):
            recover(spark, specs, p, admin, data_dir)
        plan = plan_recover(spark, specs, p, admin, data_dir)  # the dry run says so too
        assert (plan.state, plan.missing_references) == ("would-refuse", {"enrich": "services"}), plan.summary()
        asyncio.run(reference.put(admin, p.name, "services", services))

        # a partition lost again as the replay begins: recover stops naming it ...
        during_recovery = naming.EdgePartition(p.name, "parse", "enrich", 0).stream

        def lose_another(ph) -> None:
            if ph.name == "rewind":
                asyncio.run(delete_partition(admin, during_recovery))

        with pytest.raises(RecoveryError, match=f"{during_recovery} lost during the replay"):
            recover(spark, specs, p, admin, data_dir, pipelined=False, on_phase=lose_another)
        # ... and the next recover completes the job;
        # one step after the other (the pipelined replay is recover's default, tests/recovery/test_recover.py)
        report = recover(spark, specs, p, admin, data_dir, pipelined=False)
        assert report.ok, json.dumps(report.to_json(), default=str)
        assert [b.stream for b in report.lost] == [during_recovery]
        raw = next(s for s in report.sinks if s.sink == "raw")  # checked against every landed line
        assert (raw.verified, raw.duplicates, raw.missing) == (True, 0, 0)
        ids = raw_ids(data_dir)
        assert len(ids) == len(set(ids)), "a line twice in the raw sink"
        assert set(ids) == want
        letters = asyncio.run(read_dead_letters(admin, p.name, "in"))
        assert len(letters) == 3 * LINES // MALFORMED_EVERY  # each malformed line once, in the new dead letters
        check_agg_is_batch_recount(spark, data_dir, sinks="sinks/landed")
        assert pipeline_grants(p).sources == ()  # the source is the landed files: nothing of it was in Redis
