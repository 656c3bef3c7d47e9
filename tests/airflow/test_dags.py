"""The replay, quality and watchdog DAGs and the generated replay schedules.

Pure parts first (time expressions, the watchdog's judgement, asset URIs),
then ``dag.test()`` runs (tests/helpers/airflow_env.py, a subprocess per run) against a
real nats-server and real Spark: the pytest process's session-scoped ``spark``
builds each scenario, the Airflow task starts its own session. Every scenario
uses tests/specs/airflow-mini.yaml (``in`` -> ``raw``), copied, and sometimes
edited, into ``tmp_path``, a few thousand records.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from deltalake import DeltaTable

from isbflow.airflow.assets import parse_sink_uri, sink_uri, sinks_from_events
from isbflow.airflow.triggers.lag import lag_event
from isbflow.isb import naming, provision
from isbflow.isb.connect import connect
from isbflow.isb.loss import DetectedLoss
from isbflow.isb.state import StepStatus, put_status
from isbflow.ops.produce import produce
from isbflow.platform import nats_connection_json
from isbflow.recovery.watchdog import judge, next_history
from isbflow.spec import SpecError, load_specs
from isbflow.spec.times import TimeExpressionError, resolve_range, resolve_time
from isbflow.steps.lag import pipeline_lag
from isbflow.steps.runner import PipelineRunner
from tests.helpers.airflow_env import DAGS, ROOT

SPEC = ROOT / "tests" / "specs" / "airflow-mini.yaml"
SEED = 11
NOT_NULL = "expect_column_values_to_not_be_null\n          kwargs: {column: service}"
#: about a fifth of the generated events are WARN or ERROR: this expectation fails on them
ONLY_INFO_DEBUG = "expect_column_values_to_be_in_set\n          kwargs: {column: level, value_set: [INFO, DEBUG]}"


# ----------------------------------------------------------------------------- pure


def test_time_expressions_resolve_against_the_data_interval():
    end = datetime(2024, 5, 2, 2, 0, tzinfo=UTC)
    assert resolve_range("yesterday", "today", end) == (datetime(2024, 5, 1, tzinfo=UTC),
                                                        datetime(2024, 5, 2, tzinfo=UTC))
    assert resolve_time("-1d", end) == datetime(2024, 5, 1, 2, 0, tzinfo=UTC)
    assert resolve_time("today-6h", end) == datetime(2024, 5, 1, 18, 0, tzinfo=UTC)
    assert resolve_time("start", end, datetime(2024, 5, 2, 1, 0, tzinfo=UTC)) == datetime(2024, 5, 2, 1, tzinfo=UTC)
    assert resolve_time("2024-04-01T06:00:00+02:00", end) == datetime(2024, 4, 1, 4, 0, tzinfo=UTC)
    with pytest.raises(TimeExpressionError, match="'from' must lie before 'to'"):
        resolve_range("today", "yesterday", end)
    with pytest.raises(TimeExpressionError, match="unknown anchor 'lastweek'"):
        resolve_time("lastweek", end)


def test_replay_entries_are_validated_with_located_errors(tmp_path):
    text = SPEC.read_text().replace("fromTime: yesterday", "fromTime: last-tuesday").replace(
        'schedule: "@hourly"', 'schedule: "@often"')
    path = tmp_path / "mini.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as e:
        load_specs([path])
    lines = str(e.value).splitlines()
    assert any("replays[0].fromTime" in ln and "last-tuesday" in ln for ln in lines), lines
    assert any("replays[1].schedule" in ln and "'@often' is not a cron expression" in ln for ln in lines), lines
    path.write_text(SPEC.read_text().replace("mode: recover", "mode: recover\n      fromTime: -1d"))
    with pytest.raises(SpecError, match="a recover replay takes no fromTime/toTime"):
        load_specs([path])


def _status(vertex: str, state: str, age: float, lag: int = 0, now: float = 1000.0) -> StepStatus:
    return StepStatus(vertex=vertex, state=state, updated_at=now - age, lag={f"isb-{vertex}": lag})


def test_watchdog_judgement():
    now = 1000.0
    healthy = judge("p", {"in": _status("in", "running", 2), "raw": _status("raw", "running", 3)}, now)
    assert healthy.state == "healthy" and healthy.findings == []
    idle = judge("p", {"in": _status("in", "stopped", 500), "raw": None}, now)
    assert idle.state == "idle" and idle.findings == []

    stale = judge("p", {"in": _status("in", "running", 2), "raw": _status("raw", "running", 95)}, now,
                  heartbeat_timeout=60)
    assert [(f.kind, f.step) for f in stale.findings] == [("stale-heartbeat", "raw")]
    assert "step raw: last heartbeat 95s ago" in stale.findings[0].message

    lost = DetectedLoss("isb-p-in-raw-0", "the stream no longer exists", 41)
    growing = judge("p", {"in": _status("in", "running", 1)}, now, history={"in": [5, 10, 20, 40]},
                    lost=[lost], lag_growth_runs=3)
    assert [f.kind for f in growing.findings] == ["lag-growing", "buffer-lost"]
    assert "5 -> 10 -> 20 -> 40" in growing.findings[0].message
    assert "buffer isb-p-in-raw-0 lost, sequences 41 on" in growing.findings[1].message
    # one dip in the last runs is no trend
    assert judge("p", {"in": _status("in", "running", 1)}, now, history={"in": [5, 10, 8, 40]}).healthy

    # lag samples accumulate per running step, and restart after a long gap
    statuses = {"in": _status("in", "running", 1, lag=7), "raw": _status("raw", "stopped", 1, lag=3)}
    assert next_history({"at": now - 60, "lag": {"in": [1, 2, 3, 4]}}, statuses, now, 4) == {"in": [2, 3, 4, 7]}
    assert next_history({"at": now - 3600, "lag": {"in": [1, 2]}}, statuses, now, 4) == {"in": [7]}


def test_sink_asset_uris():
    assert sink_uri("logs", "raw") == "isbflow://logs/raw"
    assert parse_sink_uri("isbflow://logs/raw") == ("logs", "raw")
    assert parse_sink_uri("file:///x/y") is None and parse_sink_uri("isbflow://logs") is None

    class Ev:
        def __init__(self, uri: str) -> None:
            self.asset = type("A", (), {"uri": uri})()

    events = {type("K", (), {"uri": "isbflow://logs/raw"})(): [Ev("isbflow://logs/raw")],
              type("K", (), {"uri": "isbflow://logs/agg"})(): [Ev("isbflow://logs/agg")],
              type("K", (), {"uri": "s3://other"})(): [Ev("s3://other")]}
    assert sinks_from_events(events) == {"logs": ["agg", "raw"]}


# ----------------------------------------------------------------------------- Airflow helpers


class Mini:
    """The mini spec under ``tmp_path/pipelines``, its data dir, and the env Airflow runs with."""

    def __init__(self, nats_server, tmp_path: Path, text: str | None = None) -> None:
        self.folder = tmp_path / "pipelines"
        self.folder.mkdir(exist_ok=True)
        self.data_dir = tmp_path / "data"
        self.settings = nats_server.settings
        self.env = {"ISBFLOW_HOME": str(self.data_dir), "ISBFLOW_PIPELINES_DIR": str(self.folder),
                    "NATS_URL": "", "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state)}
        self.write_spec(text or SPEC.read_text())
        asyncio.run(provision.apply(self.settings, self.specs))

    def write_spec(self, text: str) -> None:
        (self.folder / "mini.yaml").write_text(text)
        self.specs = load_specs([self.folder / "mini.yaml"])
        self.p = self.specs.only_pipeline()

    def produce(self, count: int, start: int = 0) -> None:
        report = asyncio.run(produce(self.settings, self.p, count=count, seed=SEED, start=start,
                                     malformed_every=None))
        assert report.published == count

    def run(self, spark, only: list[str] | None = None) -> None:
        runner = PipelineRunner(spark, self.specs, self.p, self.settings, self.data_dir)
        try:
            runner.run_available_now(only=only)
        finally:
            runner.close()

    def raw_ids(self) -> list[str]:
        return DeltaTable(str(self.data_dir / "sinks/mini/raw")).to_pyarrow_table().column("_isb_id").to_pylist()

    def stream_exists(self, stream: str) -> bool:
        async def go() -> bool:
            nc = await connect(self.settings)
            try:
                await nc.jetstream().stream_info(stream)
                return True
            except Exception:  # noqa: BLE001 - not found
                return False
            finally:
                await nc.close()

        return asyncio.run(go())

    def lag(self, max_lag: int = 0) -> dict[str, Any]:
        """What ``PipelineLagTrigger`` fires on: every buffer's lag and whether it is <= ``max_lag``."""
        async def go() -> dict[str, Any]:
            nc = await connect(self.settings)
            try:
                return lag_event(await pipeline_lag(nc, self.p), max_lag)
            finally:
                await nc.close()

        return asyncio.run(go())

    def delete_stream(self, stream: str) -> None:
        async def go() -> None:
            nc = await connect(self.settings)
            try:
                await nc.jetstream().delete_stream(stream)
            finally:
                await nc.close()

        asyncio.run(go())

    def heartbeat(self, vertex: str, state: str = "running", age: float = 0.0) -> None:
        """Write step ``vertex``'s heartbeat as if its driver had written it ``age`` seconds ago."""
        async def go() -> None:
            nc = await connect(self.settings)
            try:
                if age == 0:
                    await put_status(nc, self.p.name, StepStatus(vertex=vertex, state=state))
                    return
                kv = await nc.jetstream().key_value(naming.status_bucket(self.p.name))
                status = StepStatus(vertex=vertex, state=state, updated_at=time.time() - age, batch_id=4)
                await kv.put(f"step.{vertex}", json.dumps(status.to_json()).encode())
            finally:
                await nc.close()

        asyncio.run(go())


def in_airflow_db(airflow_home, env: dict[str, str], code: str) -> Any:
    """Run ``code`` (which sets ``result``) against the test Airflow's metadata DB; return ``result``."""
    return airflow_home.run_code("from sqlalchemy import select\nfrom airflow.utils.session import create_session\n"
                                 + code, env)


ASSET_EVENTS = """
from airflow.models.asset import AssetEvent, AssetModel
with create_session() as s:
    rows = s.execute(select(AssetModel.uri, AssetEvent.extra, AssetEvent.source_dag_id, AssetEvent.source_task_id)
                     .join(AssetModel, AssetEvent.asset_id == AssetModel.id)).all()
result = [list(r) for r in rows]
"""

RESERIALIZE = """
from airflow.cli.cli_parser import get_parser
args = get_parser().parse_args(["dags", "reserialize"])
result = args.func(args)
"""

REPLAY_RUNS = """
from airflow.models.dagrun import DagRun
with create_session() as s:
    result = [[r.run_id, r.conf, str(r.run_type)] for r in s.scalars(select(DagRun).where(
        DagRun.dag_id == "pipeline_replay"))]
"""


# ----------------------------------------------------------------------------- DAG files


@pytest.mark.slow
def test_dag_files_import_with_described_params_and_generated_dags(airflow_home, tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "mini.yaml").write_text(SPEC.read_text().replace("spec:\n  vertices:",
                                                               "spec:\n  autoRecover: true\n  vertices:"))
    (folder / "broken.yaml").write_text("kind: Pipeline\nmetadata: {name: broken}\nspec: {vertices: []}\n")
    code = """
import json
from airflow.dag_processing.dagbag import DagBag
b = DagBag(DAGS)
result = out = {"errors": {k: str(v) for k, v in b.import_errors.items()}, "dags": {}}
for dag_id, dag in b.dags.items():
    out["dags"][dag_id] = {
        "schedule": dag.schedule if isinstance(dag.schedule, str) else type(dag.timetable).__name__,
        "assets": sorted(a.uri for a in getattr(getattr(dag.timetable, "asset_condition", None), "objects", []) or []),
        "tasks": sorted(t.task_id for t in dag.tasks),
        "params": {k: bool(p.description) for k, p in dag.params.items()},
        "downstream": {t.task_id: sorted(t.downstream_task_ids) for t in dag.tasks},
    }
""".replace("DAGS", repr(str(DAGS)))
    out = airflow_home.run_code(code, {"ISBFLOW_PIPELINES_DIR": str(folder)})
    assert out["errors"] == {}
    dags = out["dags"]
    assert {"pipeline_replay", "pipeline_quality", "pipeline_watchdog", "replay_mini_nightly",
            "replay_mini_hourly-recover"} <= set(dags)
    for dag_id, d in dags.items():
        assert d["params"], f"{dag_id} has no trigger-form params"
        assert all(d["params"].values()), f"{dag_id}: a param without a description: {d['params']}"
    assert set(dags["pipeline_replay"]["params"]) == {"pipeline", "mode", "from_offset", "to_offset", "from_time",
                                                      "to_time", "dry_run", "master", "shadow", "promote",
                                                      "promote_run"}
    assert dags["pipeline_replay"]["downstream"] == {"replay": ["promote"], "promote": []}
    # the spec's replays: one DAG each, on the spec's schedule
    assert dags["replay_mini_nightly"]["schedule"] == "0 2 * * *"
    assert dags["replay_mini_hourly-recover"]["schedule"] == "@hourly"
    assert dags["replay_mini_nightly"]["tasks"] == ["replay"]
    # quality follows the sinks as assets
    assert dags["pipeline_quality"]["assets"] == ["isbflow://mini/raw"]
    # the watchdog: a task per pipeline, a recover trigger after it (autoRecover), a task for the broken spec
    watchdog = dags["pipeline_watchdog"]
    assert watchdog["schedule"] == "* * * * *"
    assert watchdog["tasks"] == ["recover_mini", "watch_broken.yaml", "watch_mini"]
    assert watchdog["downstream"]["watch_mini"] == ["recover_mini"]
    # sink maintenance: daily, a task per pipeline of the catalog (the broken spec has none)
    assert dags["sink_maintenance"]["schedule"] == "@daily"
    assert dags["sink_maintenance"]["tasks"] == ["maintain_mini"]


# ----------------------------------------------------------------------------- replay


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replay_dry_run_changes_nothing_then_recover_refills_the_sink(airflow_home, spark, nats_server,
                                                                      tmp_path):
    m = Mini(nats_server, tmp_path)
    m.produce(2000)
    m.run(spark)
    m.produce(1000, start=2000)
    m.run(spark, only=["in"])  # 1000 records wait in in -> raw ...
    lost = naming.EdgePartition("mini", "in", "raw", 0).stream
    m.delete_stream(lost)  # ... and are lost
    assert len(m.raw_ids()) == 2000
    checkpoints = sorted(str(p) for p in (m.data_dir / "checkpoints").rglob("*"))

    dry = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "recover", "dry_run": True},
                               extra_env=m.env, timeout=600)

    assert dry.state == "success", dry.output[-6000:]
    plan = dry.xcom["replay"]
    assert plan["dry_run"] is True and plan["state"] == "would-recover"
    assert [b["stream"] for b in plan["lost"]] == [lost]
    assert plan["streams_to_recreate"] == [lost] and plan["id_sinks"] == ["raw"]
    assert [(p["partition"], p["low"], p["last"], p["records"]) for p in plan["partitions"]] == [
        ("in/0", 2001, 3000, 1000)]
    assert plan["records_to_replay"] == 1000
    assert "recover WOULD (dry run, nothing changed)" in dry.output
    # nothing changed
    assert not m.stream_exists(lost)
    assert len(m.raw_ids()) == 2000
    assert sorted(str(p) for p in (m.data_dir / "checkpoints").rglob("*")) == checkpoints

    real = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "recover"},
                                extra_env=m.env, timeout=600)

    assert real.state == "success", real.output[-6000:]
    report = real.xcom["replay"]
    assert report["ok"] is True and report["state"] == "recovered"
    assert [b["stream"] for b in report["lost"]] == [lost]
    assert report["low_offsets"]["in/0"]["low"] == 2001
    assert report["replayed_records"] == 1000
    raw = next(s for s in report["sinks"] if s["sink"] == "raw")
    assert (raw["rows"], raw["inserted"], raw["duplicates"], raw["missing"]) == (3000, 1000, 0, 0)
    ids = m.raw_ids()
    assert len(ids) == len(set(ids)) == 3000
    assert set(ids) == {f"in/0/{i}" for i in range(1, 3001)}
    assert m.stream_exists(lost)
    # the replay emitted the sink's asset event (what schedules pipeline_quality)
    events = in_airflow_db(airflow_home, m.env, ASSET_EVENTS)
    mine = [e for e in events if e[0] == "isbflow://mini/raw" and e[2] == "pipeline_replay"
            and e[1].get("by") == "replay-recover"]
    assert mine and mine[-1][1]["pipeline"] == "mini" and mine[-1][1]["table_version"] >= 1, events

    # reprocess through the same DAG: a dry run over source offsets 1..500 re-reads them, changes nothing
    planned = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "reprocess",
                                                       "from_offset": 1, "to_offset": 500, "dry_run": True},
                                   extra_env=m.env, timeout=900)
    assert planned.state == "success", planned.output[-6000:]
    r = planned.xcom["replay"]
    assert (r["state"], r["dry_run"], r["replay_mode"], r["records_reread"]) == ("planned", True, "reprocess", 500)
    assert r["range"] == {"in/0": [[1, 500]]}
    assert len(m.raw_ids()) == 3000


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_replay_shadow_then_promote_in_a_later_run(airflow_home, spark, nats_server, tmp_path):
    """Shadow through the DAG (the suite runs on the shadow table; live untouched, nothing promoted with
    promote off), then a run with promote_run: the replay task skips, the promote task commits once."""
    m = Mini(nats_server, tmp_path)
    m.produce(1000)
    m.run(spark)
    raw = str(m.data_dir / "sinks/mini/raw")
    v0 = DeltaTable(raw).version()

    shadowed = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "reprocess",
                                                        "from_offset": 1, "to_offset": 200, "shadow": True},
                                    extra_env=m.env, timeout=900)
    assert shadowed.state == "success", shadowed.output[-6000:]
    assert shadowed.tasks == {"replay": "success", "promote": "skipped"}
    r = shadowed.xcom["replay"]
    run = r["shadow_run"]
    assert (r["state"], r["promotable"], r["suites"]["raw"]["success"]) == ("shadowed", True, True)
    assert (r["diffs"]["raw"]["unchanged"], r["diffs"]["raw"]["changed"]) == (200, 0)
    assert DeltaTable(raw).version() == v0  # the live sink did not move

    promoted = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "promote_run": run},
                                    extra_env=m.env, timeout=900)
    assert promoted.state == "success", promoted.output[-6000:]
    assert promoted.tasks == {"replay": "skipped", "promote": "success"}
    p = promoted.xcom["promote"]
    assert (p["state"], p["ok"], p["shadow_run"]) == ("promoted", True, run)
    assert DeltaTable(raw).version() == v0 + 1  # one commit
    assert sorted(m.raw_ids()) == sorted(f"in/0/{i}" for i in range(1, 1001))


@pytest.mark.slow
def test_replay_rejects_a_range_for_recover_and_offsets_with_times(airflow_home, nats_server,
                                                                                 tmp_path):
    m = Mini(nats_server, tmp_path)
    wrong = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "recover", "from_offset": 5},
                                 extra_env=m.env)
    assert wrong.state == "failed" and wrong.tasks == {"replay": "failed", "promote": "upstream_failed"}
    assert "mode recover takes no range" in wrong.output

    both = airflow_home.run_dag("pipeline_replay", {"pipeline": "mini.yaml", "mode": "reprocess", "from_offset": 5,
                                                    "from_time": "yesterday", "dry_run": True}, extra_env=m.env)
    assert both.state == "failed"
    assert "by source offsets (from_offset/to_offset) OR by event time" in both.output


# ----------------------------------------------------------------------------- quality


def with_copy_sink(text: str, gate: str, expectation: str) -> str:
    """The mini spec with a second sink ``copy`` (in -> copy) whose quality entry has ``gate``."""
    text = text.replace("  edges:\n", "    - name: copy\n      sink:\n        delta:\n          path: sinks/mini/copy\n"
                                        "  edges:\n    - from: in\n      to: copy\n")
    return text.replace("  quality:\n", f"  quality:\n    - sink: copy\n      onFailure: {gate}\n      expectations:\n"
                                          f"        - expectation: {expectation}\n")


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_quality_passes_clean_warns_on_warn_gate_fails_on_fail_gate(airflow_home, spark, nats_server,
                                                                    tmp_path):
    # raw: fail gate, clean data; copy: warn gate, an expectation about a fifth of the rows break
    m = Mini(nats_server, tmp_path, with_copy_sink(SPEC.read_text(), "warn", ONLY_INFO_DEBUG))
    m.produce(2000)
    # the lag the lag sensor waits on: the source holds 2000 nobody committed; then everything is through
    assert m.lag() == {"done": False, "max_lag": 0, "worst": 2000, "missing": [],
                       "lags": {"isb-mini-in-copy-0": 0, "isb-mini-in-raw-0": 0, "src-mini-in": 2000}}
    m.run(spark)
    assert m.lag()["done"] is True and m.lag()["worst"] == 0

    first = airflow_home.run_dag("pipeline_quality", {"pipeline": "mini.yaml"}, extra_env=m.env, timeout=900)

    assert first.state == "success", first.output[-6000:]
    out = first.xcom["quality"]
    assert out["ok"] is True and out["failed"] == [] and out["warned"] == ["mini/copy"]
    by_sink = {s["sink"]: s for s in out["sinks"]}
    raw, copy = by_sink["raw"], by_sink["copy"]
    assert (raw["pipeline"], raw["success"], raw["rows"], raw["failures"]) == ("mini", True, 2000, [])
    report = json.loads(Path(raw["report_path"]).read_text())
    assert report["run_id"] == raw["run_id"] and report["success"] is True
    assert raw["report"] == f"mini/raw/{raw['run_id']}.json"
    assert (copy["success"], copy["gate"], copy["gate_failed"]) == (False, "warn", False)
    assert [f["name"] for f in copy["failures"]] == ["expect_column_values_to_be_in_set"]
    assert copy["failures"][0]["unexpected_count"] > 0
    assert "WARN (gate warn): expect_column_values_to_be_in_set" in first.output

    m.write_spec(with_copy_sink(SPEC.read_text().replace(NOT_NULL, ONLY_INFO_DEBUG), "warn", NOT_NULL))
    second = airflow_home.run_dag("pipeline_quality", {"pipeline": "mini.yaml", "sinks": ["raw"]},
                                  extra_env=m.env, timeout=900)

    assert second.state == "failed" and second.tasks == {"quality": "failed"}
    out = second.xcom["quality"]  # written before the task failed
    assert out["failed"] == ["mini/raw"] and out["ok"] is False and [s["sink"] for s in out["sinks"]] == ["raw"]
    assert [f["name"] for f in out["sinks"][0]["failures"]] == ["expect_column_values_to_be_in_set"]
    assert "quality gate failed for mini/raw" in second.output
    assert "expect_column_values_to_be_in_set" in second.output


# ----------------------------------------------------------------------------- watchdog


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_watchdog_healthy_stale_and_auto_recover(airflow_home, nats_server, tmp_path):
    m = Mini(nats_server, tmp_path)
    for v in ("in", "raw"):
        m.heartbeat(v)
    # a pipeline on a native Redis service that was never started here: idle, not a failure
    redis_spec = m.folder / "logs-redis.yaml"
    shutil.copy(ROOT / "pipelines" / "logs-redis.yaml", redis_spec)

    healthy = airflow_home.run_dag("pipeline_watchdog", extra_env=m.env)

    assert healthy.state == "success", healthy.output[-6000:]
    assert healthy.tasks == {"watch_mini": "success", "watch_logs-redis": "success"}
    assert healthy.xcom["watch_logs-redis"]["action"] == "none"
    assert "no Redis ISB service" in healthy.xcom["watch_logs-redis"]["idle"]
    redis_spec.unlink()
    report = healthy.xcom["watch_mini"]
    assert (report["state"], report["action"], report["findings"]) == ("healthy", "none", [])
    assert set(report["steps"]) == {"in", "raw"}

    m.heartbeat("raw", age=300)
    stale = airflow_home.run_dag("pipeline_watchdog", extra_env=m.env)

    assert stale.state == "failed" and stale.tasks == {"watch_mini": "failed"}
    assert re.search(r"step raw: last heartbeat 3\d\ds ago \(state running", stale.output), stale.output[-4000:]
    assert "set autoRecover: true in the spec" in stale.output
    assert stale.xcom["watch_mini"]["action"] == "fail"
    assert [f["kind"] for f in stale.xcom["watch_mini"]["findings"]] == ["stale-heartbeat"]

    m.write_spec(SPEC.read_text().replace("spec:\n  vertices:", "spec:\n  autoRecover: true\n  vertices:"))
    # the watchdog triggers pipeline_replay: Airflow needs that DAG in its DB ('airflow dags reserialize')
    airflow_home.run_code(RESERIALIZE, m.env)
    before = in_airflow_db(airflow_home, m.env, REPLAY_RUNS)

    recovering = airflow_home.run_dag("pipeline_watchdog", extra_env=m.env)

    assert recovering.state == "success", recovering.output[-6000:]
    assert recovering.tasks == {"watch_mini": "success", "recover_mini": "success"}
    assert recovering.xcom["watch_mini"]["action"] == "recover"
    assert "autoRecover: triggering pipeline_replay" in recovering.output
    after = in_airflow_db(airflow_home, m.env, REPLAY_RUNS)
    new = [r for r in after if r not in before]
    assert len(new) == 1, after
    assert new[0][1] == {"pipeline": "mini.yaml", "mode": "recover", "dry_run": False}

    for v in ("in", "raw"):  # healthy again: the recover task is skipped
        m.heartbeat(v)
    calm = airflow_home.run_dag("pipeline_watchdog", extra_env=m.env)
    assert calm.state == "success", calm.output[-6000:]
    assert calm.tasks == {"watch_mini": "success", "recover_mini": "skipped"}
    assert calm.xcom["watch_mini"]["action"] == "none"
    assert in_airflow_db(airflow_home, m.env, REPLAY_RUNS) == after
