"""A migrated Airflow for tests: a temporary ``AIRFLOW_HOME`` and ``dag.test()`` in a subprocess.

The fixture ``airflow_home`` (session scope) makes a temporary ``AIRFLOW_HOME``,
migrates its SQLite metadata DB once (``airflow db migrate``) and hands out the
environment the platform itself uses (:func:`isbflow.platform.airflow_env`:
repository ``dags/``, no examples). :meth:`AirflowHome.run_dag` runs one DAG
with ``dag.test()`` in a fresh Python process with that environment, so
Airflow's configuration (read once per process at import) never leaks between
tests or into the pytest process; it returns the run's state, each task's
state and XCom ``return_value``, and the process output for failure messages.

The fixtures are registered for the whole suite by tests/conftest.py
(the DB is migrated once per session and copied into each home).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from isbflow.platform import airflow_env

ROOT = Path(__file__).resolve().parents[2]
DAGS = ROOT / "dags"
RESULT_MARK = "@@DAG_TEST_RESULT@@ "
#: the SQLite metadata DB Airflow keeps in its AIRFLOW_HOME by default
DB_FILE = "airflow.db"


@dataclass
class DagRunResult:
    state: str
    tasks: dict[str, str]
    xcom: dict[str, object]
    output: str


@dataclass
class AirflowHome:
    home: Path
    env: dict[str, str]

    def run_dag(self, dag_id: str, conf: dict | None = None, extra_env: dict[str, str] | None = None,
                dag_file: Path | None = None, timeout: float = 300) -> DagRunResult:
        """Run ``dag_id`` (from ``dags/<dag_id>.py`` unless ``dag_file``) once with ``dag.test()``."""
        dag_file = dag_file or DAGS / f"{dag_id}.py"
        env = {**self.env, **(extra_env or {})}
        proc = subprocess.run(
            [sys.executable, __file__, str(dag_file), dag_id, json.dumps(conf or {})],
            env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        )
        output = proc.stdout + proc.stderr
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)), None)
        if proc.returncode != 0 or line is None:
            raise AssertionError(f"dag.test() of {dag_id} crashed (exit {proc.returncode}):\n{output[-4000:]}")
        d = json.loads(line[len(RESULT_MARK):])
        return DagRunResult(d["state"], d["tasks"], d["xcom"], output)


@pytest.fixture(scope="session")
def migrated_airflow_db(tmp_path_factory) -> Path:
    """One ``airflow db migrate`` for the session: a pristine SQLite metadata DB that every test
    AIRFLOW_HOME starts from as a copy (:func:`airflow_home_from`)."""
    home = tmp_path_factory.mktemp("airflow_template")
    proc = subprocess.run([str(Path(sys.executable).parent / "airflow"), "db", "migrate"],
                          env=airflow_env(home, DAGS), capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"airflow db migrate failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return home / DB_FILE


def airflow_home_from(db: Path, home: Path) -> dict[str, str]:
    """``home`` as an AIRFLOW_HOME holding a copy of the migrated ``db``; its environment."""
    home.mkdir(parents=True, exist_ok=True)
    shutil.copy2(db, home / DB_FILE)
    return airflow_env(home, DAGS)


@pytest.fixture(scope="session")
def airflow_home(tmp_path_factory, migrated_airflow_db) -> AirflowHome:
    """A temporary AIRFLOW_HOME with a migrated metadata DB, shared by the session's Airflow tests."""
    home = tmp_path_factory.mktemp("airflow_home")
    return AirflowHome(home, airflow_home_from(migrated_airflow_db, home))


def _run(dag_file: str, dag_id: str, conf: str) -> None:
    """Child process: import the DAG file, run the DAG once, print the result line."""
    import runpy

    from airflow.models.xcom import XComModel
    from airflow.sdk import DAG
    from airflow.utils.session import create_session

    module = runpy.run_path(dag_file)
    dag = next(v for v in module.values() if isinstance(v, DAG) and v.dag_id == dag_id)
    dr = dag.test(run_conf=json.loads(conf))
    with create_session() as session:
        tis = dr.get_task_instances(session=session)
        tasks = {ti.task_id: str(ti.state) for ti in tis}
        xcom = {}
        for ti in tis:
            row = session.query(XComModel).filter_by(dag_id=dag_id, run_id=dr.run_id, task_id=ti.task_id,
                                                     key="return_value").one_or_none()
            if row is not None:
                xcom[ti.task_id] = XComModel.deserialize_value(row)
    print(RESULT_MARK + json.dumps({"state": str(dr.state), "tasks": tasks, "xcom": xcom}, default=str),
          flush=True)


if __name__ == "__main__":
    _run(*sys.argv[1:4])
