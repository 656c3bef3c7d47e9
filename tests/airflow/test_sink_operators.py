"""The ``sink_maintenance`` DAG and ``SinkMaintenanceOperator`` (isbflow.airflow.operators.sinks).

DAG runs use ``dag.test()`` in a subprocess over a migrated temporary AIRFLOW_HOME
(tests/helpers/airflow_env.py). Maintenance needs no ISB service: the sink table is
made here with the sink's own commit, and no NATS connection is configured.
"""

from __future__ import annotations

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from isbflow.sinks.delta import DeltaSinkOptions, commit_batch, sink_app_id, write_batch_files
from tests.helpers.airflow_env import ROOT

pytestmark = pytest.mark.slow

SPEC = ROOT / "tests" / "specs" / "airflow-mini.yaml"


def test_the_dag_compacts_each_pipeline_and_refuses_a_short_retention(airflow_home, tmp_path):
    folder, data = tmp_path / "pipelines", tmp_path / "data"
    folder.mkdir()
    (folder / "mini.yaml").write_text(SPEC.read_text())
    path = str(data / "sinks" / "mini" / "raw")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": sink_app_id("mini", "in", "raw")})
    for b in range(3):
        rows = pa.table({"_isb_id": [f"in/0/{b * 10 + i}" for i in range(1, 11)]})
        commit_batch(opts, [write_batch_files(opts, rows.to_batches(), b, 0)], b)
    env = {"ISBFLOW_HOME": str(data), "ISBFLOW_PIPELINES_DIR": str(folder), "NATS_URL": ""}

    done = airflow_home.run_dag("sink_maintenance", {}, extra_env=env, timeout=600)

    assert done.state == "success", done.output[-6000:]
    raw = done.xcom["maintain_mini"]["raw"]
    assert (raw["version_before"], raw["files_before"], raw["files_after"]) == (2, 3, 1)
    assert raw["retention_hours"] == 168 and raw["vacuumed"] == 0
    assert len(DeltaTable(path).file_uris()) == 1

    refused = airflow_home.run_dag("sink_maintenance", {"retention_hours": 1}, extra_env=env, timeout=600)

    assert refused.state == "failed" and refused.tasks == {"maintain_mini": "failed"}
    assert "below the floor" in refused.output
    assert DeltaTable(path).version() == raw["version_after"]
