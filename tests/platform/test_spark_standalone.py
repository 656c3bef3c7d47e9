"""The demo pipeline on a real Spark standalone cluster (one master, one worker) on loopback.

The master and worker are the pyspark wheel's own ``spark-class`` daemons
(:mod:`isbflow.platform.standalone`), bound to 127.0.0.1, stopped by PID at teardown.
``isbflow pipeline run --master spark://127.0.0.1:<port>`` runs as a subprocess
with its own client-mode driver (standalone takes no Python application in
cluster deploy mode); its tasks run in an executor the worker starts. The sinks
must hold exactly what was produced, and the executor's own logs on the worker
must not hold the NATS password.
"""

from __future__ import annotations

import pytest

from isbflow.platform.standalone import start_standalone, stop_standalone
from tests.helpers.scale_env import DemoRun

pytestmark = pytest.mark.slow

COUNT = 3000
MALFORMED_EVERY = 500


@pytest.fixture
def cluster(tmp_path):
    c = start_standalone(tmp_path / "spark", workers=1, cores=1, memory="1g")
    try:
        yield c
    finally:
        stop_standalone(c)
        assert not any(d.alive() for d in c.daemons()), "a Spark daemon outlived the test"


def test_daemons_bind_loopback_and_the_worker_registers(cluster):
    state = cluster.master_state()
    assert state["status"] == "ALIVE" and cluster.master_url == state["url"]
    assert [(w["host"], w["cores"], w["memory"], w["state"]) for w in state["workers"]] == [
        ("127.0.0.1", 1, 1024, "ALIVE")]


def test_demo_pipeline_on_standalone_cluster(cluster, nats_server, tmp_path):
    demo = DemoRun(nats_server.settings, tmp_path / "data")
    demo.produce(COUNT, MALFORMED_EVERY)

    result, proc = demo.run(master=cluster.master_url)

    steps = result["steps"]
    assert {v: s["state"] for v, s in steps.items()} == {v: "stopped" for v in demo.p.topological_order()}
    assert steps["in"]["final_offsets"] == {"src-logs-in": COUNT}
    ids = demo.raw_ids()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == demo.good_ids(COUNT, MALFORMED_EVERY)
    assert len(demo.dead_letters()) == COUNT // MALFORMED_EVERY

    # the application ran on the cluster: the master lists it, the worker ran its executor
    apps = cluster.master_state()["completedapps"]
    assert [a["name"] for a in apps] == ["isbflow-logs"]
    app_id = apps[0]["id"]
    worker_dir = cluster.work_dir / "worker-1" / app_id
    executor_logs = sorted(worker_dir.glob("*/stderr"))
    assert executor_logs, f"no executor ran on the worker (nothing under {worker_dir})"
    password = nats_server.state.password
    assert password
    for f in [*executor_logs, *worker_dir.glob("*/stdout"), *(d.log for d in cluster.daemons())]:
        assert password not in f.read_text(errors="replace"), f"NATS password in {f}"
    assert password not in proc.stdout + proc.stderr
