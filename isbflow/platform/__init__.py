"""The local platform (``make run``): the embedded ISB service, Airflow 3 and a running demo, on 127.0.0.1 only.

:func:`up` brings up, under one data dir (``ISBFLOW_HOME``, default ``./.isbflow``):

1. the embedded nats-server (:func:`isbflow.isb.server.start_embedded`; client
   port 4222 when free), reused when one already runs there;
2. with :class:`PipelineOptions`, the pipeline (the demo ``pipelines/logs.yaml``):
   its buffers provisioned, its reference tables put from
   ``<spec dir>/reference/<name>.json``, every step's desired state set to
   ``running`` and its steps launched as one detached Spark driver through
   :func:`isbflow.steps.launch.launch` (the code the ``pipeline_start`` DAG uses:
   same launch record, so that DAG finds this launch and does not start a second
   one), and a producer (``isbflow produce --rate R``, detached) feeding its
   source, continuing at the source stream's last sequence. Then it waits until
   every step has processed a micro-batch, restarting a driver whose step failed
   while starting. All this before Airflow: both starting at once on a small
   machine starves Spark's Python workers, which must connect back within 10 s;
3. Airflow with ``AIRFLOW_HOME=<data dir>/airflow``: ``airflow db migrate``, then
   ``api-server``, ``scheduler``, ``dag-processor`` and ``triggerer`` as separate
   processes. Not ``airflow standalone``: it opens log servers on 0.0.0.0.
   LocalExecutor with ``[core] parallelism`` 4, DAGs from the repository's
   ``dags/``, plugins from its ``plugins/``, no examples, DAGs unpaused at creation
   (the quality DAGs are unpaused again at every start), SimpleAuthManager with
   one ``admin`` user whose password Airflow generates once into
   ``$AIRFLOW_HOME/simple_auth_manager_passwords.json.generated``; the
   ``nats_default`` connection points at the embedded server.

A second :func:`up` while the platform runs reuses it: the live launch and the
live producer are found (never a second driver or producer on the same data).

Each process the platform starts leads its own process group and carries
``ISBFLOW_PLATFORM=<id of this start>`` in its environment, which every process
it starts inherits (task runners, drivers launched by the ``pipeline_start`` DAG,
Spark's JVM). The PIDs are recorded in ``<data dir>/platform.json``; drivers are
recorded by the launcher in ``<data dir>/launches/``. :func:`stop` stops the
producer, **drains** every live launch (the drain protocol, upstream first; a
driver that does not finish in time is stopped by PID), ends every Airflow
process group (SIGTERM, then SIGKILL after a grace period), then any process
still carrying this start's id, and last the nats-server if the platform started
it. State on disk (metadata DB, password, buffers, checkpoints, sinks) is kept,
so the next start reuses it. :func:`status` reports liveness, memory, health,
the pipeline's steps and the producer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isbflow.isb import server as nats_server
from isbflow.isb.connect import NatsSettings
from isbflow.isb.server import pid_alive
from isbflow.steps import launch as launcher

if TYPE_CHECKING:
    from isbflow.spec import Specs
    from isbflow.spec.models import JetStreamSettings, Pipeline

HOST = "127.0.0.1"
STATE_FILE = "platform.json"
DEFAULT_API_PORT = 8080
DEFAULT_NATS_PORT = 4222
ADMIN = "admin"
#: the environment variable marking every process of one platform start (value: the start's id)
MARKER_ENV = "ISBFLOW_PLATFORM"
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
#: 100 events/s: the demo's events are 10 ms of event time apart, so event time keeps pace
#: with the clock (the producer starts at "now": freshness checks see live data)
DEFAULT_RATE = 100.0
DEFAULT_PRODUCER_COUNT = 10_000_000  # 28 hours at 100 events/s
PRODUCER_SEED = 0


class PlatformError(Exception):
    """The platform could not start, be found or be stopped; the message says why and what to do."""


@dataclass
class ProcessState:
    name: str
    pid: int
    log: str
    proc_start: int | None = None  # kernel start time (a reused PID does not count as ours)

    def alive(self) -> bool:
        return launcher.process_alive(self.pid, self.proc_start)


@dataclass
class PipelineOptions:
    """What runs on the platform besides NATS and Airflow: one pipeline and a producer feeding it."""

    spec: str  # the spec file (absolute)
    rate: float = DEFAULT_RATE  # producer events/s; 0 = no producer
    count: int = DEFAULT_PRODUCER_COUNT  # events the producer publishes before it ends
    master: str = "local[2]"
    wait: float = 240.0  # seconds to wait for every step to run (0: do not wait)
    restarts: int = 2  # driver restarts allowed while waiting (a step failed while starting)


@dataclass
class PlatformState:
    data_dir: str
    airflow_home: str
    api_port: int
    dags_folder: str
    supervisor_pid: int  # the foreground 'platform up' that stops everything on Ctrl-C; 0: none
    nats_started: bool
    processes: list[ProcessState] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    marker: str = ""
    pipeline: PipelineOptions | None = None
    producer: ProcessState | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    def supervised(self) -> bool:
        return self.supervisor_pid > 0 and self.supervisor_pid != os.getpid() and pid_alive(self.supervisor_pid)

    def to_json(self) -> dict:
        d = asdict(self)
        d["url"] = self.url
        for p, proc in zip(d["processes"], self.processes, strict=True):
            p["alive"] = proc.alive()
            p["pss_mb"] = round(group_memory(proc.pid) / 2**20, 1)
        return d


@dataclass
class PipelineReport:
    """What :func:`ensure_pipeline` found or started."""

    pipeline: str
    provisioned: str  # one line: streams/buckets per action
    references: dict[str, dict[str, int]]  # table -> counts written/unchanged/deleted/revision
    launch: launcher.LaunchRecord
    producer: ProcessState | None
    producer_reused: bool
    producer_start: int | None  # first event index of a newly started producer
    check: launcher.StateCheck | None = None  # the steps once waited for (:func:`wait_running`)
    restarts: int = 0  # driver restarts that waiting took


@dataclass
class StopReport:
    """What :func:`stop` did: the stopped state, each drained launch's outcome, leftovers killed."""

    state: PlatformState
    drained: dict[str, str] = field(default_factory=dict)  # launch key -> outcome
    leftovers: list[int] = field(default_factory=list)  # PIDs carrying the marker, killed last


# -- paths and environment ----------------------------------------------------------------------

def repo_root() -> Path:
    """The checkout holding ``isbflow/`` (the project is installed editable)."""
    import isbflow  # the package's own location, wherever this module sits in it

    return Path(isbflow.__file__).resolve().parents[1]


def demo_spec() -> Path:
    return repo_root() / "pipelines" / "logs.yaml"


def airflow_home(data_dir: Path) -> Path:
    return Path(data_dir).resolve() / "airflow"


def airflow_bin() -> str:
    cand = Path(sys.executable).parent / "airflow"
    if not cand.exists():
        raise PlatformError(f"airflow not found next to {sys.executable}: install the project ('uv sync')")
    return str(cand)


def isbflow_bin() -> str:
    cand = Path(sys.executable).parent / "isbflow"
    if not cand.exists():
        raise PlatformError(f"isbflow not found next to {sys.executable}: install the project ('uv sync')")
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
                base: dict[str, str] | None = None, plugins_folder: Path | None = None) -> dict[str, str]:
    """The environment every Airflow process of the platform (and the test fixture) runs with.

    Starts from ``base`` (default ``os.environ``) without its ``AIRFLOW*`` variables, so an
    outer Airflow setup cannot leak in. Plugins come from ``plugins_folder`` (default: the
    repository's ``plugins/``).
    """
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("AIRFLOW")}
    venv_bin = str(Path(sys.executable).parent)
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

def _proc_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``."""
    out = []
    for pid in _proc_pids():
        fields = _stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(pid)
    return out


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ... (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def marked_processes(marker: str) -> list[int]:
    """PIDs of the live processes whose environment carries ``ISBFLOW_PLATFORM=<marker>`` (not this one).

    Processes that rewrite their title (Airflow's api-server, executors and task runners use
    setproctitle, which overwrites the environment block) are not found this way:
    :func:`platform_processes` finds them by session.
    """
    if not marker:
        return []
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for pid in _proc_pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and launcher.process_alive(pid):
            out.append(pid)
    return out


def platform_processes(state: PlatformState) -> list[int]:
    """Every live process of the platform except nats-server: the sessions its processes lead.

    Each process the platform starts (Airflow components, producer, drivers) leads its own
    session, and what they start stays in it (task runners only change process group), except
    drivers launched detached by a DAG, which carry the start's marker: their sessions count too.
    """
    roots = {p.pid for p in state.processes}
    if state.producer is not None:
        roots.add(state.producer.pid)
    roots |= {r.pid for r in live_launches(Path(state.data_dir))}
    marked = set(marked_processes(state.marker))
    for pid in marked:
        f = _stat_fields(pid)
        if f is not None:
            roots.add(int(f[3]))
    out = []
    for pid in _proc_pids():
        f = _stat_fields(pid)
        if f is None or f[0] == "Z" or pid == os.getpid():
            continue
        if int(f[3]) in roots or pid in marked:
            out.append(pid)
    return sorted(out)


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


def _reap(pid: int) -> None:
    """Collect our own exited child, or it lingers as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


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
                _reap(proc.pid)
            live = [p for p in live if _group_alive(p.pid)]
            time.sleep(0.2)
        if not live:
            return


def _kill_pids(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM each PID (its whole group when it leads one), then SIGKILL what is left after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid and pid != os.getpgid(0):
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for pid in pids:
                _reap(pid)
            pids = [p for p in pids if launcher.process_alive(p)]
            if not pids:
                return
            time.sleep(0.2)


def read_state(data_dir: Path) -> PlatformState | None:
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    d.pop("url", None)
    procs = [ProcessState(**{k: v for k, v in p.items() if k in ProcessState.__dataclass_fields__})
             for p in d.pop("processes")]
    producer = d.pop("producer", None)
    pipeline = d.pop("pipeline", None)
    known = {k: v for k, v in d.items() if k in PlatformState.__dataclass_fields__}
    return PlatformState(**known, processes=procs,
                         producer=ProcessState(**producer) if producer else None,
                         pipeline=PipelineOptions(**pipeline) if pipeline else None)


def _write_state(state: PlatformState) -> None:
    path = Path(state.data_dir) / STATE_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def adopt(state: PlatformState, pid: int | None = None) -> None:
    """Make ``pid`` (default: this process) the platform's supervisor, the one that stops it on Ctrl-C."""
    state.supervisor_pid = os.getpid() if pid is None else pid
    _write_state(state)


def running(data_dir: Path) -> PlatformState | None:
    """The recorded platform when any of its processes (or its supervisor) is still alive."""
    state = read_state(data_dir)
    if state is None:
        return None
    if state.supervised() or any(p.alive() for p in state.processes):
        return state
    return None


# -- lifecycle ----------------------------------------------------------------------------------------

Progress = Callable[[str], None]


def _quiet(_m: str) -> None:
    pass


def up(data_dir: Path, api_port: int = DEFAULT_API_PORT, nats_port: int = DEFAULT_NATS_PORT,
       dags_folder: Path | None = None, server_settings: JetStreamSettings | None = None,
       pipeline: PipelineOptions | None = None, progress: Progress = _quiet, timeout: float = 180.0,
       supervisor_pid: int | None = None) -> tuple[PlatformState, PipelineReport | None, bool]:
    """Start the platform, or reuse the one running under ``data_dir``.

    Returns ``(state, pipeline report, reused)``. A running platform is reused when all its
    Airflow processes live and Airflow reports healthy; its pipeline and producer are then
    checked (:func:`ensure_pipeline`: a live launch or producer is found, not doubled). A
    platform only partly alive raises :class:`PlatformError` (stop it first).
    """
    data_dir = Path(data_dir).resolve()
    existing = running(data_dir)
    if existing is None:
        state, report = _start(data_dir, api_port, nats_port, dags_folder, server_settings, progress, timeout,
                               pipeline, supervisor_pid)
        return state, report, False
    dead = dead_process(existing)
    nats = nats_server.read_state(data_dir)
    if dead is not None or nats is None or not all(nats.alive()):
        what = f"airflow {dead.name} (pid {dead.pid}) has exited" if dead else "its nats-server is not running"
        raise PlatformError(f"the platform under {data_dir}/ is only partly running ({what}): "
                            "stop it with 'isbflow platform down', then start it again")
    progress("the platform already runs: checking its pipeline and producer")
    opts = pipeline or existing.pipeline
    report = _run_pipeline(existing, opts, progress) if opts else None
    return existing, report, True


def _run_pipeline(state: PlatformState, opts: PipelineOptions, progress: Progress) -> PipelineReport:
    """:func:`ensure_pipeline`, then wait until its steps run (restarting a driver that failed)."""
    report = ensure_pipeline(state, opts, progress)
    if opts.wait > 0:
        report.check, report.restarts = wait_running(state, opts.wait, opts.restarts, progress)
        if report.restarts:
            report.launch = launcher.read_launch(state.data_dir, report.pipeline) or report.launch
    return report


def start(data_dir: Path, api_port: int = DEFAULT_API_PORT, nats_port: int = DEFAULT_NATS_PORT,
          dags_folder: Path | None = None, server_settings: JetStreamSettings | None = None,
          progress: Progress = _quiet, timeout: float = 180.0, pipeline: PipelineOptions | None = None,
          supervisor_pid: int | None = None) -> PlatformState:
    """Start NATS, the pipeline (when given) and Airflow (module docstring); wait until Airflow is healthy.

    ``server_settings`` (an ISB service's ``jetstream.settings``: max_payload and the
    memory and file store limits) configure a newly started nats-server.
    ``supervisor_pid`` is the process that stops the platform on Ctrl-C (default: this
    one; 0: none, e.g. a test fixture that calls :func:`stop` itself).

    On any failure everything started so far is stopped before the error propagates.
    Raises :class:`PlatformError` when a platform already runs under ``data_dir`` or the
    API port is taken.
    """
    return _start(data_dir, api_port, nats_port, dags_folder, server_settings, progress, timeout, pipeline,
                  supervisor_pid)[0]


def _start(data_dir: Path, api_port: int, nats_port: int, dags_folder: Path | None,
           server_settings: JetStreamSettings | None, progress: Progress, timeout: float,
           pipeline: PipelineOptions | None, supervisor_pid: int | None) -> tuple[PlatformState, PipelineReport | None]:
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
    home.chmod(0o700)  # airflow.cfg's generated keys, the admin password, the metadata DB: owner only

    before = nats_server.read_state(data_dir)
    nats_was_up = before is not None and all(before.alive())
    sup = os.getpid() if supervisor_pid is None else supervisor_pid
    state = PlatformState(str(data_dir), str(home), api_port, str(dags), sup, not nats_was_up,
                          marker=uuid.uuid4().hex[:16], pipeline=pipeline)
    _write_state(state)
    report = None
    try:
        progress("starting the ISB service (nats-server)")
        try:
            limits = server_settings.model_dump() if server_settings is not None else {}
            nats = nats_server.start_embedded(data_dir, client_port=nats_port if port_free(nats_port) else None,
                                              **limits)
        except nats_server.EmbeddedNatsError as e:
            raise PlatformError(str(e)) from None
        if pipeline is not None:  # before Airflow: both starting at once starves Spark's Python workers
            report = _run_pipeline(state, pipeline, progress)
        env = airflow_env(home, dags, api_port)
        env["AIRFLOW_CONN_NATS_DEFAULT"] = nats_connection_json(nats)
        env["ISBFLOW_HOME"] = str(data_dir)
        env[MARKER_ENV] = state.marker
        progress("migrating the Airflow metadata database")
        _run_migrate(env, home)
        for name, args in COMPONENTS.items():
            progress(f"starting airflow {name}")
            log = home / "logs" / "platform" / f"{name}.log"
            with open(log, "ab") as logf:
                p = subprocess.Popen(
                    [airflow_bin(), *(a.format(port=api_port) for a in args)], env=env, cwd=repo_root(),
                    stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                    umask=0o077,  # files Airflow writes (the generated admin password) are owner-only
                )
            state.processes.append(ProcessState(name, p.pid, str(log), launcher.process_start(p.pid)))
            _write_state(state)
        wait_healthy(state, progress, timeout)
        password = admin_password(home)
        if password:
            unpause(state, password, SCHEDULED_DAGS, progress)
    except BaseException:
        stop(data_dir)
        raise
    return state, report


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


# -- the pipeline and its producer --------------------------------------------------------------------

def _load_pipeline(spec: str | Path) -> tuple[Specs, Pipeline]:
    from isbflow.spec import SpecError, load_specs

    try:
        specs = load_specs([Path(spec)])
        return specs, specs.only_pipeline()
    except SpecError as e:
        raise PlatformError(str(e)) from None


def ensure_pipeline(state: PlatformState, opts: PipelineOptions, progress: Progress = _quiet) -> PipelineReport:
    """Provision the pipeline, put its reference tables, launch its steps and start its producer.

    Idempotent, like the ``pipeline_start`` DAG: a live launch of the pipeline is reused
    (:func:`isbflow.steps.launch.launch` with the steps' heartbeats), a live producer
    recorded in ``state`` is kept. Raises :class:`PlatformError` naming what failed.
    """
    from isbflow.isb import provision
    from isbflow.isb.connect import IsbUnreachable, connect
    from isbflow.steps.drain import resume_pipeline

    dd = Path(state.data_dir)
    specs, p = _load_pipeline(opts.spec)
    settings = nats_settings(dd)
    try:
        progress(f"provisioning the buffers of pipeline {p.name}")
        report = asyncio.run(provision.apply(settings, specs, p.name))
        refused = [r.name for r in report.resources if r.action == provision.Action.REFUSED]
        if refused:
            raise PlatformError(f"pipeline {p.name}: recreate refused for buffer(s) still holding messages: "
                                f"{', '.join(refused)}")
        counts: dict[str, int] = {}
        for r in report.resources:
            counts[r.action.value] = counts.get(r.action.value, 0) + 1
        provisioned = f"{len(report.resources)} streams/buckets (" + \
            ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) + ")"
        progress(f"loading the reference tables of pipeline {p.name}")
        references = put_references(settings, p, Path(opts.spec).parent / "reference")

        async def resume() -> None:
            nc = await connect(settings, name="isbflow-platform")
            try:
                await resume_pipeline(nc, p)
            finally:
                await nc.close()

        asyncio.run(resume())
        progress(f"launching the steps of pipeline {p.name}")
        record = launch_steps(dd, opts, p, settings, state.marker)
    except (IsbUnreachable, provision.ProvisionError, launcher.LaunchError) as e:
        raise PlatformError(f"pipeline {p.name}: {e}") from None
    producer, reused, first = state.producer, True, None
    if opts.rate > 0 and (producer is None or not producer.alive()):
        first = asyncio.run(source_last_seq(settings, p))
        producer, reused = start_producer(dd, opts, p, settings, state.marker, first), False
    state.pipeline, state.producer = opts, producer
    _write_state(state)
    return PipelineReport(p.name, provisioned, references, record, producer, reused, first)


def put_references(settings: NatsSettings, p: Pipeline, folder: Path) -> dict[str, dict[str, int]]:
    """Put each reference table a step of ``p`` joins from ``<folder>/<name>.json`` (key -> columns).

    Unchanged rows are skipped (re-running writes nothing). A table without a file is left as
    its bucket holds it. Raises :class:`PlatformError` for a file that is not a JSON object.
    """
    from isbflow.isb import reference

    out = {}
    for name in sorted({r.name for v in p.spec.vertices if v.udf for r in v.udf.references}):
        file = folder / f"{name}.json"
        if not file.is_file():
            continue
        try:
            rows = json.loads(file.read_text())
        except ValueError as e:
            raise PlatformError(f"reference table {file}: not valid JSON ({e})") from None
        if not isinstance(rows, dict):
            raise PlatformError(f"reference table {file}: expected an object key -> columns")
        try:
            out[name] = asyncio.run(reference.put(settings, p.name, name, rows))
        except reference.ReferenceError as e:
            raise PlatformError(f"reference table {file}: {e}") from None
    return out


def launch_steps(data_dir: Path, opts: PipelineOptions, p: Pipeline, settings: NatsSettings,
                 marker: str) -> launcher.LaunchRecord:
    """Launch every step of ``p`` in one detached driver, or find its live launch.

    :func:`isbflow.steps.launch.launch_pipeline` with the platform's marker in the driver's
    environment (so :func:`stop` finds the JVM and Python workers it starts).
    """
    key = launcher.launch_key(p.name, None)
    existing = launcher.read_launch(data_dir, key)
    statuses = None
    if existing is not None and existing.alive() is not False:
        statuses = asyncio.run(launcher.read_statuses(settings, p.name, p.topological_order()))
    command = launcher.driver_command(opts.spec, data_dir=data_dir, trigger="continuous", master=opts.master,
                                      pipeline=p.name)
    env = launcher.driver_env(settings, data_dir, repo_root(), base={**os.environ, MARKER_ENV: marker})
    return launcher.launch(key, p.name, command, data_dir=data_dir, env=env, spec=Path(opts.spec).absolute(),
                           master=opts.master, workdir=repo_root(), statuses=statuses)


async def source_last_seq(settings: NatsSettings, p: Pipeline) -> int:
    """The last sequence of the pipeline's JetStream source stream (0 when empty or missing):
    where a restarted producer continues, so event ids never repeat."""
    from nats.js.errors import NotFoundError

    from isbflow.isb import naming
    from isbflow.isb.connect import connect
    from isbflow.ops.produce import source_vertex

    nc = await connect(settings, name="isbflow-platform")
    try:
        try:
            info = await nc.jetstream().stream_info(naming.source_stream(p, source_vertex(p)))
        except NotFoundError:
            return 0
        return int(info.state.last_seq)
    finally:
        await nc.close()


def start_producer(data_dir: Path, opts: PipelineOptions, p: Pipeline, settings: NatsSettings, marker: str,
                   first: int) -> ProcessState:
    """Start ``isbflow produce --rate R`` detached (own session), events ``first ..``; log under ``logs/``."""
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"producer-{uuid.uuid4().hex[:8]}.log"
    cmd = [isbflow_bin(), "produce", "-f", str(Path(opts.spec).absolute()), "--pipeline", p.name,
           "--count", str(opts.count), "--rate", f"{opts.rate:g}", "--start", str(first),
           "--seed", str(PRODUCER_SEED), "--event-time-from", "now", "--data-dir", str(data_dir), "--json"]
    env = launcher.driver_env(settings, data_dir, base={**os.environ, MARKER_ENV: marker})
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=repo_root(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return ProcessState("producer", proc.pid, str(log), launcher.process_start(proc.pid))


def wait_pipeline(state: PlatformState, target: str = "running", timeout: float = 240.0,
                  progress: Progress = _quiet, processed: bool = False) -> launcher.StateCheck:
    """Wait until every step of the platform's pipeline reports ``target`` (heartbeats of its live launch).

    With ``processed``, a step counts only once it has also finished a micro-batch (a step
    reports ``running`` before its first batch, when its Python workers may still fail to
    start). Returns the last :class:`~isbflow.steps.launch.StateCheck` (``done`` false after
    ``timeout`` or when a step failed or the driver died: ``problem`` says which).
    """
    from isbflow.isb.connect import connect
    from isbflow.isb.state import all_status

    if state.pipeline is None:
        raise PlatformError("the platform runs no pipeline")
    _specs, p = _load_pipeline(state.pipeline.spec)
    settings = nats_settings(Path(state.data_dir))
    order = p.topological_order()

    async def go() -> launcher.StateCheck:
        nc = await connect(settings, name="isbflow-platform")
        try:
            deadline = time.monotonic() + timeout
            while True:
                record = launcher.read_launch(state.data_dir, p.name)
                alive = record.alive() if record is not None else None
                statuses = await all_status(nc, p.name, order)
                check = launcher.judge_state(statuses, target, record, alive)
                if processed and check.done:
                    idle = [v for v, st in statuses.items() if st is None or st.batch_id < 0]
                    check = launcher.StateCheck(not idle, None, {
                        v: f"{s} (no batch yet)" if v in idle else s for v, s in check.steps.items()})
                if check.done or check.problem or time.monotonic() > deadline:
                    return check
                progress(f"waiting for the steps of {p.name}: " + ", ".join(
                    f"{v} {s}" for v, s in check.steps.items()))
                await asyncio.sleep(1.0)
        finally:
            await nc.close()

    return asyncio.run(go())


def restart_pipeline(state: PlatformState, progress: Progress = _quiet) -> PipelineReport:
    """Stop the platform pipeline's driver by PID (a step failed, or it hangs) and launch it again;
    its steps resume from their checkpoints."""
    if state.pipeline is None:
        raise PlatformError("the platform runs no pipeline")
    _specs, p = _load_pipeline(state.pipeline.spec)
    progress(f"restarting the driver of pipeline {p.name}")
    launcher.stop_launch(state.data_dir, p.name, grace=20.0)
    return ensure_pipeline(state, state.pipeline, progress)


def wait_running(state: PlatformState, timeout: float = 240.0, restarts: int = 2,
                 progress: Progress = _quiet) -> tuple[launcher.StateCheck, int]:
    """Wait until every step runs and has processed a micro-batch; a driver that failed or died
    meanwhile is restarted (at most ``restarts`` times). Returns the last check and how many
    restarts it took."""
    done = 0
    while True:
        check = wait_pipeline(state, "running", timeout, progress, processed=True)
        if check.done or check.problem is None or done >= restarts:
            return check, done
        progress(f"restarting the pipeline: {check.problem.splitlines()[0]}")
        restart_pipeline(state, progress)
        done += 1


# -- Airflow ----------------------------------------------------------------------------------------------

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


def wait_healthy(state: PlatformState, progress: Progress = _quiet, timeout: float = 180.0) -> None:
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
            progress: Progress = _quiet, timeout: float = 30.0) -> dict[str, str]:
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


# -- stopping ------------------------------------------------------------------------------------------

def live_launches(data_dir: Path) -> list[launcher.LaunchRecord]:
    """Every recorded launch under ``data_dir`` whose driver still runs on this host."""
    out = []
    for path in sorted(launcher.launches_dir(data_dir).glob("*.json")):
        try:
            record = launcher.read_launch(data_dir, path.stem)
        except launcher.LaunchError:
            continue
        if record is not None and record.alive() is True:
            out.append(record)
    return out


def drain_launches(data_dir: Path, timeout: float = 180.0, progress: Progress = _quiet) -> dict[str, str]:
    """Drain every live launch (drain protocol, upstream first) and wait for its driver to exit.

    A pipeline that does not drain within ``timeout`` (or whose ISB service is gone) has its
    driver stopped by PID instead. Returns launch key -> outcome.
    """
    from isbflow.isb.connect import IsbUnreachable, connect
    from isbflow.steps.drain import DrainTimeout, drain_pipeline

    out: dict[str, str] = {}
    records = live_launches(data_dir)
    drained: dict[str, str] = {}  # pipeline -> outcome (one drain per pipeline, however many launches)
    for record in records:
        if record.pipeline in drained:
            continue
        progress(f"draining pipeline {record.pipeline}")
        try:
            specs, p = _load_pipeline(record.spec)
            p = specs.pipelines.get(record.pipeline, p)
            settings = nats_settings(data_dir)

            async def go(settings: NatsSettings = settings, p: Pipeline = p) -> None:
                nc = await connect(settings, name="isbflow-platform-drain")
                try:
                    await drain_pipeline(nc, p, timeout=timeout)
                finally:
                    await nc.close()

            asyncio.run(go())
            drained[record.pipeline] = "drained"
        except (PlatformError, IsbUnreachable, DrainTimeout) as e:
            drained[record.pipeline] = f"not drained ({e})"
    for record in records:
        outcome = drained[record.pipeline]
        if launcher.wait_exit(record, 60.0 if outcome == "drained" else 0.0):
            out[record.key] = outcome
        else:
            progress(f"stopping the driver of {record.key} (pid {record.pid})")
            launcher.stop_process(record.pid, record.proc_start, grace=20.0)
            out[record.key] = f"{outcome}; driver stopped by pid"
    return out


def stop(data_dir: Path, grace: float = 20.0, drain_timeout: float = 180.0,
         progress: Progress = _quiet) -> StopReport | None:
    """Stop the platform: the producer, then drain the pipelines, then Airflow, leftovers, NATS.

    Keeps all state on disk. Returns what was done, or None when nothing is recorded.
    """
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    if state is None:
        return None
    report = StopReport(state)
    if state.producer is not None and state.producer.alive():
        progress(f"stopping the producer (pid {state.producer.pid})")
        _stop_groups([state.producer], 5.0)
    report.drained = drain_launches(data_dir, drain_timeout, progress)
    progress("stopping Airflow")
    _stop_groups(state.processes, grace)
    leftovers = platform_processes(state)
    if leftovers:
        progress(f"stopping {len(leftovers)} leftover process(es) of this platform")
        _kill_pids(leftovers)
        report.leftovers = leftovers
    if state.nats_started:
        progress("stopping nats-server")
        stopped = nats_server.stop_embedded(data_dir)
        for node in stopped.nodes if stopped else []:
            _reap(node.pid)  # started by this process: reap it rather than leave a zombie until we exit
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return report


# -- status ----------------------------------------------------------------------------------------------

def pipeline_status(state: PlatformState) -> dict | None:
    """The platform pipeline's launch, each step's heartbeat and its source stream's size (None: no pipeline)."""
    from isbflow.isb import naming
    from isbflow.isb.connect import connect
    from isbflow.isb.state import all_status
    from isbflow.ops.produce import source_vertex

    if state.pipeline is None:
        return None
    try:
        _specs, p = _load_pipeline(state.pipeline.spec)
    except PlatformError as e:
        return {"spec": state.pipeline.spec, "error": str(e)}
    dd = Path(state.data_dir)
    record = launcher.read_launch(dd, p.name)
    out: dict[str, Any] = {"name": p.name, "spec": state.pipeline.spec, "steps": {}, "source_messages": None,
                           "launch": None}
    if record is not None:
        out["launch"] = {"launch_id": record.launch_id, "pid": record.pid, "alive": record.alive(),
                         "log": record.log, "started_at": record.started_at}

    async def go() -> None:
        nc = await connect(nats_settings(dd), name="isbflow-platform-status", timeout=3.0, reconnect_attempts=0)
        try:
            statuses = await all_status(nc, p.name, p.topological_order())
            now = time.time()
            out["steps"] = {v: None if s is None else {
                "state": s.state, "batch_id": s.batch_id, "input_rows_per_s": s.input_rows_per_s,
                "processed_rows_per_s": s.processed_rows_per_s, "rows_total": s.rows_total,
                "lag": sum(s.lag.values()) if s.lag else 0, "heartbeat_age_s": round(s.age(now), 1),
                "pid": s.pid} for v, s in statuses.items()}
            info = await nc.jetstream().stream_info(naming.source_stream(p, source_vertex(p)))
            out["source_messages"] = int(info.state.messages)
        finally:
            await nc.close()

    try:
        asyncio.run(go())
    except Exception as e:  # noqa: BLE001 - status reports what it cannot read instead of crashing
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def status(data_dir: Path) -> dict:
    """Liveness, memory and health of the recorded platform (``running`` false when none), its
    pipeline's steps and its producer."""
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    nats = nats_server.read_state(data_dir)
    out: dict = {"data_dir": str(data_dir), "running": False, "processes": [], "health": None,
                 "nats": nats.to_json(with_secrets=False) if nats else None, "pipeline": None, "producer": None}
    if state is None:
        return out
    out.update(state.to_json())
    out["health"] = health(state.api_port)
    out["running"] = all(p["alive"] for p in out["processes"]) and is_healthy(out["health"])
    out["supervised"] = state.supervised()
    if nats:
        out["nats"]["pss_mb"] = [round(group_memory(n.pid) / 2**20, 1) for n in nats.nodes]
    out["airflow_pss_mb"] = round(sum(p["pss_mb"] for p in out["processes"]), 1)
    if state.producer is not None:
        out["producer"] = {**asdict(state.producer), "alive": state.producer.alive(),
                           "rate": state.pipeline.rate if state.pipeline else None}
    if nats and all(nats.alive()):
        out["pipeline"] = pipeline_status(state)
    return out
