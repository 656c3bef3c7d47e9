"""The ``pipeline_rescale`` DAG: it parses, its task is the rescale operator, and a real
``dag.test()`` run (tests/helpers/airflow_env.py) against a real nats-server reaches
:func:`isbflow.ops.rescale.rescale`: with an unread partition and no Force, the task fails
naming the stream and its unread count, and nothing changes; with Force it re-partitions.
The pipeline does not run here (no Spark): the drain and resume are proven on the same
function in tests/ops/test_rescale_pipeline.py.
"""

from __future__ import annotations

import pytest

from isbflow.platform import nats_connection_json
from isbflow.spec import derived
from tests.helpers.airflow_env import DAGS
from tests.helpers.provision import publish
from tests.ops.test_rescale import Setup, held, streams, write_spec

pytestmark = pytest.mark.slow


def test_the_dag_parses_and_its_task_is_the_rescale_operator(airflow_home):
    code = ("from airflow.dag_processing.dagbag import DagBag\n"
            f"b = DagBag({str(DAGS / 'pipeline_rescale.py')!r})\n"
            "d = b.dags.get('pipeline_rescale')\n"
            "result = {'errors': {k: str(v) for k, v in b.import_errors.items()},\n"
            "          'tasks': {t.task_id: type(t).__module__ + '.' + type(t).__name__ for t in d.tasks} if d else {},\n"
            "          'params': sorted(d.params) if d else []}")
    out = airflow_home.run_code(code, timeout=180)
    assert out["errors"] == {}
    assert out["tasks"] == {"rescale": "isbflow.airflow.operators.rescale.PipelineRescaleOperator"}
    assert out["params"] == ["force", "partitions", "pipeline", "timeout", "vertex"]


def test_a_dag_run_refuses_an_unread_partition_then_force_rescales(airflow_home, nats_server, tmp_path):
    setup = Setup(nats_server, tmp_path)
    setup.provision(raw=4)
    publish(setup.settings, derived.edge_subject("resc", "in", "raw", 3), 6)
    write_spec(setup.folder, raw=2)  # the spec says 2
    env = {"ISBFLOW_HOME": str(setup.data_dir), "ISBFLOW_PIPELINES_DIR": str(setup.folder), "NATS_URL": "",
           "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state)}
    conf = {"pipeline": "rescale.yaml", "vertex": "raw", "partitions": 2, "force": False, "timeout": 60}

    refused = airflow_home.run_dag("pipeline_rescale", conf, extra_env=env, timeout=300)
    assert refused.state == "failed" and refused.tasks == {"rescale": "failed"}, refused.output[-4000:]
    assert f"{streams(4)[3]} (buffer in->raw, partition 3): 6 unread message(s)" in refused.output
    _, _, p4 = setup.load(raw=4)
    assert [h.stream for h in held(setup.settings, p4)] == streams(4)  # nothing changed

    write_spec(setup.folder, raw=2)  # loading p4 above wrote 4
    forced = airflow_home.run_dag("pipeline_rescale", {**conf, "force": True}, extra_env=env, timeout=300)
    assert forced.state == "success", forced.output[-4000:]
    result = forced.xcom["rescale"]
    assert (result["before"], result["after"], result["removed"]) == (4, 2, streams(4)[2:])
    assert result["dropped"] == {streams(4)[3]: 6} and result["launch"] is None
    _, _, p2 = setup.load(raw=2)
    assert [h.stream for h in held(setup.settings, p2)] == streams(2)
