"""The Airflow start -> drain cycle and the batch DAG, end to end.

Real nats-server (``nats_server``), real Airflow ``dag.test()`` in a subprocess
(``airflow_home``), real Spark: ``pipeline_start`` launches the driver detached
and its deferrable sensor waits (dag.test() runs the trigger inline) until every
step runs; ``pipeline_drain`` drains it; the raw Delta sink then holds every
event exactly once. Each test's isbflow data dir is under ``tmp_path`` and
reaches the Airflow subprocess as ``ISBFLOW_HOME``; every launched driver is
stopped by PID at teardown.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from deltalake import DeltaTable

from isbflow.isb import provision
from isbflow.ops.produce import produce
from isbflow.platform import nats_connection_json
from isbflow.spec import load_specs
from isbflow.steps.launch import read_launch, stop_launch
from tests.helpers.airflow_env import DAGS, ROOT
from tests.helpers.provision import small_demo

pytestmark = pytest.mark.slow

SEED = 7


class Demo:
    """The demo spec (small buffers) under tmp_path, its data dir and the Airflow env for it."""

    def __init__(self, nats_server, tmp_path):
        self.folder = small_demo(tmp_path)
        shutil.copytree(ROOT / "pipelines" / "reference", self.folder / "reference")
        self.data_dir = tmp_path / "data"
        self.specs = load_specs([self.folder / "logs.yaml"])
        self.p = self.specs.only_pipeline()
        self.settings = nats_server.settings
        self.password = nats_server.state.password
        self.env = {"ISBFLOW_HOME": str(self.data_dir), "ISBFLOW_PIPELINES_DIR": str(self.folder),
                    "NATS_URL": "", "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state)}
        asyncio.run(provision.apply(self.settings, self.specs))  # the source stream, to produce into

    def produce(self, count: int, start: int = 0) -> None:
        report = asyncio.run(produce(self.settings, self.p, count=count, seed=SEED, start=start,
                                     malformed_every=None))
        assert report.published == count

    def raw_ids(self) -> list[str]:
        return DeltaTable(str(self.data_dir / "sinks/logs/raw")).to_pyarrow_table().column("_isb_id").to_pylist()


@pytest.fixture
def demo(nats_server, tmp_path):
    d = Demo(nats_server, tmp_path)
    try:
        yield d
    finally:
        stop_launch(d.data_dir, d.p.name, grace=20)  # whatever happened, no driver outlives the test


def expected_ids(count: int) -> set[str]:
    return {f"in/0/{i + 1}" for i in range(count)}  # event i sits at source sequence i + 1


def test_dag_files_parse(airflow_home):
    code = ("from airflow.dag_processing.dagbag import DagBag\n"
            f"b = DagBag({str(DAGS)!r})\n"
            "result = {'errors': {k: str(v) for k, v in b.import_errors.items()}, 'dags': sorted(b.dag_ids)}")
    out = airflow_home.run_code(code, timeout=180)
    assert out["errors"] == {}
    assert {"isb_provision", "pipeline_start", "pipeline_drain", "pipeline_batch"} <= set(out["dags"])


def test_start_then_drain_processes_every_event_once(airflow_home, demo):
    before, during = 2000, 1500
    demo.produce(before)

    started = airflow_home.run_dag("pipeline_start", {"pipeline": "logs.yaml", "master": "local[2]"},
                                   extra_env=demo.env, timeout=600)
    assert started.state == "success", started.output[-6000:]
    assert started.tasks == {"provision": "success", "start": "success", "wait_running": "success"}
    launch = started.xcom["start"]
    record = read_launch(demo.data_dir, "logs")
    assert record is not None and record.pid == launch["pid"] and record.alive()
    assert started.xcom["wait_running"] == {v: "running" for v in demo.p.topological_order()}
    assert "running trigger in line" in started.output  # the sensor deferred

    again = airflow_home.run_dag("pipeline_start", {"pipeline": "logs.yaml"}, extra_env=demo.env, timeout=600)
    assert again.state == "success", again.output[-6000:]
    assert again.xcom["start"]["pid"] == launch["pid"] and again.xcom["start"]["reused"] is True, (
        again.output[-3000:] + "\n--- first driver's log:\n" + record.log_tail(40))

    demo.produce(during, start=before)  # while it runs

    drained = airflow_home.run_dag("pipeline_drain", {"pipeline": "logs.yaml", "timeout": 300},
                                   extra_env=demo.env, timeout=600)
    assert drained.state == "success", drained.output[-6000:]
    result = drained.xcom["drain"]
    assert set(result["final_offsets"]) == set(demo.p.topological_order())
    assert result["final_offsets"]["in"] == {"src-logs-in": before + during}
    assert result["driver_exited"] is True and not record.alive()

    ids = demo.raw_ids()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == expected_ids(before + during)
    outputs = started.output + again.output + drained.output + open(record.log).read()
    assert demo.password not in outputs and demo.password not in " ".join(record.command)


def test_sensor_fails_clearly_when_the_driver_dies(airflow_home, demo):
    result = airflow_home.run_dag("pipeline_start", {"pipeline": "logs.yaml", "master": "no-such-master"},
                                  extra_env=demo.env, timeout=600)
    assert result.state == "failed"
    assert result.tasks["start"] == "success" and result.tasks["wait_running"] == "failed"
    assert "exited before every step was running" in result.output
    assert "no-such-master" in result.output  # the driver log's last lines name the cause


def test_batch_dag_processes_what_the_buffers_hold(airflow_home, demo):
    count = 2500
    demo.produce(count)

    result = airflow_home.run_dag("pipeline_batch", {"pipeline": "logs.yaml"}, extra_env=demo.env, timeout=600)

    assert result.state == "success", result.output[-6000:]
    steps = result.xcom["batch"]["steps"]
    assert {v: s["state"] for v, s in steps.items()} == {v: "stopped" for v in demo.p.topological_order()}
    assert steps["in"]["final_offsets"] == {"src-logs-in": count}
    ids = demo.raw_ids()
    assert len(ids) == len(set(ids)) and set(ids) == expected_ids(count)
