"""The platform's pipeline (the demo, ``pipelines/logs.yaml``, or any one-pipeline spec) and its producer.

Its buffers live where its spec's ISB service keeps them: a JetStream service's pipeline runs on the
platform's embedded nats-server; a ``redis.native`` service's on the spec's redis-server under the
data dir, which :func:`ensure_pipeline` starts (:func:`isbflow.ops.isb_service.up`, a live one
reused) and the platform records (``redis_started``: stopped with the platform only when it
started it). :func:`pipeline_settings` gives the admin's settings on either store (never
``NATS_URL`` or ``REDIS_URL``: the platform's own servers).

Contract: :func:`ensure_pipeline` is idempotent, like the ``pipeline_start`` DAG, and does
what that DAG does through the same verb, :func:`isbflow.ops.pipeline.start`: buffers
provisioned, reference tables put from ``<spec dir>/reference/<name>.json``, every step's
desired state ``running``, the steps launched as one detached driver, or its live launch
found (same launch record, so the DAG finds this launch and does not start a second one).
What is the platform's own: the driver carries the start's marker (``ISBFLOW_PLATFORM``) in
its environment; a producer (``isbflow produce --rate R``, detached, recorded with its PID
and start time) feeds the source, continuing at the source stream's last sequence so event
ids never repeat, and a live producer is kept; :func:`wait_running` waits until every step
has processed a micro-batch, restarting a driver whose step failed while starting;
:func:`drain_launches` drains every live launch (:func:`isbflow.ops.pipeline.drain`) and
stops by PID a driver that does not exit. :func:`pipeline_status` reports the launch, each
step's heartbeat and the source's size. Errors a user can hit are :class:`PlatformError`.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from isbflow.ops import isb_service
from isbflow.ops import nats as nats_server
from isbflow.ops import pipeline as ops_pipeline
from isbflow.ops.connection import PRODUCER, IsbSettings, NatsSettings, RedisSettings
from isbflow.ops.isb import role_settings
from isbflow.ops.pipeline import LaunchRecord, StateCheck
from isbflow.ops.processes import driver_env, process_start, stop_process, wait_exit
from isbflow.platform.procs import MARKER_ENV
from isbflow.platform.state import (
    PipelineOptions,
    PlatformError,
    PlatformState,
    ProcessState,
    Progress,
    quiet,
    repo_root,
    venv_bin,
    write_state,
)
from isbflow.spec import SpecError, Specs, load_specs
from isbflow.spec.models import Pipeline

PRODUCER_SEED = 0
live_launches = ops_pipeline.live_launches


@dataclass
class PipelineReport:
    """What :func:`ensure_pipeline` found or started."""

    pipeline: str
    provisioned: str  # one line: streams/buckets per action
    references: dict[str, dict[str, int]]  # table -> counts written/unchanged/deleted/revision
    launch: LaunchRecord
    producer: ProcessState | None
    producer_reused: bool
    producer_start: int | None  # first event index of a newly started producer
    check: StateCheck | None = None  # the steps once waited for (:func:`wait_running`)
    restarts: int = 0  # driver restarts that waiting took


def demo_spec() -> Path:
    return repo_root() / "pipelines" / "logs.yaml"


def isbflow_bin() -> str:
    return venv_bin("isbflow")


def nats_settings(data_dir: Path) -> NatsSettings:
    """Settings of the embedded server running under ``data_dir`` (never ``NATS_URL``: the platform's own)."""
    state = nats_server.read_state(Path(data_dir))
    if state is None:
        raise PlatformError(f"no embedded nats-server recorded under {data_dir}/")
    return NatsSettings(servers=tuple(state.urls), tls_ca=state.ca_file).with_auth_from_urls()


def pipeline_settings(data_dir: Path, specs: Specs, p: Pipeline) -> IsbSettings:
    """The admin's settings on the store ``p`` keeps its buffers in: the embedded nats-server's
    (:func:`nats_settings`), or the spec's native redis-server's under ``data_dir``."""
    service = specs.service_for(p)
    if service.store != "redis":
        return nats_settings(data_dir)
    # lazy: redis-py (~0.3 s) is loaded for a pipeline on Redis only
    from isbflow.ops import redis_server

    state = redis_server.read_state(Path(data_dir))
    if state is None:
        raise PlatformError(f"no redis-server recorded under {data_dir}/redis (ISB service {service.name!r} of "
                            f"pipeline {p.name}): start the platform with its spec")
    return RedisSettings(url=f"{redis_server.url(state)}/0", password=state.password)


def ensure_redis(state: PlatformState, specs: Specs, p: Pipeline, progress: Progress = quiet) -> bool:
    """Start the native Redis service ``p``'s spec declares under the platform's data dir, or reuse
    the live one, and record it in ``state`` (``redis_started`` once this platform started it).
    False, doing nothing, for a pipeline on JetStream. Raises :class:`PlatformError`."""
    service = specs.service_for(p)
    if service.store != "redis":
        return False
    progress(f"starting the ISB service {service.name} (redis-server)")
    try:
        up = isb_service.up(service, Path(state.data_dir))
    except isb_service.IsbServiceError as e:
        raise PlatformError(str(e)) from None
    state.redis, state.redis_started = True, state.redis_started or up.started
    write_state(state)  # recorded at once: a start that fails later stops it
    return True


def load_pipeline(spec: str | Path) -> tuple[Specs, Pipeline]:
    """The specs in ``spec`` and their only pipeline; PlatformError naming the problem."""
    try:
        specs = load_specs([Path(spec)])
        return specs, specs.only_pipeline()
    except SpecError as e:
        raise PlatformError(str(e)) from None


# -- starting -------------------------------------------------------------------------------------------------

def ensure_pipeline(state: PlatformState, opts: PipelineOptions, progress: Progress = quiet) -> PipelineReport:
    """Provision the pipeline, put its reference tables, launch its steps and start its producer.

    Idempotent (module docstring): a live launch is reused, a live producer recorded in
    ``state`` is kept. Raises :class:`PlatformError` naming what failed.
    """
    dd = Path(state.data_dir)
    specs, p = load_pipeline(opts.spec)
    ensure_redis(state, specs, p, progress)
    settings = pipeline_settings(dd, specs, p)
    try:
        started = ops_pipeline.start(
            Path(opts.spec), specs, p, settings, dd, master=opts.master, workdir=repo_root(),
            references_dir=Path(opts.spec).parent / ops_pipeline.REFERENCE_DIR, env={MARKER_ENV: state.marker},
            progress=progress, processing_time=opts.processing_time)
    except ops_pipeline.PipelineError as e:
        raise PlatformError(str(e)) from None
    except (ops_pipeline.IsbUnreachable, ops_pipeline.LaunchError) as e:
        raise PlatformError(f"pipeline {p.name}: {e}") from None
    producer, reused, first = state.producer, True, None
    if opts.rate > 0 and (producer is None or not producer.alive()):
        source = ops_pipeline.source_state(settings, p)
        first = source.last_seq if source is not None else 0
        producer, reused = start_producer(dd, opts, p, settings, state.marker, first), False
    state.pipeline, state.producer = opts, producer
    write_state(state)
    return PipelineReport(p.name, started.prepared.provisioned_line(), started.prepared.references,
                          started.launch, producer, reused, first)


def start_producer(data_dir: Path, opts: PipelineOptions, p: Pipeline, settings: IsbSettings, marker: str,
                   first: int) -> ProcessState:
    """Start ``isbflow produce --rate R`` detached (own session), events ``first ..``; log under ``logs/``."""
    logs = data_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"producer-{uuid.uuid4().hex[:8]}.log"
    cmd = [isbflow_bin(), "produce", "-f", str(Path(opts.spec).absolute()), "--pipeline", p.name,
           "--count", str(opts.count), "--rate", f"{opts.rate:g}", "--start", str(first),
           "--seed", str(PRODUCER_SEED), "--event-time-from", "now", "--data-dir", str(data_dir), "--json"]
    # as the producer role (publish to the pipeline's sources only), never the admin
    env = driver_env(role_settings(settings, data_dir, PRODUCER), data_dir, base={**os.environ, MARKER_ENV: marker})
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=repo_root(), stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return ProcessState("producer", proc.pid, str(log), process_start(proc.pid))


def wait_pipeline(state: PlatformState, target: str = "running", timeout: float = 240.0,
                  progress: Progress = quiet, processed: bool = False) -> StateCheck:
    """Wait until every step of the platform's pipeline reports ``target`` (heartbeats of its live
    launch; with ``processed``, also a finished micro-batch): :func:`isbflow.ops.pipeline.wait_state`."""
    if state.pipeline is None:
        raise PlatformError("the platform runs no pipeline")
    specs, p = load_pipeline(state.pipeline.spec)
    dd = Path(state.data_dir)
    return ops_pipeline.wait_state(pipeline_settings(dd, specs, p), p, dd, target, timeout, processed=processed,
                                   progress=progress)


def restart_pipeline(state: PlatformState, progress: Progress = quiet) -> PipelineReport:
    """Stop the platform pipeline's driver by PID (a step failed, or it hangs) and launch it again;
    its steps resume from their checkpoints."""
    if state.pipeline is None:
        raise PlatformError("the platform runs no pipeline")
    _specs, p = load_pipeline(state.pipeline.spec)
    progress(f"restarting the driver of pipeline {p.name}")
    ops_pipeline.stop_launch(Path(state.data_dir), p, grace=20.0)
    return ensure_pipeline(state, state.pipeline, progress)


def wait_running(state: PlatformState, timeout: float = 240.0, restarts: int = 2,
                 progress: Progress = quiet) -> tuple[StateCheck, int]:
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


def run_pipeline(state: PlatformState, opts: PipelineOptions, progress: Progress = quiet) -> PipelineReport:
    """:func:`ensure_pipeline`, then wait until its steps run (restarting a driver that failed)."""
    report = ensure_pipeline(state, opts, progress)
    if opts.wait > 0:
        report.check, report.restarts = wait_running(state, opts.wait, opts.restarts, progress)
        if report.restarts:
            report.launch = ops_pipeline.live_launch(Path(state.data_dir), load_pipeline(opts.spec)[1]) \
                or report.launch
    return report


# -- stopping -------------------------------------------------------------------------------------------------

def drain_launches(data_dir: Path, timeout: float = 180.0, progress: Progress = quiet) -> dict[str, str]:
    """Drain every live launch (drain protocol, upstream first) and wait for its driver to exit.

    A pipeline that does not drain within ``timeout`` (or whose ISB service is gone) has its
    driver stopped by PID instead. Returns launch key -> outcome.
    """
    out: dict[str, str] = {}
    records = live_launches(data_dir)
    drained: dict[str, str] = {}  # pipeline -> outcome (one drain per pipeline, however many launches)
    for record in records:
        if record.pipeline in drained:
            continue
        progress(f"draining pipeline {record.pipeline}")
        try:
            specs, p = load_pipeline(record.spec)
            p = specs.pipelines.get(record.pipeline, p)
            ops_pipeline.drain(pipeline_settings(data_dir, specs, p), p, timeout=timeout)
            drained[record.pipeline] = "drained"
        except (PlatformError, ops_pipeline.IsbUnreachable, ops_pipeline.DrainTimeout) as e:
            drained[record.pipeline] = f"not drained ({e})"
    for record in records:
        outcome = drained[record.pipeline]
        if wait_exit(record, 60.0 if outcome == "drained" else 0.0):
            out[record.key] = outcome
        else:
            progress(f"stopping the driver of {record.key} (pid {record.pid})")
            stop_process(record.pid, record.proc_start, grace=20.0)
            out[record.key] = f"{outcome}; driver stopped by pid"
    return out


# -- status ---------------------------------------------------------------------------------------------------

def pipeline_status(state: PlatformState) -> dict | None:
    """The platform pipeline's launch, each step's heartbeat and its source stream's size (None: no pipeline)."""
    if state.pipeline is None:
        return None
    try:
        specs, p = load_pipeline(state.pipeline.spec)
    except PlatformError as e:
        return {"spec": state.pipeline.spec, "error": str(e)}
    dd = Path(state.data_dir)
    record = ops_pipeline.live_launch(dd, p)
    out: dict[str, Any] = {"name": p.name, "spec": state.pipeline.spec, "steps": {}, "source_messages": None,
                           "launch": None}
    if record is not None:
        out["launch"] = {"launch_id": record.launch_id, "pid": record.pid, "alive": record.alive(),
                         "log": record.log, "started_at": record.started_at}
    try:
        settings = pipeline_settings(dd, specs, p)
        statuses = ops_pipeline.status(settings, p).statuses
        now = time.time()
        out["steps"] = {v: None if s is None else {
            "state": s.state, "batch_id": s.batch_id, "input_rows_per_s": s.input_rows_per_s,
            "processed_rows_per_s": s.processed_rows_per_s, "rows_total": s.rows_total,
            "lag": sum(s.lag.values()) if s.lag else 0, "heartbeat_age_s": round(s.age(now), 1),
            "pid": s.pid} for v, s in statuses.items()}
        source = ops_pipeline.source_state(settings, p)
        if source is None:
            raise PlatformError(f"the source stream of pipeline {p.name} does not exist")
        out["source_messages"] = source.messages
    except Exception as e:  # noqa: BLE001 - status reports what it cannot read instead of crashing
        out["error"] = f"{type(e).__name__}: {e}"
    return out
