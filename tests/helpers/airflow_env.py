"""A migrated Airflow for tests: a temporary ``AIRFLOW_HOME`` and ``dag.test()`` in a subprocess.

The fixture ``airflow_home`` (session scope) makes a temporary ``AIRFLOW_HOME``,
migrates its SQLite metadata DB once (``airflow db migrate``) and hands out the
environment the platform itself uses (:func:`isbflow.platform.airflow_env`:
repository ``dags/``, no examples). :meth:`AirflowHome.run_dag` runs one DAG
with ``dag.test()`` outside the pytest process, so Airflow's configuration (read
once per process at import) never leaks into it; it returns the run's state, each
task's state and XCom ``return_value``, and the run's output for failure messages.

The runs of one home share one DAG-runner process (:class:`DagServer`): it imports
Airflow once and keeps the JVM its Spark tasks start (each task still starts and stops
its own SparkSession), where a fresh process per run cost ~6 CPU-seconds of imports plus
a JVM launch. Only what a run may change between runs reaches it: the isbflow data dir
and pipelines and project folders, ``NATS_URL`` and Airflow connections (read at each lookup). A run
whose environment differs in anything else (``SPARK_CONF_DIR``, an ``AIRFLOW__`` option)
runs in a fresh process as before, as does every run after the server died or timed out.

The fixtures are registered for the whole suite by tests/conftest.py
(the DB is migrated once per session and copied into each home).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
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


#: what may differ between the runs one DAG-runner process serves (read at use, never at import)
PER_RUN_ENV = ("ISBFLOW_HOME", "ISBFLOW_PIPELINES_DIR", "ISBFLOW_PROJECT_DIR", "NATS_URL")
PER_RUN_PREFIX = "AIRFLOW_CONN_"


def per_run(key: str) -> bool:
    return key in PER_RUN_ENV or key.startswith(PER_RUN_PREFIX)


def fixed_part(env: dict[str, str]) -> dict[str, str]:
    """The part of a run's environment one DAG-runner process must have started with."""
    return {k: v for k, v in env.items() if not per_run(k)}


class DagServer:
    """One ``python airflow_env.py --serve`` child running DAGs on request, one at a time.

    Requests and results are JSON lines on its stdin/stdout; its stdout and stderr (the
    JVM's too) go to one log file, and a run's output is what the log grew by during it.
    """

    def __init__(self, env: dict[str, str], log: Path):
        self.env = env
        self.log = log
        self.proc: subprocess.Popen | None = None

    def serves(self, env: dict[str, str]) -> bool:
        return fixed_part(env) == fixed_part(self.env)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, "--serve", str(self.log)], env=self.env,
                                         cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                         start_new_session=True)

    def run(self, request: dict, env: dict[str, str], timeout: float) -> tuple[dict | None, str]:
        """(the result of ``request`` (a DAG run or code) or None when the server died, the run's output)."""
        if not self.alive():
            self.start()
        offset = self.log.stat().st_size
        request = {**request, "env": env}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        line = self.read_line(timeout)
        with open(self.log, "rb") as f:
            f.seek(offset)
            output = f.read().decode(errors="replace")
        if line is None:
            self.stop()
            return None, output
        return json.loads(line), output

    def read_line(self, timeout: float) -> bytes | None:
        """The next result line; None at EOF; TimeoutExpired (the server killed) after ``timeout``."""
        deadline = time.monotonic() + timeout
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stop()
                    raise subprocess.TimeoutExpired(f"dag.test() in {__file__} --serve", timeout)
                if sel.select(left):
                    line = self.proc.stdout.readline()
                    if not line:
                        return None
                    if line.startswith(RESULT_MARK.encode()):
                        return line[len(RESULT_MARK):]
        finally:
            sel.close()

    def stop(self) -> None:
        """Ends the server and everything it started (its JVM): EOF, then its process group by PID."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of its group is left (the gateway JVM)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc.stdout.close()
        self.proc = None


@dataclass
class AirflowHome:
    home: Path
    env: dict[str, str]
    server: DagServer | None = field(default=None, repr=False)

    def run_dag(self, dag_id: str, conf: dict | None = None, extra_env: dict[str, str] | None = None,
                dag_file: Path | None = None, timeout: float = 300) -> DagRunResult:
        """Run ``dag_id`` (from ``dags/<dag_id>.py`` unless ``dag_file``) once with ``dag.test()``."""
        dag_file = dag_file or DAGS / f"{dag_id}.py"
        env = {**self.env, **(extra_env or {})}
        if self.server_for(env):
            request = {"dag_file": str(dag_file), "dag_id": dag_id, "conf": conf or {}}
            result, output = self.server.run(request, env, timeout)
            if result is None or "error" in result:
                crash = result["error"] if result else "the DAG-runner process died"
                raise AssertionError(f"dag.test() of {dag_id} crashed ({crash}):\n{output[-4000:]}")
            return DagRunResult(result["state"], result["tasks"], result["xcom"], output)
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

    def server_for(self, env: dict[str, str]) -> DagServer | None:
        """The home's DAG-runner process when it can serve a run in ``env`` (started on first use)."""
        if self.server is None:
            self.server = DagServer(self.env, self.home / "dag-server.log")
        return self.server if self.server.serves(env) else None

    def run_code(self, code: str, extra_env: dict[str, str] | None = None, timeout: float = 300) -> object:
        """Run Python ``code`` that sets ``result`` with Airflow's configuration of this home (the
        metadata DB, DagBag, ...); ``result`` as JSON gives it back."""
        env = {**self.env, **(extra_env or {})}
        if self.server_for(env):
            out, output = self.server.run({"code": code}, env, timeout)
            assert out is not None and "error" not in out, f"{(out or {}).get('error')}\n{output[-3000:]}"
            return out["result"]
        script = f"import json\n{code}\nprint({RESULT_MARK!r} + json.dumps(result, default=str))"
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARK)), None)
        assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-3000:]
        return json.loads(line[len(RESULT_MARK):])

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


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
    af = AirflowHome(home, airflow_home_from(migrated_airflow_db, home))
    try:
        yield af
    finally:
        af.close()


def run_one(dag_file: str, dag_id: str, conf: dict) -> dict:
    """Import the DAG file, run the DAG once with ``dag.test()``; its state, task states and XComs."""
    import runpy

    from airflow.models.xcom import XComModel
    from airflow.sdk import DAG
    from airflow.utils.session import create_session

    module = runpy.run_path(dag_file)
    dag = next(v for v in module.values() if isinstance(v, DAG) and v.dag_id == dag_id)
    dr = dag.test(run_conf=conf)
    with create_session() as session:
        tis = dr.get_task_instances(session=session)
        tasks = {ti.task_id: str(ti.state) for ti in tis}
        xcom = {}
        for ti in tis:
            row = session.query(XComModel).filter_by(dag_id=dag_id, run_id=dr.run_id, task_id=ti.task_id,
                                                     key="return_value").one_or_none()
            if row is not None:
                xcom[ti.task_id] = XComModel.deserialize_value(row)
    return {"state": str(dr.state), "tasks": tasks, "xcom": xcom}


def serve(log: str) -> None:
    """Child process of :class:`DagServer`: one request line in, one result line out, until EOF.

    Its stdout and stderr (and so every process it starts) write to ``log``; results go to the
    stdout it was started with. Each run sees exactly the environment it was sent.
    """
    results = os.fdopen(os.dup(1), "w")
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for line in sys.stdin:
        req = json.loads(line)
        os.environ.clear()
        os.environ.update(req["env"])
        try:
            if "code" in req:
                scope: dict = {}
                exec(req["code"], scope)  # noqa: S102 - the tests' own code
                out = {"result": json.loads(json.dumps(scope["result"], default=str))}
            else:
                out = run_one(req["dag_file"], req["dag_id"], req["conf"])
        except BaseException as e:  # noqa: BLE001 - reported to the test, which fails on it
            traceback.print_exc()
            out = {"error": repr(e)}
        sys.stdout.flush()
        sys.stderr.flush()
        results.write(RESULT_MARK + json.dumps(out, default=str) + "\n")
        results.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve(sys.argv[2])
    else:  # one run in a fresh process
        print(RESULT_MARK + json.dumps(run_one(sys.argv[1], sys.argv[2], json.loads(sys.argv[3])), default=str),
              flush=True)
