"""Operators that start, drain and batch-run a pipeline's Spark steps.

Each calls its verb of :mod:`isbflow.ops.pipeline` (imported when the task
runs: parsing a DAG file stays light).

- :class:`PipelineStartOperator` prepares the pipeline (provisions its buffers
  when asked, puts its reference tables, sets every step's desired state to
  ``running``) and launches the continuous driver detached
  (:func:`isbflow.ops.pipeline.start`). The task ends at once: no
  worker slot is held for the life of the stream. A retried or re-triggered
  task finds the live launch and returns it instead of starting a second
  driver. XCom: the launch record. Wait for the steps with
  :class:`~isbflow.airflow.sensors.pipeline.PipelineStateSensor`.
- :class:`PipelineDrainOperator` runs the drain protocol
  (:func:`isbflow.ops.pipeline.drain_and_wait`, upstream first) and waits for the
  driver to exit. XCom: each step's final offsets. A timeout fails the task with
  the stuck step named.
- :class:`PipelineBatchOperator` runs the same steps once with
  ``--trigger available-now`` in a foreground subprocess (the batch half of
  batch-plus-streaming). It is skipped while a continuous launch of the
  pipeline is alive: both would write the same checkpoints.

Drain and batch tasks have the asset alias ``isbflow-sinks`` as outlet and add
an event per sink table when they succeed (:mod:`isbflow.airflow.assets`), which
schedules ``pipeline_quality``.

Every operator finds the spec like ``IsbProvisionOperator`` (a file name under
``pipelines_dir``), the ISB service through ``JetStreamHook`` (connection
``nats_default``, else the embedded server), and keeps its state (checkpoints,
sinks, launch records, driver logs) in ``data_dir`` (default ``ISBFLOW_HOME``).
Reference tables are read from ``<pipelines_dir>/reference/<name>.json``
(key -> columns) when that file exists.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from isbflow.airflow.assets import emit_sink_events, sinks_alias
from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.airflow.operators.isb import as_bool, report_table
from isbflow.airflow.pipelines import resolve_pipeline_file
from isbflow.ops.connection import default_data_dir
from isbflow.spec import SpecError, load_specs

if TYPE_CHECKING:
    import logging

    from isbflow.ops.connection import NatsSettings
    from isbflow.spec import Specs
    from isbflow.spec.models import Pipeline

REFERENCE_DIR = "reference"


@dataclass
class PipelineTarget:
    """A pipeline as the tasks see it: its spec file, parsed specs, data dir and ISB settings."""

    path: Path
    specs: Specs
    pipeline: Pipeline
    data_dir: Path
    settings: NatsSettings | None


def resolve_target(pipeline_file: str, pipelines_dir: str | None, pipeline: str | None,
                   nats_conn_id: str, data_dir: str | None, *, with_settings: bool = True) -> PipelineTarget:
    """Load the spec and find the ISB service (not with ``with_settings=False``: a task that needs
    none, e.g. sink maintenance, gets ``settings=None``); a bad name or spec fails the task without
    retries."""
    try:
        path = resolve_pipeline_file(pipeline_file, pipelines_dir or Path.cwd())
        specs = load_specs([path])
    except (FileNotFoundError, SpecError) as e:
        raise AirflowFailException(str(e)) from None
    if pipeline:
        if pipeline not in specs.pipelines:
            raise AirflowFailException(f"{path}: no pipeline named {pipeline!r} "
                                       f"(pipelines: {', '.join(specs.pipelines) or 'none'})")
        p = specs.pipelines[pipeline]
    elif len(specs.pipelines) == 1:
        p = next(iter(specs.pipelines.values()))
    else:
        raise AirflowFailException(f"{path} holds {len(specs.pipelines)} pipelines "
                                   f"({', '.join(specs.pipelines) or 'none'}): name one with 'pipeline'")
    dd = Path(data_dir) if data_dir else default_data_dir()
    settings = JetStreamHook(nats_conn_id, data_dir=dd).get_settings(specs.service_for(p)) if with_settings else None
    return PipelineTarget(path, specs, p, dd.absolute(), settings)


def prepare_pipeline(target: PipelineTarget, references_dir: Path | None, provision: bool,
                     log: logging.Logger) -> None:
    """Provision the buffers (when asked) and put the reference tables found in ``references_dir``."""
    # lazy: ops.pipeline loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
    from isbflow.ops import pipeline as ops

    def missing(name: str, file: Path | None) -> None:
        log.warning("reference table %s: no file %s; the step reads what its bucket holds", name, file)

    with _task_errors():
        prepared = ops.prepare(target.settings, target.specs, target.pipeline, references_dir,
                               provision=provision, on_missing_reference=missing, data_dir=target.data_dir)
    _log_prepared(prepared, target.pipeline.name, log)


def _log_prepared(prepared, pipeline: str, log: logging.Logger) -> None:
    if prepared.provisioned is not None:
        log.info("provisioned pipeline %s, changed: %s\n%s", pipeline, prepared.provisioned.changed,
                 report_table(prepared.provisioned))
    for name, counts in prepared.references.items():
        log.info("reference table %s: %s", name, counts)


@contextlib.contextmanager
def _task_errors():
    """An unreachable ISB service or a failed driver may pass on retry; a bad spec, file or
    refused change fails the task without retries."""
    # lazy: ops.pipeline loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
    from isbflow.ops import pipeline as ops

    try:
        yield
    except ops.IsbUnreachable as e:
        raise RuntimeError(str(e)) from None  # retries apply
    except ops.LaunchError as e:
        raise RuntimeError(str(e)) from None
    except (ops.PipelineError, ops.DrainTimeout) as e:
        raise AirflowFailException(str(e)) from None


class PipelineOperatorBase(BaseOperator):
    """Parameters every pipeline task shares (see the module docstring)."""

    template_fields: Sequence[str] = ("pipeline_file", "pipelines_dir", "pipeline", "nats_conn_id", "data_dir")

    def __init__(self, *, pipeline_file: str, pipelines_dir: str | None = None, pipeline: str | None = None,
                 nats_conn_id: str = JetStreamHook.default_conn_name, data_dir: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pipeline_file = pipeline_file
        self.pipelines_dir = pipelines_dir
        self.pipeline = pipeline
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir

    def target(self) -> PipelineTarget:
        return resolve_target(self.pipeline_file, self.pipelines_dir, self.pipeline or None,
                              self.nats_conn_id, self.data_dir or None)

    def references_dir(self) -> Path:
        return Path(self.pipelines_dir or Path.cwd()) / REFERENCE_DIR


class _RunsDriver(PipelineOperatorBase):
    """Tasks that run the pipeline's driver: where it runs and with what master."""

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "master", "workdir", "provision")

    def __init__(self, *, master: str = "local[2]", workdir: str | None = None, provision: bool | str = True,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.master = master
        self.workdir = workdir
        self.provision = provision


class PipelineStartOperator(_RunsDriver):
    """Prepare the pipeline and launch its continuous driver detached; XCom: the launch record.

    :param pipeline_file: spec file; a relative name is looked up under ``pipelines_dir``.
    :param pipeline: the pipeline, when the file holds several.
    :param master: Spark master (``local[2]``, ``spark://host:7077``).
    :param workdir: the driver's working directory, on its ``PYTHONPATH`` (user transforms).
    :param provision: provision the buffers first (idempotent); ``False`` when a task before did.
    :param steps: one step to launch alone (default: all steps in one Spark application).
    :param heartbeat_timeout: seconds without a heartbeat after which a running launch is stalled.
    :param startup_grace: seconds a new launch may take before its first heartbeat.
    """

    template_fields: Sequence[str] = (*_RunsDriver.template_fields, "steps")
    ui_color = "#d4f0c7"

    def __init__(self, *, steps: list[str] | None = None, heartbeat_timeout: float = 60.0,
                 startup_grace: float = 300.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.steps = steps
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_grace = startup_grace

    def execute(self, context: Any) -> dict:
        # lazy: ops.pipeline loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import pipeline as ops

        t = self.target()

        def missing(name: str, file: Path | None) -> None:
            self.log.warning("reference table %s: no file %s; the step reads what its bucket holds", name, file)

        with _task_errors():
            try:
                started = ops.start(t.path, t.specs, t.pipeline, t.settings, t.data_dir, master=self.master,
                                    steps=self.steps or None, workdir=self.workdir or None,
                                    references_dir=self.references_dir(), provision=as_bool(self.provision),
                                    on_missing_reference=missing, heartbeat_timeout=self.heartbeat_timeout,
                                    startup_grace=self.startup_grace)
            except ops.LaunchError as e:
                raise AirflowFailException(str(e)) from None
        _log_prepared(started.prepared, t.pipeline.name, self.log)
        record = started.launch
        if record.reused:
            self.log.info("pipeline %s already runs: launch %s (pid %s, log %s); not starting another",
                          t.pipeline.name, record.launch_id, record.pid, record.log)
        else:
            self.log.info("launched pipeline %s on %s: launch %s, pid %s, log %s", t.pipeline.name,
                          self.master, record.launch_id, record.pid, record.log)
        return record.to_json()


class PipelineDrainOperator(PipelineOperatorBase):
    """Drain every step (upstream first) and wait for the driver to exit; XCom: final offsets.

    :param drain_timeout: seconds the whole drain may take; on timeout the task fails naming
        the stuck step (no retries: the steps keep their state, drain again once it is fixed).
    :param exit_timeout: seconds to wait for the launched driver to exit after the drain.
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "drain_timeout")
    ui_color = "#f0e0c7"

    def __init__(self, *, drain_timeout: float | str = 300.0, exit_timeout: float = 120.0,
                 **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [sinks_alias()])  # asset events per sink (isbflow.airflow.assets)
        super().__init__(**kwargs)
        self.drain_timeout = drain_timeout
        self.exit_timeout = exit_timeout

    def execute(self, context: Any) -> dict:
        # lazy: ops.pipeline loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import pipeline as ops

        t = self.target()
        p = t.pipeline

        def progress(statuses: dict) -> None:
            states = {v: (s.state if s else "unknown") for v, s in statuses.items()}
            if states != getattr(progress, "last", None):
                self.log.info("drain of %s: %s", p.name, states)
                progress.last = states  # type: ignore[attr-defined]

        with _task_errors():
            drained = ops.drain_and_wait(t.settings, p, t.data_dir, timeout=float(self.drain_timeout),
                                         exit_timeout=self.exit_timeout, on_update=progress)
        offsets = drained.final_offsets
        for v, o in offsets.items():
            self.log.info("step %s drained, final offsets %s", v, o)
        launch, exited = drained.launch, drained.driver_exited
        if exited is False:
            self.log.warning("launch %s (pid %s) still runs %.0fs after the drain; see %s",
                             launch.launch_id, launch.pid, self.exit_timeout, launch.log)
        emit_sink_events(context, p, t.data_dir, by="drain")
        return {"pipeline": p.name, "final_offsets": offsets,
                "launch": launch.launch_id if launch else None, "driver_exited": exited}


class PipelineBatchOperator(_RunsDriver):
    """Run every step once over what its inputs hold (``--trigger available-now``); XCom: per step
    state, final offsets, rows and dead letters. Skipped while a continuous launch is alive.

    :param run_timeout: seconds the run may take (default: no limit besides the task's own).
    """

    template_fields: Sequence[str] = (*_RunsDriver.template_fields,)
    ui_color = "#e0d4f0"

    def __init__(self, *, run_timeout: float | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [sinks_alias()])  # asset events per sink (isbflow.airflow.assets)
        super().__init__(**kwargs)
        self.run_timeout = run_timeout

    def execute(self, context: Any) -> dict:
        # lazy: ops.pipeline loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import pipeline as ops

        t = self.target()
        p = t.pipeline
        live = ops.live_launch(t.data_dir, p)
        if live is not None and live.alive() is not False:
            raise AirflowSkipException(
                f"pipeline {p.name!r} runs continuously (launch {live.launch_id}, pid {live.pid}): a batch run "
                "would share its checkpoints; drain it first (DAG pipeline_drain)")
        prepare_pipeline(t, self.references_dir(), as_bool(self.provision), self.log)
        self.log.info("batch run of %s on %s", p.name, self.master)
        with _task_errors():  # a failed run may succeed on retry
            result, log_path = ops.batch(t.path, p, t.settings, t.data_dir, master=self.master,
                                         workdir=self.workdir or None, timeout=self.run_timeout)
        steps = {v: {k: s.get(k) for k in ("state", "final_offsets", "rows_total", "dlq_total")}
                 for v, s in result.get("steps", {}).items()}
        for v, s in steps.items():
            self.log.info("step %s: %s", v, s)
        self.log.info("batch run of %s took %ss; driver log %s", p.name, result.get("seconds"), log_path)
        emit_sink_events(context, p, t.data_dir, by="batch")
        return {"pipeline": p.name, "seconds": result.get("seconds"), "log": log_path, "steps": steps}
