"""The demo pipeline end to end on a real nats-server and a real SparkSession:
available-now (the batch mode) and continuous with the drain protocol.

The aggregate sink is compared with a batch recomputation (the same
``per_minute`` on the raw sink's rows, where the watermark does nothing) over
ALL windows, including those still open when the run ends: ``minutely`` has
``output: update`` and the agg sink upserts every window it changes."""

from __future__ import annotations

import asyncio
import json
import threading
from datetime import timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable
from pyspark.sql import functions as F

from isbflow.isb import provision, reference
from isbflow.isb.connect import connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.state import Observed
from isbflow.ops.produce import is_malformed, produce
from isbflow.quality.run import read_version
from isbflow.spec import load_specs
from isbflow.spec.models import Limits
from isbflow.steps.drain import drain_pipeline
from isbflow.steps.runner import PipelineRunner, trigger_interval
from spark_apps import logs
from tests.conftest import ROOT

MALFORMED_EVERY = 500


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


def check_errors_sink(data_dir, raw):
    """The errors sink (edge ``enrich -> errors`` with ``conditions.tags``) holds exactly the raw
    sink's ERROR-level events, once each, as the raw sink has them (no ``_tags``)."""
    errors = DeltaTable(str(data_dir / "sinks/logs/errors")).to_pyarrow_table()
    ids = errors.column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the errors sink"
    want = {r["_isb_id"] for r in raw.select(["_isb_id", "level"]).to_pylist() if r["level"] == "ERROR"}
    assert want and set(ids) == want
    assert errors.schema.names == raw.schema.names


def covered_low(settings, p, dead_count):
    """Per sink, the first source offset its ledger does not cover (its own ranges, the offsets
    routed away from it, the dead letters)."""
    from isbflow.isb import ledger
    from isbflow.isb.routed import read_covered

    async def go():
        nc = await connect(settings)
        try:
            return await read_covered(nc, p.name)
        finally:
            await nc.close()

    letters = asyncio.run(read_dead_letters(settings, p.name, "in"))
    assert len(letters) == dead_count
    dead = ledger.dead_letter_ranges(dl["origin"] for dl in letters)
    covered = asyncio.run(go())
    return ledger.low_offsets({s: covered[s] for s in ("raw", "errors")}, ["in/0"], dead=dead)["in/0"].per_sink


def batch_windows(spark, data_dir, exclude=frozenset(), sinks="sinks/logs"):
    """per_minute over the raw sink's rows in batch (no watermark), minus the ``exclude`` ids."""
    raw, _, _ = read_version(spark, str(data_dir / sinks / "raw"))
    if exclude:
        raw = raw.filter(~F.col("_isb_id").isin(sorted(exclude)))
    return logs.per_minute(raw).toArrow().to_pylist()


def check_agg_is_batch_recount(spark, data_dir, exclude=frozenset(), sinks="sinks/logs"):
    """Every window of the agg sink equals the batch recomputation, and every recomputed window is
    in the sink (open ones too); returns the windows by (window_start, service). ``sinks``: the
    folder under ``data_dir`` holding the pipeline's raw and agg sinks."""
    agg = DeltaTable(str(data_dir / sinks / "agg")).to_pyarrow_table().to_pylist()
    got = {(r["window_start"], r["service"]): r for r in agg}
    assert len(got) == len(agg), "a window twice in the agg sink"
    want = {(r["window_start"], r["service"]): r for r in batch_windows(spark, data_dir, exclude, sinks)}
    assert want, "the raw sink holds no rows"
    assert sorted(set(want) - set(got)) == [], "windows missing from the agg sink"
    assert sorted(set(got) - set(want)) == [], "windows in the agg sink the raw rows do not make"
    for key, w in want.items():
        g = got[key]
        assert (g["window_end"], g["count"], g["errors"], g["latency_p95"]) == (
            w["window_end"], w["count"], w["errors"], w["latency_p95"]), key
        assert g["latency_avg"] == pytest.approx(w["latency_avg"], rel=1e-9), key
    return got


def assert_has_open_windows(windows, watermark=timedelta(minutes=2)):
    """Some windows end after the watermark (newest window end - 2 min): append mode would never
    have emitted them."""
    newest = max(w["window_end"] for w in windows.values())
    open_ = [k for k, w in windows.items() if w["window_end"] > newest - watermark]
    assert open_, "no window was still open at the end of the run"


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
    assert [out[v].state for v in p.topological_order()] == [Observed.STOPPED] * 7
    raw, letters = check_sinks(data_dir, settings, p, good_ids(0, count))
    check_errors_sink(data_dir, raw)
    malformed = count // MALFORMED_EVERY
    # the offsets routed away from the errors sink fill its ledger: recovery's low offset is past
    # everything, as for the raw sink (not at the first event that is not an error)
    assert covered_low(settings, p, malformed) == {"raw": count + 1, "errors": count + 1}
    assert len(letters) == malformed
    assert all("malformed" in dl["reason"] and dl["step"] == "in" for dl in letters)
    assert out["in"].dlq_total == malformed
    # aggregates: every window, the ones still open at the end of the run too, equals a batch
    # recomputation from the raw sink
    windows = check_agg_is_batch_recount(spark, data_dir)
    assert_has_open_windows(windows)
    assert out["minutely"].late_total == 0
    # the stateful step keeps its state in its vertex's partitions (one), not the session's two
    minutely = runner.checkpoint("minutely", p.query_to("minutely"))
    first = (Path(minutely) / "offsets" / "0").read_text().splitlines()
    assert json.loads(first[1])["conf"]["spark.sql.shuffle.partitions"] == "1"
    assert sorted(d.name for d in (Path(minutely) / "state" / "0").iterdir() if d.name[0] != "_") == ["0"]
    assert spark.conf.get("spark.sql.shuffle.partitions") == "2"
    agg_version = DeltaTable(str(data_dir / "sinks/logs/agg")).version()

    # late records: events far behind the watermark (all in the first 10 s of event time) are
    # dropped by the window (counted in the step's status) but still land in the raw sink; the
    # agg sink does not change
    late = 1000
    asyncio.run(produce(settings, p, count=late, seed=8, start=0))
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    try:
        again = runner.run_available_now()
    finally:
        runner.close()
    raw_after = DeltaTable(str(data_dir / "sinks/logs/raw")).to_pyarrow_table()
    assert raw_after.num_rows == raw.num_rows + late
    late_ids = {f"in/0/{count + i + 1}" for i in range(late)}
    assert late_ids <= set(raw_after.column("_isb_id").to_pylist())
    # Spark counts rows dropped at the stateful operator (numRowsDroppedByWatermark); behind an
    # aggregation those are its partial aggregates: one per (window, service) and input task, and
    # the 1000 late records reach minutely in one task
    raw_df, _, _ = read_version(spark, str(data_dir / "sinks/logs/raw"))
    late_groups = logs.per_minute(raw_df.filter(F.col("_isb_id").isin(sorted(late_ids)))).count()
    assert again["minutely"].late_total == late_groups > 0
    assert DeltaTable(str(data_dir / "sinks/logs/agg")).version() == agg_version
    assert check_agg_is_batch_recount(spark, data_dir, exclude=late_ids) == windows


def test_the_trigger_interval_comes_from_read_timeout_vertex_over_pipeline():
    p = load_specs(ROOT / "pipelines" / "logs.yaml").only_pipeline()
    assert {trigger_interval(p, v) for v in p.spec.vertices} == {"5000 milliseconds"}  # the default
    limits = p.spec.limits.model_copy(update={"readTimeout": 5.0})
    spec = p.spec.model_copy(update={"limits": limits, "vertices": [
        v.model_copy(update={"limits": Limits(readTimeout=0.75)}) if v.name == "enrich" else v
        for v in p.spec.vertices]})
    tuned = p.model_copy(update={"spec": spec})
    assert trigger_interval(tuned, tuned.vertex("enrich")) == "750 milliseconds"
    assert trigger_interval(tuned, tuned.vertex("parse")) == "5000 milliseconds"
    assert trigger_interval(tuned, tuned.vertex("parse"), "500 milliseconds") == "500 milliseconds"
    # event-driven (a continuous run whose readers wait for input): the budget is the source's; a
    # step reading buffers starts when its input grows, unless its own readTimeout says otherwise
    assert trigger_interval(tuned, tuned.vertex("in"), "500 milliseconds", event_driven=True) == "500 milliseconds"
    assert trigger_interval(tuned, tuned.vertex("parse"), "500 milliseconds", event_driven=True) == "250 milliseconds"
    assert trigger_interval(tuned, tuned.vertex("enrich"), event_driven=True) == "750 milliseconds"  # its own
    assert trigger_interval(tuned, tuned.vertex("in"), event_driven=True) == "5000 milliseconds"


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
    # the runner's processing_time overrode the spec's readTimeout of the source; the steps that read
    # buffers are event-driven (their readers wait for input; a batch starts within 250 ms of it)
    intervals = {rq.query.name: rq.query._jsq.streamingQuery().trigger().intervalMs()
                 for run in runner.runs.values() for rq in run.queries}
    assert intervals == {q: 500 if q == "logs.in.to.parse" else 250 for q in intervals}, intervals
    # one query per vertex: enrich writes raw, minutely and errors in one pass
    assert sorted(rq.query.name for run in runner.runs.values() for rq in run.queries) == [
        "logs.agg", "logs.enrich", "logs.errors", "logs.in.to.parse", "logs.minutely.to.agg",
        "logs.parse.to.enrich", "logs.raw"]
    raw, _ = check_sinks(data_dir, settings, p, good_ids(0, 5000))
    check_errors_sink(data_dir, raw)
    # 50 s of event time: the watermark closes no window, yet every window is in the agg sink
    assert_has_open_windows(check_agg_is_batch_recount(spark, data_dir))


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
    check_agg_is_batch_recount(spark, tmp_path)
    streams = [naming.source_stream(p, "in")] + [ep.stream for ep in naming.edge_partitions(p)]
    held = asyncio.run(provision.status(settings, specs))
    left = {s.name: s.messages for s in held if s.name in streams and s.messages}
    assert left == {}, f"{retention} buffers still hold messages after the downstream commit: {left}"


def test_a_files_source_reads_its_folder_only_and_its_bad_lines_carry_their_reason(spark, nats_server, tmp_path):
    """The source step's parse keeps the isb-files reason (not UTF-8, over-long) ahead of its own, so
    the writer dead-letters such a line with it; a landing folder outside the data dir is refused."""
    import yaml

    from isbflow.connector.files import FILES_SCHEMA
    from isbflow.steps.runner import StepError

    docs = list(yaml.safe_load_all((ROOT / "pipelines" / "logs.yaml").read_text()))
    source = next(v for v in docs[1]["spec"]["vertices"] if v["name"] == "in")["source"]
    source.pop("jetstream")
    source["files"] = {"path": "/etc"}
    path = tmp_path / "logs.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    specs = load_specs(path)
    p = specs.only_pipeline()
    runner = PipelineRunner(spark, specs, p, nats_server.settings, tmp_path)
    try:
        with pytest.raises(StepError, match=r"source 'in': source.files.path '/etc' is outside the folders"):
            runner._read("in")
        good = json.dumps({"ts": "2024-01-01T00:00:00", "service": "a", "level": "info", "host": "h",
                           "latency_ms": 1.0, "status": 200, "msg": "m"})
        df = spark.createDataFrame([(good, "files/a/1", None), (good, "files/a/2", "line 2 of landed file a is not UTF-8"),
                                    ("{", "files/a/3", None)], FILES_SCHEMA)
        rows = {r["_isb_id"]: r for r in runner.apply_transform("in", df).collect()}
    finally:
        runner.close()
    assert rows["files/a/1"]["_isb_error"] is None and rows["files/a/1"]["service"] == "a"
    assert rows["files/a/2"]["_isb_error"] == "line 2 of landed file a is not UTF-8"
    assert rows["files/a/2"]["_isb_raw"] == good
    assert rows["files/a/3"]["_isb_error"].startswith("malformed record")
