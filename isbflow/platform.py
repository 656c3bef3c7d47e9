"""The local platform: the embedded ISB service and Airflow 3, on 127.0.0.1 only.

:func:`start` brings up, under one data dir (``ISBFLOW_HOME``, default
``./.isbflow``):

1. the embedded nats-server (:func:`isbflow.isb.server.start_embedded`; client
   port 4222 when free), reused when one already runs there;
2. Airflow with ``AIRFLOW_HOME=<data dir>/airflow``: ``airflow db migrate``, then
   ``api-server``, ``scheduler``, ``dag-processor`` and ``triggerer`` as separate
   processes. Not ``airflow standalone``: it opens log servers on 0.0.0.0.
   LocalExecutor with ``[core] parallelism`` 4, DAGs from the repository's
   ``dags/``, no examples, DAGs unpaused at creation, SimpleAuthManager with
   one ``admin`` user whose password Airflow generates once into
   ``$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated``; the
   ``nats_default`` connection points at the embedded server.

Each Airflow process leads its own process group; the PIDs are recorded in
``<data dir>/platform.json``. :func:`stop` ends every recorded group (SIGTERM,
then SIGKILL after a grace period) and the nats-server if the platform started
it; state on disk (metadata DB, password, buffers) is kept, so the next start
reuses it. :func:`status` reports liveness, resident memory and health.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from isbflow.isb import server as nats_server
from isbflow.isb.connect import NatsSettings
from isbflow.isb.server import pid_alive

if TYPE_CHECKING:
    from isbflow.spec.models import JetStreamSettings

HOST = "127.0.0.1"
STATE_FILE = "platform.json"
DEFAULT_API_PORT = 8080
DEFAULT_NATS_PORT = 4222
ADMIN = "admin"
#: Airflow components, in start order; they stop in reverse.
COMPONENTS: dict[str, list[str]] = {
    "api-server": ["api-server", "--host", HOST, "--port", "{port}"],
    "scheduler": ["scheduler", "--skip-serve-logs"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer", "--skip-serve-logs"],
}
HEALTH_PARTS = ("metadatabase", "scheduler", "triggerer", "dag_processor")


class PlatformError(Exception):
    """The platform could not start, be found or be stopped; the message says why and what to do."""


@dataclass
class ProcessState:
    name: str
    pid: int
    log: str

    def alive(self) -> bool:
        return pid_alive(self.pid)


@dataclass
class PlatformState:
    data_dir: str
    airflow_home: str
    api_port: int
    dags_folder: str
    supervisor_pid: int
    nats_started: bool
    processes: list[ProcessState] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    def to_json(self) -> dict:
        d = asdict(self)
        d["url"] = self.url
        for p, proc in zip(d["processes"], self.processes, strict=True):
            p["alive"] = proc.alive()
            p["pss_mb"] = round(group_memory(proc.pid) / 2**20, 1)
        return d


# -- paths and environment ----------------------------------------------------------------------

def repo_root() -> Path:
    """The checkout holding ``isbflow/`` (the project is installed editable)."""
    return Path(__file__).resolve().parent.parent


def airflow_home(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "airflow"


def airflow_bin() -> str:
    cand = Path(sys.executable).parent / "airflow"
    if not cand.exists():
        raise PlatformError(f"airflow not found next to {sys.executable}: install the project ('uv sync')")
    return str(cand)


def nats_connection_json(state: nats_server.ServerState) -> str:
    """``AIRFLOW_CONN_NATS_DEFAULT`` for the embedded server (JSON form, credentials included)."""
    node = state.nodes[0]
    conn: dict = {"conn_type": "nats", "host": ",".join(f"{HOST}:{n.client_port}" for n in state.nodes),
                  "port": node.client_port}
    if state.user:
        conn["login"], conn["password"] = state.user, state.password
    if state.ca_file:
        conn["extra"] = {"tls_ca": state.ca_file}
    return json.dumps(conn)


def nats_settings(data_dir: Path) -> NatsSettings:
    """Settings of the embedded server running under ``data_dir`` (never ``NATS_URL``: the platform's own)."""
    state = nats_server.read_state(Path(data_dir))
    if state is None:
        raise PlatformError(f"no embedded nats-server recorded under {data_dir}/")
    return NatsSettings(servers=tuple(state.urls), tls_ca=state.ca_file).with_auth_from_urls()


def airflow_env(home: Path, dags_folder: Path, api_port: int = DEFAULT_API_PORT,
                base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every Airflow process of the platform (and the test fixture) runs with.

    Starts from ``base`` (default ``os.environ``) without its ``AIRFLOW*`` variables, so an
    outer Airflow setup cannot leak in.
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AIRFLOW")}
    venv_bin = str(Path(sys.executable).parent)
    env.update({
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags_folder),
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
        "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "5",
        "AIRFLOW__DAG_PROCESSOR__PARSING_PROCESSES": "1",
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": HOST,
        "PATH": venv_bin + os.pathsep + env.get("PATH", ""),
    })
    return env


def admin_password(home: Path) -> str | None:
    """The generated SimpleAuthManager password of ``admin`` (None until the api-server wrote it)."""
    path = Path(home) / "simple_auth_manager_passwords.json.generated"
    try:
        return json.loads(path.read_text()).get(ADMIN)
    except (OSError, ValueError):
        return None


# -- processes --------------------------------------------------------------------------------------

def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def group_memory(pgid: int) -> int:
    """Memory of a process group in bytes: the sum of its processes' PSS.

    PSS splits pages shared by forked workers among them, so the sum is what the
    group really costs (RSS would count the shared pages once per worker).
    """
    total = 0
    for pid in group_members(pgid):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


def port_free(port: int) -> bool:
    """True when nothing listens on ``HOST:port`` (connections in TIME_WAIT do not count, as for servers)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _group_alive(pgid: int) -> bool:
    return pid_alive(pgid) or bool(group_members(pgid))


def _stop_groups(procs: list[ProcessState], grace: float) -> None:
    """SIGTERM the process groups ``procs`` lead, all at once; SIGKILL what is left after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = []
        for proc in procs:
            try:
                os.killpg(proc.pid, sig)
                live.append(proc)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            for proc in live:
                try:  # reap our own child, or it lingers as a zombie
                    os.waitpid(proc.pid, os.WNOHANG)
                except ChildProcessError:
                    pass
            live = [p for p in live if _group_alive(p.pid)]
            time.sleep(0.2)
        if not live:
            return


def read_state(data_dir: Path) -> PlatformState | None:
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    d.pop("url", None)
    procs = [ProcessState(p["name"], p["pid"], p["log"]) for p in d.pop("processes")]
    return PlatformState(**d, processes=procs)


def _write_state(state: PlatformState) -> None:
    path = Path(state.data_dir) / STATE_FILE
    tmp = path.with_suffix(".tmp")
    d = asdict(state)
    tmp.write_text(json.dumps(d, indent=2))
    tmp.replace(path)


def running(data_dir: Path) -> PlatformState | None:
    """The recorded platform when any of its processes (or its supervisor) is still alive."""
    state = read_state(data_dir)
    if state is None:
        return None
    if pid_alive(state.supervisor_pid) or any(p.alive() for p in state.processes):
        return state
    return None


# -- lifecycle ----------------------------------------------------------------------------------------

Progress = Callable[[str], None]


def start(data_dir: Path, api_port: int = DEFAULT_API_PORT, nats_port: int = DEFAULT_NATS_PORT,
          dags_folder: Path | None = None, server_settings: JetStreamSettings | None = None,
          progress: Progress = lambda _m: None, timeout: float = 180.0) -> PlatformState:
    """Start NATS and Airflow (module docstring) and wait until Airflow reports healthy.

    ``server_settings`` (an ISB service's ``jetstream.settings``: max_payload and the
    memory and file store limits) configure a newly started nats-server.

    On any failure everything started so far is stopped before the error propagates.
    Raises :class:`PlatformError` when a platform already runs under ``data_dir`` or the
    API port is taken.
    """
    data_dir = Path(data_dir).resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    other = running(data_dir)
    if other is not None:
        raise PlatformError(f"a platform already runs under {data_dir}/ (supervisor pid {other.supervisor_pid}, "
                            f"{other.url}): stop it with 'isbflow platform down'")
    if not port_free(api_port):
        raise PlatformError(f"port {HOST}:{api_port} is in use: stop what listens there or pass --port")
    dags = Path(dags_folder or repo_root() / "dags").resolve()
    home = airflow_home(data_dir)
    (home / "logs" / "platform").mkdir(parents=True, exist_ok=True)

    before = nats_server.read_state(data_dir)
    nats_was_up = before is not None and all(before.alive())
    state = PlatformState(str(data_dir), str(home), api_port, str(dags), os.getpid(), not nats_was_up)
    _write_state(state)
    try:
        progress("starting the ISB service (nats-server)")
        try:
            limits = server_settings.model_dump() if server_settings is not None else {}
            nats = nats_server.start_embedded(data_dir, client_port=nats_port if port_free(nats_port) else None,
                                              **limits)
        except nats_server.EmbeddedNatsError as e:
            raise PlatformError(str(e)) from None
        env = airflow_env(home, dags, api_port)
        env["AIRFLOW_CONN_NATS_DEFAULT"] = nats_connection_json(nats)
        env["ISBFLOW_HOME"] = str(data_dir)
        progress("migrating the Airflow metadata database")
        _run_migrate(env, home)
        for name, args in COMPONENTS.items():
            progress(f"starting airflow {name}")
            log = home / "logs" / "platform" / f"{name}.log"
            with open(log, "ab") as logf:
                p = subprocess.Popen(
                    [airflow_bin(), *(a.format(port=api_port) for a in args)], env=env, cwd=repo_root(),
                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                )
            state.processes.append(ProcessState(name, p.pid, str(log)))
            _write_state(state)
        wait_healthy(state, progress, timeout)
    except BaseException:
        stop(data_dir)
        raise
    return state


def _run_migrate(env: dict[str, str], home: Path) -> None:
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
        raise PlatformError(f"'airflow db migrate' failed (exit {rc}); see {log}:\n{_tail(log)}")


def _tail(path: Path | str, chars: int = 1500) -> str:
    try:
        return Path(path).read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def health(api_port: int) -> dict | None:
    """``/api/v2/monitor/health`` as a dict, or None when the api-server does not answer yet."""
    try:
        with urllib.request.urlopen(f"http://{HOST}:{api_port}/api/v2/monitor/health", timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None


def is_healthy(h: dict | None) -> bool:
    return h is not None and all((h.get(part) or {}).get("status") == "healthy" for part in HEALTH_PARTS)


def dead_process(state: PlatformState) -> ProcessState | None:
    return next((p for p in state.processes if not p.alive()), None)


def wait_healthy(state: PlatformState, progress: Progress = lambda _m: None, timeout: float = 180.0) -> None:
    """Wait until every Airflow part reports healthy; a process that dies fails at once with its log."""
    deadline = time.monotonic() + timeout
    while True:
        dead = dead_process(state)
        if dead is not None:
            raise PlatformError(f"airflow {dead.name} exited during start; log {dead.log}:\n{_tail(dead.log)}")
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


def api_token(state: PlatformState, password: str) -> str:
    """A JWT for ``Authorization: Bearer`` on ``/api/v2`` (``POST /auth/token``)."""
    body = json.dumps({"username": ADMIN, "password": password}).encode()
    req = urllib.request.Request(f"{state.url}/auth/token", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["access_token"]


def wait_for_dag(state: PlatformState, password: str, dag_id: str, timeout: float = 60.0) -> bool:
    """True once the dag-processor has registered ``dag_id`` (seen through the REST API as ``admin``)."""
    try:
        token = api_token(state, password)
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        req = urllib.request.Request(f"{state.url}/api/v2/dags/{dag_id}",
                                     headers={"Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1.0)
    return False


def stop(data_dir: Path, grace: float = 20.0) -> PlatformState | None:
    """Stop every recorded Airflow process group (all at once), then the NATS the platform started.

    Keeps all state on disk. Returns the stopped state, or None when nothing is recorded.
    """
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    if state is None:
        return None
    _stop_groups(state.processes, grace)
    if state.nats_started:
        stopped = nats_server.stop_embedded(data_dir)
        for node in stopped.nodes if stopped else []:
            try:  # started by this process: reap it rather than leave a zombie until we exit
                os.waitpid(node.pid, os.WNOHANG)
            except ChildProcessError:
                pass
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return state


def status(data_dir: Path) -> dict:
    """Liveness, memory and health of the recorded platform (``running`` false when none)."""
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    nats = nats_server.read_state(data_dir)
    out: dict = {"data_dir": str(data_dir), "running": False, "processes": [], "health": None,
                 "nats": nats.to_json(with_secrets=False) if nats else None}
    if state is None:
        return out
    out.update(state.to_json())
    out["health"] = health(state.api_port)
    out["running"] = all(p["alive"] for p in out["processes"]) and is_healthy(out["health"])
    if nats:
        out["nats"]["pss_mb"] = [round(group_memory(n.pid) / 2**20, 1) for n in nats.nodes]
    out["airflow_pss_mb"] = round(sum(p["pss_mb"] for p in out["processes"]), 1)
    return out
