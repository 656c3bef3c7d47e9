"""Airflow's metadata DB on a real PostgreSQL 15, made by the test; the start -> drain cycle on it.

The fixture ``postgres`` makes a throwaway cluster: ``initdb`` (password auth,
scram-sha-256, a generated password in an owner-only file) in a temporary
folder, then ``postgres`` listening on 127.0.0.1 on a free port only (its Unix
socket in that folder), stopped by PID at teardown. ``initdb`` refuses to run as
root, so under root both run as the unprivileged ``postgres`` user (``nobody``
if there is none) through ``setpriv``; the cluster's folder is outside pytest's
root-only temp tree so that user can reach it.

``airflow db migrate`` then builds Airflow's schema there
(``AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=postgresql+psycopg2://...``), and the
``pipeline_start`` and ``pipeline_drain`` DAGs run with ``dag.test()`` in
subprocesses (Airflow reads its DB setting once per process, at import): the
raw sink ends with exactly the well-formed events produced, and the DAG runs are
rows in PostgreSQL (not in some SQLite file).
"""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from isbflow.isb.server import free_port
from isbflow.platform import airflow_env, nats_connection_json
from isbflow.steps.launch import read_launch, read_statuses, stop_launch
from tests.helpers.airflow_env import DAGS, ROOT, AirflowHome
from tests.helpers.scale_env import SPEC, DemoRun

pytestmark = pytest.mark.slow

HOST = "127.0.0.1"
DB, USER = "airflow", "airflow"


@dataclass
class Postgres:
    folder: Path
    port: int
    password: str
    pid: int

    def url(self, driver: str = "postgresql+psycopg2") -> str:
        return f"{driver}://{USER}:{self.password}@{HOST}:{self.port}/{DB}"

    def query(self, sql: str) -> list[tuple]:
        import psycopg2

        with psycopg2.connect(host=HOST, port=self.port, user=USER, password=self.password, dbname=DB) as c:
            with c.cursor() as cur:
                cur.execute(sql)
                return cur.fetchall()


def _run_as() -> tuple[list[str], int | None, int | None]:
    """How to run PostgreSQL's programs: as is, or (as root) through setpriv as an unprivileged user."""
    if os.geteuid() != 0:
        return [], None, None
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail("running as root and setpriv (util-linux) is missing: initdb refuses root")
    for name in ("postgres", "nobody"):
        try:
            u = pwd.getpwnam(name)
        except KeyError:
            continue
        return [setpriv, f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups"], u.pw_uid, u.pw_gid
    pytest.fail("running as root with neither a 'postgres' nor a 'nobody' user to run initdb as")


def _binary(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))),
                                       None)
    if found is None:
        pytest.fail(f"PostgreSQL's {name} is not installed: scripts/ensure-postgres (run by make test) installs it")
    return found


def _wait_ready(pg: Postgres, proc: subprocess.Popen, log: Path, timeout: float = 60) -> None:
    import psycopg2

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"postgres exited with {proc.returncode}; log {log}:\n{log.read_text()[-2000:]}")
        try:
            psycopg2.connect(host=HOST, port=pg.port, user=USER, password=pg.password, dbname="postgres",
                             connect_timeout=2).close()
            return
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not accepting connections after {timeout:.0f}s; log {log}:\n"
                                   f"{log.read_text()[-2000:]}") from None
            time.sleep(0.3)


@pytest.fixture(scope="module")
def postgres() -> Iterator[Postgres]:
    """A PostgreSQL 15 cluster on 127.0.0.1:<free port> with database ``airflow``, owner ``airflow``."""
    prefix, uid, gid = _run_as()
    initdb, server = _binary("initdb"), _binary("postgres")
    folder = Path(tempfile.mkdtemp(prefix="isbflow-pg-"))
    proc = None
    try:
        data, pwfile, log = folder / "data", folder / "pwfile", folder / "postgres.log"
        password = secrets.token_urlsafe(18)
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if uid is not None:
            for p in (folder, pwfile):
                os.chown(p, uid, gid)
        os.chmod(folder, 0o700)
        r = subprocess.run([*prefix, initdb, "-D", str(data), "-U", USER, f"--pwfile={pwfile}",
                            "--auth=scram-sha-256", "-E", "UTF8", "--locale=C.UTF-8"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"initdb failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}"
        pwfile.unlink()
        port = free_port()
        with open(log, "ab") as out:
            proc = subprocess.Popen([*prefix, server, "-D", str(data), "-p", str(port), "-k", str(folder),
                                     "-c", f"listen_addresses={HOST}", "-c", "max_connections=50",
                                     "-c", "fsync=off"],  # a throwaway cluster: speed over durability
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        pg = Postgres(folder, port, password, proc.pid)
        _wait_ready(pg, proc, log)
        import psycopg2

        c = psycopg2.connect(host=HOST, port=port, user=USER, password=password, dbname="postgres")
        c.autocommit = True
        c.cursor().execute(f"CREATE DATABASE {DB} OWNER {USER}")
        c.close()
        yield pg
    finally:
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)  # PostgreSQL's fast shutdown
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


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
