"""The ``pipeline_scale_to_zero`` DAG starts the watcher detached, finds it again, and stops it.

Real nats-server, real Airflow ``dag.test()`` (``airflow_home``), a real detached watcher
process. The pipeline has nothing pending, so the watcher puts it to sleep at once and no Spark
starts; its waking of a real driver is tested in tests/ops/test_zero.py. The watcher is stopped
by PID at teardown whatever happened.
"""

from __future__ import annotations

import asyncio
import shutil
import time

import pytest

from isbflow.isb import provision
from isbflow.local.procs import process_alive
from isbflow.ops.zero import watcher_record
from isbflow.ops.zero_launch import stop_watcher
from isbflow.platform import nats_connection_json
from isbflow.spec import load_specs
from tests.conftest import ROOT

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
def test_the_dag_starts_finds_and_stops_the_watcher(airflow_home, nats_server, tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    spec = shutil.copy(ROOT / "tests" / "specs" / "zero-mini.yaml", folder / "zero.yaml")
    data_dir = nats_server.data_dir
    asyncio.run(provision.apply(nats_server.settings, load_specs([spec])))
    env = {"ISBFLOW_HOME": str(data_dir), "ISBFLOW_PIPELINES_DIR": str(folder), "NATS_URL": "",
           "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state)}
    try:
        first = airflow_home.run_dag("pipeline_scale_to_zero", {"pipeline": "zero.yaml"}, extra_env=env, timeout=600)
        assert first.state == "success", first.output[-6000:]
        launched = first.xcom["watcher"]
        assert launched["reused"] is False and process_alive(launched["pid"], launched["proc_start"])
        deadline = time.monotonic() + 60
        while (watcher_record(data_dir, "zero") or {}).get("state") != "asleep":
            assert time.monotonic() < deadline, open(launched["log"]).read()
            time.sleep(0.5)

        again = airflow_home.run_dag("pipeline_scale_to_zero", {"pipeline": "zero.yaml"}, extra_env=env, timeout=600)
        assert again.state == "success", again.output[-6000:]
        assert again.xcom["watcher"]["pid"] == launched["pid"] and again.xcom["watcher"]["reused"] is True

        stopped = airflow_home.run_dag("pipeline_scale_to_zero", {"pipeline": "zero.yaml", "watch": False},
                                       extra_env=env, timeout=600)
        assert stopped.state == "success", stopped.output[-6000:]
        assert stopped.xcom["watcher"] == {"pipeline": "zero", "stopped": launched["pid"]}
        assert not process_alive(launched["pid"], launched["proc_start"])
        assert nats_server.state.password not in open(launched["log"]).read()
    finally:
        stop_watcher(data_dir, "zero", grace=10)
