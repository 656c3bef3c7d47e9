"""The demo pipeline end to end on a real nats-server and a real SparkSession:
available-now (the batch mode) and continuous with the drain protocol."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter

import pytest
from deltalake import DeltaTable

from isbflow.connector.dlq import read_dead_letters
from isbflow.isb import provision, reference
from isbflow.isb.connect import connect
from isbflow.produce import is_malformed, produce
from isbflow.spec import load_specs
from isbflow.steps.drain import drain_pipeline
from isbflow.steps.runner import PipelineRunner
from isbflow.steps.state import Observed
from tests.conftest import ROOT

MALFORMED_EVERY = 500


@pytest.fixture
def demo(nats_server, tmp_path):
    specs = load_specs(ROOT / "pipelines" / "logs.yaml")
    p = specs.only_pipeline()
    settings = nats_server.settings
    asyncio.run(provision.apply(settings, specs))
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(settings, p.name, "services", rows))
    return specs, p, settings, tmp_path


def publish(settings, p, count, start=0):
    return asyncio.run(produce(settings, p, count=count, seed=7, start=start, malformed_every=MALFORMED_EVERY))


def good_ids(start, count):
    # the source stream holds event i at sequence i + 1; _isb_id = <source>/<partition>/<seq>
    return {f"in/0/{i + 1}" for i in range(start, start + count) if not is_malformed(i, MALFORMED_EVERY)}


def check_sinks(data_dir, settings, p, expected_ids):
    raw = DeltaTable(str(data_dir / "sinks/logs/raw")).to_pyarrow_table()
    ids = raw.column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == expected_ids
    letters = asyncio.run(read_dead_letters(settings, p.name, "in"))
    return raw, letters


def test_available_now_end_to_end(spark, demo):
    specs, p, settings, data_dir = demo
    count = 20_000  # 200 s of event time: the watermark (2 min) closes the first windows
    report = publish(settings, p, count)
    assert report.published == count
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        out = runner.run_available_now()
    finally:
        runner.close()
    assert [out[v].state for v in p.topological_order()] == [Observed.STOPPED] * 6
    raw, letters = check_sinks(data_dir, settings, p, good_ids(0, count))
    malformed = count // MALFORMED_EVERY
    assert len(letters) == malformed
    assert all("malformed" in dl["reason"] and dl["step"] == "in" for dl in letters)
    assert out["in"].dlq_total == malformed
    # aggregates: every emitted window equals a batch recomputation from the raw sink
    agg = DeltaTable(str(data_dir / "sinks/logs/agg")).to_pyarrow_table().to_pylist()
    assert agg, "no window was closed by the watermark"
    recomputed = Counter()
    for ts, service in zip(raw.column("ts").to_pylist(), raw.column("service").to_pylist(), strict=True):
        recomputed[(ts.replace(second=0, microsecond=0, tzinfo=None), service)] += 1
    for row in agg:
        key = (row["window_start"].replace(tzinfo=None), row["service"])
        assert row["count"] == recomputed[key], key
    assert len({(r["window_start"], r["service"]) for r in agg}) == len(agg)

    # late records: events far behind the watermark are dropped by the window
    # (counted in the step's status) but still land in the raw sink
    late = 1000
    asyncio.run(produce(settings, p, count=late, seed=8, start=0))
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        again = runner.run_available_now()
    finally:
        runner.close()
    assert again["minutely"].late_total > 0
    raw_after = DeltaTable(str(data_dir / "sinks/logs/raw")).to_pyarrow_table()
    assert raw_after.num_rows == raw.num_rows + late


def test_continuous_then_drain_processes_everything_once(spark, demo):
    specs, p, settings, data_dir = demo
    publish(settings, p, 3000)
    runner = PipelineRunner(spark, specs, p, settings, data_dir, processing_time="500 milliseconds")
    result: dict = {}

    def run():
        try:
            result["out"] = runner.run_continuous(poll=0.3)
        except BaseException as e:  # noqa: BLE001 - surfaced by the assertion below
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        publish(settings, p, 2000, start=3000)  # while it runs
        assert t.is_alive(), f"runner stopped early: {result.get('error')!r}"

        async def drain():
            nc = await connect(settings)
            try:
                return await drain_pipeline(nc, p, timeout=240)
            finally:
                await nc.close()

        final = asyncio.run(drain())
        t.join(60)
    finally:
        runner.stop_all()
        t.join(30)
        runner.close()
    assert "error" not in result, result.get("error")
    assert set(final) == set(p.topological_order())
    assert all(s.state == Observed.DRAINED for s in final.values())
    assert final["in"].final_offsets == {"src-logs-in": 5000}
    check_sinks(data_dir, settings, p, good_ids(0, 5000))


@pytest.mark.parametrize("retention", ["WorkQueue", "Interest"])
def test_buffers_are_released_after_the_downstream_commit(spark, nats_server, tmp_path, retention):
    """With WorkQueue/Interest retention every buffer is empty once the run has
    committed downstream, and the sinks are complete: space went only after the commit."""
    import yaml

    from isbflow.isb import naming

    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    docs[0]["spec"]["jetstream"]["bufferConfig"]["stream"]["retention"] = retention
    path = tmp_path / "logs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    specs = load_specs(path)
    p = specs.only_pipeline()
    settings = nats_server.settings
    asyncio.run(provision.apply(settings, specs))
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(settings, p.name, "services", rows))
    publish(settings, p, 3000)
    runner = PipelineRunner(spark, specs, p, settings, tmp_path)
    try:
        runner.run_available_now()
    finally:
        runner.close()
    check_sinks(tmp_path, settings, p, good_ids(0, 3000))
    streams = [naming.source_stream(p, "in")] + [ep.stream for ep in naming.edge_partitions(p)]
    held = asyncio.run(provision.status(settings, specs))
    left = {s.name: s.messages for s in held if s.name in streams and s.messages}
    assert left == {}, f"{retention} buffers still hold messages after the downstream commit: {left}"
