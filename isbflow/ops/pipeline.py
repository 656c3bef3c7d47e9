"""The pipeline verbs: prepare, start, drain, batch, run here, status.

One function per verb, called by ``isbflow pipeline ...``, the Airflow
pipeline operators and the local platform (``make run``), so each is written
once:

- :func:`prepare`: provision the buffers (idempotent; a recreate that would
  drop unread messages is refused) and put the reference tables found in
  ``<spec dir>/reference/<name>.json``;
- :func:`start`: prepare, set every step's desired state to ``running``, and
  launch the continuous driver detached, or find its live launch
  (:func:`isbflow.steps.launch.launch_pipeline`);
- :func:`drain`: the drain protocol (:func:`isbflow.steps.drain.drain_pipeline`,
  upstream first); :func:`drain_and_wait` also waits for the launched driver;
- :func:`batch`: the steps once, available-now, in a foreground driver;
- :func:`run_here`: the steps in this process's SparkSession (the CLI's ``run``);
- :func:`status`: each step's heartbeat and desired state, and the last recovery;
  :func:`source_state`: the source stream's size and last sequence;
- :func:`wait_state`: wait until every step reports a state (a failed step or a dead
  driver ends the wait); :func:`live_launches`: the drivers still running on this host;
  :func:`stop_launch`: stop a launched driver by PID.

Errors: :class:`PipelineError` when retrying cannot help (a bad reference
file, a refused recreate, a launch that failed), :class:`IsbUnreachable`
when the ISB service cannot be reached (retrying may help),
:class:`DrainTimeout` naming the stuck step, :class:`LaunchError` for a
driver that failed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb import naming, reference
from isbflow.isb import provision as prov
from isbflow.isb.buffers import StreamState, stream_state
from isbflow.isb.connect import IsbSettings, IsbUnreachable, NatsSettings, RedisSettings, session
from isbflow.isb.roles import pipeline_user
from isbflow.isb.state import Desired, StepStatus, all_status, get_desired
from isbflow.local.sandbox import SandboxError
from isbflow.ops.isb import apply as isb_apply
from isbflow.ops.isb import grant, role_settings
from isbflow.ops.produce import source_vertex
from isbflow.recovery.status import last_recovery, recovery_line
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.steps.drain import DrainTimeout, drain_pipeline, resume_pipeline
from isbflow.steps.driver import cap_own_log, check_processing_time, confine
from isbflow.steps.launch import (
    LaunchError,
    LaunchRecord,
    StateCheck,
    judge_state,
    launch_pipeline,
    launches_dir,
    read_launch,
    run_foreground,
    wait_exit,
)
from isbflow.steps.launch import stop_launch as stop_recorded_launch

__all__ = ["REFERENCE_DIR", "DrainTimeout", "Drained", "IsbUnreachable", "LaunchError", "LaunchRecord",
           "PipelineError", "PipelineStatus", "Prepared", "StateCheck", "Started", "StreamState", "batch", "check_processing_time",
           "drain",
           "drain_and_wait", "live_launch", "live_launches", "prepare", "put_references", "recovery_line",
           "resume", "run_here", "source_state", "start", "status", "stop_launch", "wait_state"]

#: reference tables are read from this folder beside the spec file
REFERENCE_DIR = "reference"

Progress = Callable[[str], None]


def _quiet(_m: str) -> None:
    pass


class PipelineError(Exception):
    """A pipeline verb failed in a way retrying cannot fix; the message names what and where."""


@dataclass
class Prepared:
    """What :func:`prepare` did: the provisioning report (None when not asked) and the rows
    put per reference table."""

    provisioned: prov.ProvisionReport | None
    references: dict[str, dict[str, int]] = field(default_factory=dict)

    def provisioned_line(self) -> str:
        """``N streams/buckets (a created, b unchanged)``."""
        if self.provisioned is None:
            return "not provisioned"
        counts: dict[str, int] = {}
        for r in self.provisioned.resources:
            counts[r.action.value] = counts.get(r.action.value, 0) + 1
        return (f"{len(self.provisioned.resources)} streams/buckets ("
                + ", ".join(f"{n} {a}" for a, n in sorted(counts.items())) + ")")


@dataclass
class Started:
    prepared: Prepared
    launch: LaunchRecord


def provision_buffers(settings: IsbSettings, specs: Specs, p: Pipeline,
                      data_dir: Path | None = None) -> prov.ProvisionReport:
    """Provision ``p``'s buffers; a recreate refused (the stream holds messages) is an error. On a
    Redis store, :func:`isbflow.ops.isb.apply` (its streams and, embedded under ``data_dir``, its user)."""
    if isinstance(settings, RedisSettings):
        try:
            return isb_apply(settings, specs, p.name, data_dir=data_dir)
        except prov.ProvisionRefused as e:
            raise PipelineError(f"pipeline {p.name}: {e}") from None
    try:
        report = asyncio.run(prov.apply(settings, specs, p.name))
    except prov.ProvisionError as e:
        raise PipelineError(f"pipeline {p.name}: {e}") from None
    refused = [r.name for r in report.resources if r.action == prov.Action.REFUSED]
    if refused:
        raise PipelineError(f"pipeline {p.name}: recreate refused for buffer(s) still holding messages: "
                            f"{', '.join(refused)}")
    return report


def put_references(settings: NatsSettings, p: Pipeline, folder: Path | None,
                   on_missing: Callable[[str, Path | None], None] | None = None) -> dict[str, dict[str, int]]:
    """Put each reference table a step of ``p`` joins from ``<folder>/<name>.json`` (key -> columns).

    Unchanged rows are skipped (putting again writes nothing). A table without a file is left
    as its bucket holds it (``on_missing(name, file)`` is told). Raises :class:`PipelineError`
    for a file that is not a JSON object or rows the bucket refuses.
    """
    out = {}
    for name in sorted({r.name for v in p.spec.vertices if v.udf for r in v.udf.references}):
        file = folder / f"{name}.json" if folder is not None else None
        if file is None or not file.is_file():
            if on_missing is not None:
                on_missing(name, file)
            continue
        try:
            rows = json.loads(file.read_text())
        except ValueError as e:
            raise PipelineError(f"reference table {file}: not valid JSON ({e})") from None
        if not isinstance(rows, dict):
            raise PipelineError(f"reference table {file}: expected an object key -> columns")
        try:
            out[name] = asyncio.run(reference.put(settings, p.name, name, rows))
        except reference.ReferenceError as e:
            raise PipelineError(f"reference table {file}: {e}") from None
    return out


def prepare(settings: NatsSettings, specs: Specs, p: Pipeline, references_dir: Path | None, *,
            provision: bool = True, progress: Progress = _quiet,
            on_missing_reference: Callable[[str, Path | None], None] | None = None,
            data_dir: Path | None = None) -> Prepared:
    """Provision the buffers (when asked) and put the reference tables found in ``references_dir``;
    the pipeline's user on the embedded server under ``data_dir`` is granted
    (:func:`isbflow.ops.isb.grant`) whether provisioned here or not."""
    report = None
    if provision:
        progress(f"provisioning the buffers of pipeline {p.name}")
        report = provision_buffers(settings, specs, p, data_dir)
    if not isinstance(settings, RedisSettings):  # a Redis store's users are made by its provisioning
        grant(p, data_dir)
    progress(f"loading the reference tables of pipeline {p.name}")
    return Prepared(report, put_references(settings, p, references_dir, on_missing_reference))


def resume(settings: NatsSettings, p: Pipeline) -> None:
    """Set every step's desired state back to ``running`` (before a start)."""

    async def go() -> None:
        async with session(settings, name="isbflow-start") as nc:
            await resume_pipeline(nc, p)

    asyncio.run(go())


def start(spec_file: Path, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path, *,
          master: str = "local[2]", steps: Sequence[str] | None = None, workdir: Path | None = None,
          references_dir: Path | None = None, provision: bool = True,
          env: Mapping[str, str] | None = None, progress: Progress = _quiet,
          on_missing_reference: Callable[[str, Path | None], None] | None = None,
          **launch_args: Any) -> Started:
    """Prepare ``p``, resume its steps and launch its continuous driver, or find its live launch.

    Idempotent: a live launch (process and heartbeats) is returned with ``reused=True``.
    ``env`` adds to the driver's environment; ``launch_args`` go to
    :func:`~isbflow.steps.launch.launch_pipeline` (``heartbeat_timeout``, ``startup_grace``).
    """
    prepared = prepare(settings, specs, p, references_dir, provision=provision, progress=progress,
                       on_missing_reference=on_missing_reference, data_dir=data_dir)
    resume(settings, p)
    progress(f"launching the steps of pipeline {p.name}")
    # the driver runs user transforms: it logs in as the pipeline's own user, not the admin
    driver_settings = role_settings(settings, data_dir, pipeline_user(p.name))
    record = launch_pipeline(spec_file, data_dir, driver_settings, master=master, pipeline=p.name, steps=steps,
                             workdir=workdir, extra_env=env, **launch_args)
    return Started(prepared, record)


def drain(settings: NatsSettings, p: Pipeline, timeout: float = 300.0,
          on_update: Callable[[dict[str, StepStatus | None]], None] | None = None) -> dict[str, StepStatus]:
    """Drain every step, upstream first; each step's final status. Raises :class:`DrainTimeout`."""

    async def go() -> dict[str, StepStatus]:
        async with session(settings, name="isbflow-drain") as nc:
            return await drain_pipeline(nc, p, timeout=timeout, on_update=on_update)

    return asyncio.run(go())


def live_launch(data_dir: Path, p: Pipeline) -> LaunchRecord | None:
    """The pipeline's launch on record (alive or not), or None."""
    return read_launch(data_dir, p.name)


@dataclass
class Drained:
    final: dict[str, StepStatus]
    launch: LaunchRecord | None
    #: True: the driver exited; False: it still runs after ``exit_timeout``; None: no launch on
    #: record, or it ran on another host (cannot tell)
    driver_exited: bool | None

    @property
    def final_offsets(self) -> dict[str, dict]:
        return {v: s.final_offsets for v, s in self.final.items()}


def drain_and_wait(settings: NatsSettings, p: Pipeline, data_dir: Path, *, timeout: float = 300.0,
                   exit_timeout: float = 120.0,
                   on_update: Callable[[dict[str, StepStatus | None]], None] | None = None) -> Drained:
    """:func:`drain`, then wait up to ``exit_timeout`` for the launched driver to exit."""
    final = drain(settings, p, timeout=timeout, on_update=on_update)
    launch = live_launch(data_dir, p)
    exited = None
    alive = launch.alive() if launch is not None else None
    if alive is False:
        exited = True  # the driver exited as its last step drained (before we looked)
    elif alive:
        exited = wait_exit(launch, exit_timeout)
    return Drained(final, launch, exited)


def batch(spec_file: Path, p: Pipeline, settings: NatsSettings, data_dir: Path, *, master: str = "local[2]",
          workdir: Path | None = None, timeout: float | None = None) -> tuple[dict[str, Any], str]:
    """Every step once over what its inputs hold, in a foreground driver; (its result, its log).

    Raises :class:`PipelineError` while a continuous launch of ``p`` is alive (both would write
    the same checkpoints), :class:`LaunchError` when the run fails.
    """
    live = live_launch(data_dir, p)
    if live is not None and live.alive() is not False:
        raise PipelineError(f"pipeline {p.name!r} runs continuously (launch {live.launch_id}, pid {live.pid}): "
                            "a batch run would share its checkpoints; drain it first")
    grant(p, data_dir)  # its current spec's names
    return run_foreground(spec_file, data_dir, role_settings(settings, data_dir, pipeline_user(p.name)),
                          trigger="available-now", master=master, pipeline=p.name, workdir=workdir, timeout=timeout)


def run_here(specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path, *, master: str = "local[2]",
             available_now: bool = False, steps: list[str] | None = None, metrics_port: int = 0,
             on_step: Callable[[str, StepStatus], None] | None = None,
             on_metrics: Callable[[str], None] | None = None,
             processing_time: str | None = None, confined: bool = False) -> dict[str, StepStatus]:
    """Run ``steps`` (default all) of ``p`` in this process: continuously until drained or
    interrupted, or available-now. ``processing_time`` overrides every step's trigger interval
    (default the runner's). Raises :class:`PipelineError` when a step fails.

    ``confined`` (a driver process of its own: ``isbflow pipeline run``): the steps log in as the
    pipeline's user when ``settings`` are the admin's on the embedded server under ``data_dir``,
    and the process, before Spark starts, holds no other ISB secret and cannot reach the embedded
    server's folder (:func:`isbflow.steps.driver.confine`; ``ISBFLOW_SANDBOX=off`` turns that off).
    It cannot be undone."""
    # lazy: steps.runner loads pyspark, deltalake and psycopg (~0.5 CPU-s), steps.metrics prometheus_client;
    # every `isbflow` command imports this module, only a foreground run needs them
    from isbflow.steps.metrics import serve
    from isbflow.steps.runner import PipelineRunner, StepError, latency_budget_s, spark_session
    from isbflow.steps.session import driver_conf

    hidden = None
    if confined:  # user transforms get the pipeline's own credentials only (isbflow.steps.driver)
        settings = role_settings(settings, data_dir, pipeline_user(p.name))
        try:
            hidden = confine(p, data_dir, settings)
        except SandboxError as e:
            raise PipelineError(f"pipeline {p.name}: {e}") from None
    cap_own_log()  # a launched driver bounds its own log (isbflow.steps.driver)
    budget = None if available_now else latency_budget_s(p, processing_time)
    conf = driver_conf(budget)
    if hidden is not None and hidden.temp is not None:  # the JVM's temporary files where it can read them
        java = conf.get("spark.driver.extraJavaOptions", "")
        conf["spark.driver.extraJavaOptions"] = f"{java} -Djava.io.tmpdir={hidden.temp}".strip()
    spark = spark_session(master, app_name=f"isbflow-{p.name}", conf=conf)
    spark.sparkContext.setLogLevel("WARN")
    runner = PipelineRunner(spark, specs, p, settings, data_dir,
                            processing_time=processing_time)
    metrics = None
    if metrics_port:
        metrics = serve(runner, metrics_port, data_dir, key=p.name + (f".{steps[0]}" if steps else ""))
        if on_metrics is not None:
            on_metrics(metrics.url)
    try:
        if available_now:
            return runner.run_available_now(steps, on_step=on_step)
        return runner.run_continuous(steps)
    except StepError as e:
        raise PipelineError(str(e)) from None
    finally:
        runner.close()
        if metrics is not None:
            metrics.close()


@dataclass
class PipelineStatus:
    statuses: dict[str, StepStatus | None]
    desired: dict[str, Desired]
    recovery: dict | None

    def to_json(self, pipeline: str) -> dict:
        return {"pipeline": pipeline, "steps": {
            v: {"desired": self.desired[v].value, **(s.to_json() if s else {"state": "unknown"})}
            for v, s in self.statuses.items()}, "recovery": self.recovery}


def status(settings: NatsSettings, p: Pipeline) -> PipelineStatus:
    """Each step's heartbeat and desired state, and the last recovery's report."""
    order = p.topological_order()

    async def go() -> PipelineStatus:
        async with session(settings, name="isbflow-status") as nc:
            return PipelineStatus(await all_status(nc, p.name, order),
                                  {v: await get_desired(nc, p.name, v) for v in order},
                                  await last_recovery(nc, p.name))

    return asyncio.run(go())


def source_state(settings: NatsSettings, p: Pipeline) -> StreamState | None:
    """``p``'s JetStream source stream as the server reports it (messages, last sequence), or
    None when it does not exist. Its ``last_seq`` is where a restarted producer continues, so
    event ids never repeat."""

    async def go() -> StreamState | None:
        async with session(settings, name="isbflow-source") as nc:
            return await stream_state(nc, naming.source_stream(p, source_vertex(p)))

    return asyncio.run(go())


def live_launches(data_dir: Path) -> list[LaunchRecord]:
    """Every launch recorded under ``data_dir`` (any pipeline, any step) whose driver still runs
    on this host (same PID and start time)."""
    out = []
    for path in sorted(launches_dir(data_dir).glob("*.json")):
        try:
            record = read_launch(data_dir, path.stem)
        except LaunchError:
            continue
        if record is not None and record.alive() is True:
            out.append(record)
    return out


def stop_launch(data_dir: Path, p: Pipeline, grace: float = 30.0) -> LaunchRecord | None:
    """Stop ``p``'s launched driver by PID (a step failed, or it hangs): SIGINT, then SIGTERM and
    SIGKILL to its process group after ``grace`` s each. Its steps resume from their checkpoints
    at the next :func:`start`. Returns the record (None: no launch recorded)."""
    return stop_recorded_launch(data_dir, p.name, grace=grace)


def wait_state(settings: NatsSettings, p: Pipeline, data_dir: Path, target: str = "running",
               timeout: float = 240.0, *, processed: bool = False, progress: Progress = _quiet) -> StateCheck:
    """Wait until every step of ``p`` reports ``target`` in the heartbeats of its live launch.

    With ``processed``, a step counts only once it has also finished a micro-batch (a step
    reports ``running`` before its first batch, when its Python workers may still fail to
    start). Returns the last :class:`StateCheck`: ``done`` false after ``timeout``, or when a
    step failed or the driver died (``problem`` says which: waiting longer cannot help).
    """
    order = p.topological_order()

    async def go() -> StateCheck:
        async with session(settings, name="isbflow-wait") as nc:
            deadline = time.monotonic() + timeout
            while True:
                record = read_launch(data_dir, p.name)
                alive = record.alive() if record is not None else None
                statuses = await all_status(nc, p.name, order)
                check = judge_state(statuses, target, record, alive)
                if processed and check.done:
                    idle = [v for v, st in statuses.items() if st is None or st.batch_id < 0]
                    check = StateCheck(not idle, None, {
                        v: f"{s} (no batch yet)" if v in idle else s for v, s in check.steps.items()})
                if check.done or check.problem or time.monotonic() > deadline:
                    return check
                progress(f"waiting for the steps of {p.name}: " + ", ".join(
                    f"{v} {s}" for v, s in check.steps.items()))
                await asyncio.sleep(1.0)

    return asyncio.run(go())
