"""Airflow 3 on the platform: its environment, metadata DB, components, health and a small REST client.

Contract: every Airflow process of the platform (and the tests' Airflow fixture) runs with
:func:`airflow_env`: ``AIRFLOW_HOME=<data dir>/airflow``, LocalExecutor with ``[core]
parallelism`` 4, DAGs from the repository's ``dags/``, plugins from its ``plugins/``, no
examples, DAGs unpaused at creation, everything on 127.0.0.1, and no ``AIRFLOW*`` variable
of the caller's. :func:`migrate` runs ``airflow db migrate``; :func:`start_components`
starts ``api-server``, ``scheduler``, ``dag-processor`` and ``triggerer`` as separate
processes, each leading its own session and recorded (PID and start time) in the platform
state as it starts. Not ``airflow standalone``: it opens log servers on 0.0.0.0.

SimpleAuthManager has one ``admin`` user whose password Airflow generates once into
``$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated`` (:func:`admin_password`).
:func:`wait_healthy` waits for ``/api/v2/monitor/health``; :func:`api_token`, :func:`api`,
:func:`wait_for_dag` and :func:`unpause` call the REST API as ``admin``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from isbflow.ops.nats import ServerState, role_password_file
from isbflow.ops.processes import process_start
from isbflow.platform.state import (
    HOST,
    PlatformError,
    PlatformState,
    ProcessState,
    Progress,
    quiet,
    repo_root,
    venv_bin,
    write_state,
)

DEFAULT_API_PORT = 8080
ADMIN = "admin"
#: Airflow components, in start order; they stop in reverse.
COMPONENTS: dict[str, list[str]] = {
    "api-server": ["api-server", "--host", HOST, "--port", "{port}"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
HEALTH_PARTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")
#: DAGs whose schedules the platform wants running (unpaused at every start when they exist)
SCHEDULED_DAGS = ("pipeline_quality",)


# -- environment ------------------------------------------------------------------------------------------

def airflow_home(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "airflow"


def airflow_bin() -> str:
    return venv_bin("airflow")


def nats_connection_json(state: ServerState, user: str | None = None) -> str:
    """``AIRFLOW_CONN_NATS_DEFAULT`` for the embedded server (JSON form, credentials included); with
    ``user`` (e.g. ``reader``, for ``AIRFLOW_CONN_NATS_READER``) that role's user instead of the admin."""
    node = state.nodes[0]
    conn: dict = {"conn_type": "nats", "host": ",".join(f"{HOST}:{n.client_port}" for n in state.nodes),
                  "port": node.client_port}
    if state.user and user:
        conn["login"] = user
        conn["password"] = role_password_file(state.data_dir, user).read_text().strip()
    elif state.user:
        conn["login"], conn["password"] = state.user, state.password
    if state.ca_file:
        conn["extra"] = {"tls_ca": state.ca_file}
    return json.dumps(conn)


def airflow_env(home: Path, dags_folder: Path, api_port: int = DEFAULT_API_PORT,
                base: dict[str, str] | None = None, plugins_folder: Path | None = None) -> dict[str, str]:
    """The environment every Airflow process of the platform (and the test fixture) runs with.

    Starts from ``base`` (default ``os.environ``) without its ``AIRFLOW*`` variables, so an
    outer Airflow setup cannot leak in. Plugins come from ``plugins_folder`` (default: the
    repository's ``plugins/``).
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AIRFLOW")}
    bin_dir = str(Path(sys.executable).parent)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins_folder or repo_root() / "plugins"),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
        "AIRFLOW__CORE__PARALLELISM": "4",
        "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "False",
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{HOST}:{api_port}/execution/",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN}:admin",
        "AIRFLOW__API__HOST": HOST,
        "AIRFLOW__API__PORT": str(api_port),
        "AIRFLOW__API__BASE_URL": f"http://{HOST}:{api_port}",
        "AIRFLOW__API__WORKERS": "1",
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",  # a new DAG file shows within seconds
        # a parsed file is parsed again after 2 minutes, not Airflow's 30 s: each parse is a process that
        # imports the DAG file (isbflow, and pyspark for the catalog DAGs); at 30 s the dag-processor took
        # 57 CPU-seconds in 103 processes over a 6-minute `platform up` (~0.16 of a core while idle)
        "AIRFLOW__DAG_PROCESSOR__MIN_FILE_PROCESS_INTERVAL": "120",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": HOST,
        "PATH": bin_dir + os.pathsep + env.get("PATH", ""),
    })
    return env


#: where Airflow's SimpleAuthManager writes the generated passwords, under AIRFLOW_HOME
PASSWORD_FILE = "simple_auth_manager_passwords.json.generated"


def admin_password(home: Path) -> str | None:
    """The generated SimpleAuthManager password of ``admin`` (None until the api-server wrote it)."""
    path = Path(home) / PASSWORD_FILE
    try:
        return json.loads(path.read_text()).get(ADMIN)
    except (OSError, ValueError):
        return None


def tail(path: Path | str, chars: int = 1500) -> str:
    """The end of a log file ('' when it cannot be read)."""
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


# -- starting -----------------------------------------------------------------------------------------------

def migrate(env: dict[str, str], home: Path) -> None:
    """``airflow db migrate`` (log in ``logs/platform/db-migrate.log``); PlatformError when it fails."""
    log = home / "logs" / "platform" / "db-migrate.log"
    with open(log, "ab") as logf:
        p = subprocess.Popen([airflow_bin(), "db", "migrate"], env=env, stdout=logf, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = p.wait(timeout=300)
        except BaseException:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    if rc != 0:
        raise PlatformError(f"'airflow db migrate' failed (exit {rc}); see {log}:\n{tail(log)}")


def start_components(state: PlatformState, env: dict[str, str], progress: Progress = quiet) -> None:
    """Start each of :data:`COMPONENTS` detached (own session), recording each in ``state`` as it starts."""
    home = Path(state.airflow_home)
    for name, args in COMPONENTS.items():
        progress(f"starting airflow {name}")
        log = home / "logs" / "platform" / f"{name}.log"
        with open(log, "ab") as logf:
            p = subprocess.Popen(
                [airflow_bin(), *(a.format(port=state.api_port) for a in args)], env=env, cwd=repo_root(),
                stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                umask=0o077,  # files Airflow writes (the generated admin password) are owner-only
            )
        state.processes.append(ProcessState(name, p.pid, str(log), process_start(p.pid)))
        write_state(state)


# -- health -------------------------------------------------------------------------------------------------

def health(api_port: int, timeout: float = 5.0) -> dict | None:
    """``/api/v2/monitor/health`` as a dict, or None when the api-server does not answer (in ``timeout`` s)."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{api_port}/api/v2/monitor/health", timeout=timeout) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def is_healthy(h: dict | None) -> bool:
    return h is not None and all((h.get(part) or {}).get("status") == "healthy" for part in HEALTH_PARTS)


def dead_process(state: PlatformState) -> ProcessState | None:
    return next((p for p in state.processes if not p.alive()), None)


def wait_healthy(state: PlatformState, progress: Progress = quiet, timeout: float = 180.0) -> None:
    """Wait until every Airflow part reports healthy; a process that dies fails at once with its log."""
    deadline = time.monotonic() + timeout
    while True:
        dead = dead_process(state)
        if dead is not None:
            raise PlatformError(f"airflow {dead.name} exited during start; log {dead.log}:\n{tail(dead.log)}")
        h = health(state.api_port)
        if is_healthy(h):
            return
        waiting = ("api-server",) if h is None else tuple(
            p for p in HEALTH_PARTS if (h.get(p) or {}).get("status") != "healthy")
        progress(f"waiting for Airflow: {', '.join(waiting)}")
        if time.monotonic() > deadline:
            raise PlatformError(f"Airflow not healthy after {timeout:.0f}s (waiting for {', '.join(waiting)}); "
                                f"logs under {Path(state.airflow_home) / 'logs' / 'platform'}")
        time.sleep(1.0)


# -- the REST API -------------------------------------------------------------------------------------------

def api_token(state: PlatformState, password: str) -> str:
    """A JWT for ``Authorization: Bearer`` on ``/api/v2`` (``POST /auth/token``)."""
    body = json.dumps({"username": ADMIN, "password": password}).encode()
    req = urllib.request.Request(f"{state.url}/auth/token", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["access_token"]


def api(state: PlatformState, token: str, method: str, path: str, body: dict | None = None,
        timeout: float = 10.0) -> Any:
    """One ``/api/v2`` call as ``admin``; the decoded JSON answer. HTTPError propagates (status, body)."""
    req = urllib.request.Request(f"{state.url}/api/v2/{path.lstrip('/')}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def wait_for_dag(state: PlatformState, password: str, dag_id: str, timeout: float = 60.0) -> bool:
    """True once the dag-processor has registered ``dag_id`` (seen through the REST API as ``admin``)."""
    try:
        token = api_token(state, password)
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            api(state, token, "GET", f"dags/{dag_id}", timeout=5)
            return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def unpause(state: PlatformState, password: str, dag_ids: tuple[str, ...] = SCHEDULED_DAGS,
            progress: Progress = quiet, timeout: float = 30.0) -> dict[str, str]:
    """Unpause each DAG whose file exists in the DAGs folder, once parsed; dag id -> outcome.

    Outcomes: ``unpaused``, ``no file`` (the DAG is not in ``dags/``), ``not parsed`` (it did
    not appear within ``timeout`` s: see the dag-processor log).
    """
    out: dict[str, str] = {}
    for dag_id in dag_ids:
        if not (Path(state.dags_folder) / f"{dag_id}.py").exists():
            out[dag_id] = "no file"
            continue
        progress(f"waiting for DAG {dag_id} to be parsed")
        if not wait_for_dag(state, password, dag_id, timeout):
            out[dag_id] = "not parsed"
            continue
        try:
            api(state, api_token(state, password), "PATCH", f"dags/{dag_id}", {"is_paused": False})
            out[dag_id] = "unpaused"
        except (urllib.error.URLError, OSError) as e:
            out[dag_id] = f"not unpaused: {e}"
    return out
