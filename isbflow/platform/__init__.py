"""The local platform (``make run``): the embedded ISB service, Airflow 3 and a running demo, on 127.0.0.1 only.

:func:`up` brings up, under one data dir (``ISBFLOW_HOME``, default ``./.isbflow``):

1. the embedded nats-server (:func:`isbflow.ops.nats.start_embedded`; client port 4222
   when free), reused when one already runs there;
2. with :class:`PipelineOptions`, the pipeline (the demo ``pipelines/logs.yaml``) and a
   producer feeding it (:mod:`isbflow.platform.pipeline`: the ``pipeline_start`` DAG's own
   verb, :func:`isbflow.ops.pipeline.start`); a pipeline whose spec's ISB service is
   ``redis.native`` (``pipelines/logs-redis.yaml``) keeps its buffers in that redis-server,
   started first (a live one reused). The nats-server runs either way: Airflow's connections
   and every other pipeline's DAGs use it. Then it waits until every step has processed a
   micro-batch, restarting a driver whose step failed while starting. All this before
   Airflow: both starting at once on a small machine starves Spark's Python workers, which
   must connect back within 10 s;
3. Airflow with ``AIRFLOW_HOME=<data dir>/airflow`` (:mod:`isbflow.platform.airflow`):
   ``airflow db migrate``, then its four components as separate processes; the
   ``nats_default`` connection points at the embedded server; the quality DAGs are
   unpaused again at every start.

A second :func:`up` while the platform runs reuses it: the live launch and the
live producer are found (never a second driver or producer on the same data).

Each process the platform starts leads its own process group and carries
``ISBFLOW_PLATFORM=<id of this start>`` in its environment, which every process
it starts inherits (task runners, drivers launched by the ``pipeline_start`` DAG,
Spark's JVM). Their PIDs and kernel start times are recorded in
``<data dir>/platform.json`` (:mod:`isbflow.platform.state`); drivers are recorded by
the launcher in ``<data dir>/launches/``. :func:`stop` stops the producer, **drains**
every live launch (the drain protocol, upstream first; a driver that does not finish in
time is stopped by PID), ends every Airflow process group (SIGTERM, then SIGKILL after a
grace period), then any process still carrying this start's id, and last the nats-server
and the redis-server, each by its recorded PID and only if the platform started it. A
recorded PID whose process has a different start time than recorded (the kernel reused it)
is never signalled (:mod:`isbflow.platform.procs`).
State on disk (metadata DB, password, buffers, checkpoints, sinks) is kept, so the next
start reuses it. :func:`status` reports liveness, memory, health, the pipeline's steps
and the producer.

Modules: :mod:`~isbflow.platform.state` (the record on disk), :mod:`~isbflow.platform.procs`
(process groups, marked processes, memory, stopping), :mod:`~isbflow.platform.airflow`
(environment, migration, components, health, REST client), :mod:`~isbflow.platform.pipeline`
(the pipeline and its producer), :mod:`~isbflow.platform.standalone` (a Spark standalone
cluster for tests and benchmarks); this one starts, stops and reports on the whole.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from isbflow.ops import nats as nats_server
from isbflow.ops.connection import READER
from isbflow.ops.nats import port_free
from isbflow.ops.processes import process_alive as pid_alive
from isbflow.ops.processes import process_start
from isbflow.platform.airflow import (
    ADMIN,
    COMPONENTS,
    DEFAULT_API_PORT,
    HEALTH_PARTS,
    PASSWORD_FILE,
    SCHEDULED_DAGS,
    admin_password,
    airflow_bin,
    airflow_env,
    airflow_home,
    api,
    api_token,
    dead_process,
    health,
    is_healthy,
    migrate,
    nats_connection_json,
    start_components,
    unpause,
    wait_for_dag,
    wait_healthy,
)
from isbflow.platform.pipeline import (
    PRODUCER_SEED,
    PipelineReport,
    demo_spec,
    drain_launches,
    ensure_pipeline,
    isbflow_bin,
    live_launches,
    nats_settings,
    pipeline_settings,
    pipeline_status,
    restart_pipeline,
    run_pipeline,
    start_producer,
    wait_pipeline,
    wait_running,
)
from isbflow.platform.procs import (
    MARKER_ENV,
    group_members,
    group_memory,
    groups_cpu_percent,
    kill_pids,
    marked_processes,
    reap,
    reused,
    session_processes,
    stop_groups,
)
from isbflow.platform.state import (
    DEFAULT_PRODUCER_COUNT,
    DEFAULT_RATE,
    HOST,
    STATE_FILE,
    PipelineOptions,
    PlatformError,
    PlatformState,
    ProcessState,
    Progress,
    adopt,
    quiet,
    read_state,
    repo_root,
    running,
    write_state,
)

if TYPE_CHECKING:
    from isbflow.spec.models import JetStreamSettings

__all__ = [
    "ADMIN", "COMPONENTS", "DEFAULT_API_PORT", "DEFAULT_NATS_PORT", "DEFAULT_PRODUCER_COUNT", "DEFAULT_RATE",
    "HEALTH_PARTS", "HOST", "MARKER_ENV", "PASSWORD_FILE", "PRODUCER_SEED", "SCHEDULED_DAGS", "STATE_FILE", "PipelineOptions",
    "PipelineReport", "PlatformError", "PlatformState", "ProcessState", "Progress", "StopReport", "adopt",
    "admin_password", "airflow_bin", "airflow_env", "airflow_home", "api", "api_token", "dead_process",
    "demo_spec", "drain_launches", "ensure_pipeline", "group_members", "group_memory", "health", "is_healthy",
    "isbflow_bin", "live_launches", "marked_processes", "nats_connection_json", "nats_settings", "pid_alive",
    "pipeline_settings", "pipeline_status", "platform_processes", "port_free", "read_state", "repo_root",
    "restart_pipeline", "running", "start", "start_producer", "status", "stop", "unpause", "up", "wait_for_dag",
    "wait_healthy", "wait_pipeline", "wait_running", "write_state",
]

DEFAULT_NATS_PORT = 4222


@dataclass
class StopReport:
    """What :func:`stop` did: the stopped state, each drained launch's outcome, leftovers killed."""

    state: PlatformState
    drained: dict[str, str] = field(default_factory=dict)  # launch key -> outcome
    leftovers: list[int] = field(default_factory=list)  # PIDs carrying the marker, killed last


def platform_processes(state: PlatformState) -> list[int]:
    """Every live process of the platform except nats-server: the sessions its processes lead.

    Each process the platform starts (Airflow components, producer, drivers) leads its own
    session, and what they start stays in it (task runners only change process group), except
    drivers launched detached by a DAG, which carry the start's marker: their sessions count too.
    A recorded process whose PID the kernel has given to another process does not count.
    """
    recorded = [*state.processes, *([state.producer] if state.producer is not None else [])]
    roots = {p.pid for p in recorded if not reused(p.pid, p.proc_start)}
    roots |= {r.pid for r in live_launches(Path(state.data_dir))}
    return session_processes(roots, state.marker)


# -- lifecycle ----------------------------------------------------------------------------------------

def up(data_dir: Path, api_port: int = DEFAULT_API_PORT, nats_port: int = DEFAULT_NATS_PORT,
       dags_folder: Path | None = None, server_settings: JetStreamSettings | None = None,
       pipeline: PipelineOptions | None = None, progress: Progress = quiet, timeout: float = 180.0,
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
    report = run_pipeline(existing, opts, progress) if opts else None
    return existing, report, True


def start(data_dir: Path, api_port: int = DEFAULT_API_PORT, nats_port: int = DEFAULT_NATS_PORT,
          dags_folder: Path | None = None, server_settings: JetStreamSettings | None = None,
          progress: Progress = quiet, timeout: float = 180.0, pipeline: PipelineOptions | None = None,
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
                          marker=uuid.uuid4().hex[:16], pipeline=pipeline,
                          supervisor_start=process_start(sup) if sup > 0 else None)
    write_state(state)
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
            report = run_pipeline(state, pipeline, progress)
        env = airflow_env(home, dags, api_port)
        env["AIRFLOW_CONN_NATS_DEFAULT"] = nats_connection_json(nats)
        env["AIRFLOW_CONN_NATS_READER"] = nats_connection_json(nats, READER)  # the UI reads with it
        env["ISBFLOW_HOME"] = str(data_dir)
        env[MARKER_ENV] = state.marker
        progress("migrating the Airflow metadata database")
        migrate(env, home)
        start_components(state, env, progress)
        wait_healthy(state, progress, timeout)
        password = admin_password(home)
        if password:
            unpause(state, password, SCHEDULED_DAGS, progress)
    except BaseException:
        stop(data_dir)
        raise
    return state, report


def stop(data_dir: Path, grace: float = 20.0, drain_timeout: float = 180.0,
         progress: Progress = quiet) -> StopReport | None:
    """Stop the platform: the producer, then drain the pipelines, then Airflow, leftovers, NATS.

    Recorded processes are signalled only while their PID still names them (same start time).
    Keeps all state on disk. Returns what was done, or None when nothing is recorded.
    """
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    if state is None:
        return None
    report = StopReport(state)
    # the drivers' sessions, taken before they drain and exit: a Python worker or daemon of a driver
    # can outlive its JVM for a moment (seen after a Ctrl-C), and once the driver is gone its
    # session no longer counts among the platform's live processes
    drivers = [r.pid for r in live_launches(data_dir)]
    if state.producer is not None and state.producer.alive():
        progress(f"stopping the producer (pid {state.producer.pid})")
        stop_groups([state.producer], 5.0)
    report.drained = drain_launches(data_dir, drain_timeout, progress)
    progress("stopping Airflow")
    stop_groups(state.processes, grace)
    leftovers = sorted(set(platform_processes(state)) | set(session_processes(drivers, state.marker)))
    if leftovers:
        progress(f"stopping {len(leftovers)} leftover process(es) of this platform")
        kill_pids(leftovers)
        report.leftovers = leftovers
    if state.nats_started:
        progress("stopping nats-server")
        stopped = nats_server.stop_embedded(data_dir)
        for node in stopped.nodes if stopped else []:
            reap(node.pid)  # started by this process: reap it rather than leave a zombie until we exit
    if state.redis_started:
        _stop_redis(data_dir, progress)
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return report


def _stop_redis(data_dir: Path, progress: Progress) -> None:
    """Stop the redis-server this platform started, by its recorded PID; PlatformError when it will not."""
    # lazy: redis-py (~0.3 s) is loaded for a platform whose pipeline is on Redis only
    from isbflow.ops import redis_server

    progress("stopping redis-server")
    try:
        stopped = redis_server.stop_redis(data_dir)
    except redis_server.EmbeddedRedisError as e:
        raise PlatformError(str(e)) from None
    if stopped is not None:
        reap(stopped.pid)


def _redis_status(state: PlatformState) -> dict | None:
    """The redis-server of the platform's pipeline (:func:`isbflow.ops.redis_server.describe`) and
    whether the platform started it; None when the pipeline is not on Redis."""
    if not state.redis:
        return None
    # lazy: redis-py (~0.3 s) is loaded for a platform whose pipeline is on Redis only
    from isbflow.ops import redis_server

    d = redis_server.describe(Path(state.data_dir))
    return None if d is None else {**d, "started_by_platform": state.redis_started}


# -- status ----------------------------------------------------------------------------------------------

def status(data_dir: Path, cpu_interval: float = 0.5) -> dict:
    """Liveness, memory (PSS) and CPU of the recorded platform's processes (``running`` false when
    none), its health, its pipeline's steps, its producer and its pipeline's redis-server (``redis``:
    PID, URL, the admin's password file; None when the pipeline is on JetStream). CPU is each
    process group's use over ``cpu_interval`` seconds in percent of one core (``cpu_pct``), sampled
    for all groups at once."""
    data_dir = Path(data_dir).resolve()
    state = read_state(data_dir)
    nats = nats_server.read_state(data_dir)
    out: dict = {"data_dir": str(data_dir), "running": False, "processes": [], "health": None,
                 "nats": nats.to_json(with_secrets=False) if nats else None, "pipeline": None, "producer": None,
                 "redis": None}
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
    out["redis"] = _redis_status(state)
    if nats and all(nats.alive()):
        out["pipeline"] = pipeline_status(state)
    _add_cpu_and_memory(out, nats, cpu_interval)
    return out


def _add_cpu_and_memory(out: dict, nats, interval: float) -> None:
    """``cpu_pct`` on every live process entry (one sample of all groups), and ``pss_mb`` on the
    producer's, the driver's and the redis-server's."""
    live = [p for p in out["processes"] if p["alive"]]
    for extra in (out.get("producer"), (out.get("pipeline") or {}).get("launch"), out.get("redis")):
        if extra and extra.get("alive"):
            extra["pss_mb"] = round(group_memory(extra["pid"]) / 2**20, 1)
            live.append(extra)
    nodes = list(nats.nodes) if nats else []
    cpu = groups_cpu_percent([p["pid"] for p in live] + [n.pid for n in nodes], interval)
    for p in live:
        p["cpu_pct"] = cpu[p["pid"]]
    if nodes:
        out["nats"]["cpu_pct"] = [cpu[n.pid] for n in nodes]
