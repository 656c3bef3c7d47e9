"""Airflow's metadata DB on a real PostgreSQL 15, made by the test; the start -> drain cycle on it.

The fixture ``postgres`` makes a throwaway cluster on 127.0.0.1, stopped by PID at
teardown (:func:`tests.helpers.postgres.running_postgres` says how).

``airflow db migrate`` then builds Airflow's schema there
(``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgresql+psycopg2://...``), and the
``pipeline_start`` and ``pipeline_drain`` DAGs run with ``dag.test()`` in
subprocesses (Airflow reads its DB setting once per process, at import): the
raw sink ends with exactly the well-formed events produced, and the DAG runs are
rows in PostgreSQL (not in some SQLite file).
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from isbflow.platform import airflow_env, nats_connection_json
from isbflow.steps.launch import read_launch, read_statuses, stop_launch
from tests.helpers.airflow_env import DAGS, ROOT, AirflowHome
from tests.helpers.postgres import Postgres, running_postgres
from tests.helpers.scale_env import SPEC, DemoRun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL 15 cluster on 127.0.0.1:<free port> with database ``airflow``, owner ``airflow``."""
    with running_postgres() as pg:
        yield pg


@pytest.fixture(scope="module")
def airflow_pg(postgres, tmp_path_factory) -> AirflowHome:
    """A temporary AIRFLOW_HOME whose metadata DB is the PostgreSQL cluster, migrated."""
    home = tmp_path_factory.mktemp("airflow_pg")
    env = {**airflow_env(home, DAGS), "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": postgres.url()}
    r = subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"airflow db migrate on PostgreSQL failed:\n{(r.stdout + r.stderr)[-3000:]}"
    af = AirflowHome(home, env)
    try:
        yield af
    finally:
        af.close()  # its DAG-runner process, by PID


def wait_first_batches(demo: DemoRun, record, steps: tuple[str, ...], timeout: float = 300) -> None:
    """Until each of ``steps`` has committed a micro-batch (its heartbeat's batch id >= 0)."""
    deadline = time.monotonic() + timeout
    while True:
        statuses = asyncio.run(read_statuses(demo.settings, demo.p.name, list(steps)))
        failed = {v: s.error for v, s in statuses.items() if s is not None and s.state == "failed"}
        assert not failed, f"{failed}\n--- driver:\n{record.log_tail(40)}"
        if all(s is not None and s.batch_id >= 0 for s in statuses.values()):
            return
        assert time.monotonic() < deadline, f"no first batch in {timeout:.0f}s: {statuses}\n{record.log_tail(40)}"
        time.sleep(2)


def test_migrate_built_the_schema_in_postgres(postgres, airflow_pg):
    tables = {t for (t,) in postgres.query("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    assert {"dag", "dag_run", "task_instance", "alembic_version", "connection"} <= tables
    assert not list(airflow_pg.home.glob("*.db")), "Airflow made a SQLite file despite the PostgreSQL setting"


def test_start_then_drain_on_postgres_metadata(postgres, airflow_pg, nats_server, tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    shutil.copy(SPEC, folder / "standalone-logs.yaml")
    demo = DemoRun(nats_server.settings, tmp_path / "data", spec=folder / "standalone-logs.yaml")
    env = {"ISBFLOW_HOME": str(demo.data_dir), "ISBFLOW_PIPELINES_DIR": str(folder), "NATS_URL": "",
           "ISBFLOW_PROJECT_DIR": str(ROOT),
           "AIRFLOW_CONN_NATS_DEFAULT": nats_connection_json(nats_server.state)}
    before, during = 2000, 1000
    demo.produce(before)
    try:
        started = airflow_pg.run_dag("pipeline_start", {"pipeline": "standalone-logs.yaml", "master": "local[2]"},
                                     extra_env=env, timeout=600)
        assert started.state == "success", started.output[-6000:]
        assert started.xcom["wait_running"] == {v: "running" for v in demo.p.topological_order()}
        record = read_launch(demo.data_dir, demo.p.name)
        assert record is not None and record.alive()
        # let the driver get past its first batches (Spark starts a Python worker per query) before
        # the next DAG's process competes for the 2 cores
        wait_first_batches(demo, record, ("in", "parse", "enrich", "raw", "minutely"))

        demo.produce(during, start=before)
        drained = airflow_pg.run_dag("pipeline_drain", {"pipeline": "standalone-logs.yaml", "timeout": 300},
                                     extra_env=env, timeout=600)
        assert drained.state == "success", drained.output[-6000:] + "\n--- driver:\n" + record.log_tail(40)
        assert drained.xcom["drain"]["final_offsets"]["in"] == {"src-logs-in": before + during}
    finally:
        stop_launch(demo.data_dir, demo.p.name, grace=20)

    ids = demo.raw_ids()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
    assert set(ids) == demo.good_ids(before + during)
    runs = postgres.query("SELECT dag_id, state FROM dag_run WHERE dag_id IN ('pipeline_start', 'pipeline_drain') "
                          "ORDER BY id")
    assert runs == [("pipeline_start", "success"), ("pipeline_drain", "success")]
