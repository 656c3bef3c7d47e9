"""``isbflow pipeline`` and ``isbflow step``: run, drain and watch a pipeline's steps."""

from __future__ import annotations

import sys
import time
from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from isbflow.cli import zero
from isbflow.cli.common import (
    DataDir,
    JsonOut,
    NatsUrl,
    PipelineName,
    SpecFile,
    call,
    console,
    data_dir_or_default,
    fail,
    pipeline_or_exit,
    print_json,
    reader_settings_or_exit,
    settings_or_exit,
)

app = typer.Typer(help="Run, drain and watch a pipeline's Spark steps.", no_args_is_help=True)
step_app = typer.Typer(help="Run one step of a pipeline.", no_args_is_help=True)


class Trigger(StrEnum):
    CONTINUOUS = "continuous"
    AVAILABLE_NOW = "available-now"


TriggerOpt = Annotated[Trigger, typer.Option(
    help="continuous: run until drained; available-now: process what the sources hold now, "
         "step by step in topological order, then return (the batch mode of the same code).")]
MasterOpt = Annotated[str, typer.Option(help="Spark master, e.g. local[2] or spark://127.0.0.1:7077.")]
MetricsPortOpt = Annotated[int, typer.Option(
    help="Serve Prometheus metrics on 127.0.0.1:PORT/metrics (-1: a free port; 0: off; bind address: "
         "ISBFLOW_METRICS_HOST). Recorded as a Prometheus file_sd target in <data dir>/metrics/.",
    envvar="ISBFLOW_METRICS_PORT", min=-1, max=65535)]
ProcessingTimeOpt = Annotated[str | None, typer.Option(
    help="continuous: the trigger interval of the source steps (the latency budget: how long events "
         "gather), e.g. '4 seconds', over the spec's limits.readTimeout (default: that; 5 seconds when unset). "
         "Steps that read buffers are event-driven: they start a batch when their input grows (unless their "
         "own readTimeout says otherwise; ISBFLOW_IDLE_WAIT=0 gives every step this interval).")]


def _log_steps() -> None:
    """The steps' own log lines (a restart, a drain, each decision of a step's autoscaler with its
    inputs) on stderr, which a launched driver writes to its log file."""
    import logging  # lazy: only a run logs

    log = logging.getLogger("isbflow.steps")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def _run(files, pipeline, data_dir, nats_url, trigger, master, steps, json_out, metrics_port=0,
         processing_time=None):
    # lazy: ops.pipeline loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow.ops import pipeline as ops

    specs, p = pipeline_or_exit(files, pipeline)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    _log_steps()
    available_now = trigger == Trigger.AVAILABLE_NOW
    if not json_out and not available_now:
        console.print(f"pipeline {p.name} running (Ctrl-C stops; 'isbflow pipeline drain' drains)")
    started = time.time()
    try:
        out = call(ops.run_here, specs, p, settings, data_dir_or_default(data_dir), master=master,
                   available_now=available_now, steps=steps, metrics_port=metrics_port,
                   processing_time=processing_time, confined=True,
                   on_step=None if json_out else lambda v, s: console.print(
                       f"step {v}: {s.state}, committed {s.committed}, dead-lettered {s.dlq_total}"
                       + (f", unrouted {s.unrouted_total}" if s.unrouted_total else "")
                       + (f", sink retries {s.sink_retries}, to fallback {s.fallback_total}, dropped "
                          f"{s.dropped_total}" if s.sink_retries or s.fallback_total or s.dropped_total else "")),
                   on_metrics=None if json_out else lambda url: console.print(f"metrics on {url}"))
    except ops.PipelineError as e:
        fail(str(e))
    except KeyboardInterrupt:
        out = {}
    if json_out:
        print_json({"pipeline": p.name, "seconds": round(time.time() - started, 3),
                    "steps": {v: s.to_json() for v, s in out.items()}})


@app.command("run")
def run_pipeline(
    file: SpecFile,
    trigger: TriggerOpt = Trigger.CONTINUOUS,
    master: MasterOpt = "local[2]",
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
    metrics_port: MetricsPortOpt = 0,
    processing_time: ProcessingTimeOpt = None,
) -> None:
    """Run every step of a pipeline in one Spark application.

    Example: isbflow pipeline run -f pipelines/logs.yaml --trigger available-now
    """
    _run(file, pipeline, data_dir, nats_url, trigger, master, None, json_out, metrics_port, processing_time)


@step_app.command("run")
def run_step(
    file: SpecFile,
    step: Annotated[str, typer.Option(help="The vertex to run.")],
    trigger: TriggerOpt = Trigger.CONTINUOUS,
    master: MasterOpt = "local[2]",
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
    metrics_port: MetricsPortOpt = 0,
    processing_time: ProcessingTimeOpt = None,
) -> None:
    """Run one step (its own Spark application): e.g. one per machine on a cluster.

    Example: isbflow step run -f pipelines/logs.yaml --step parse
    """
    specs, p = pipeline_or_exit(file, pipeline)
    if step not in {v.name for v in p.spec.vertices}:
        fail(f"pipeline {p.name!r} has no step {step!r} (steps: {', '.join(p.topological_order())})", 2)
    _run(file, pipeline, data_dir, nats_url, trigger, master, [step], json_out, metrics_port, processing_time)


@app.command()
def drain(
    file: SpecFile,
    timeout: Annotated[float, typer.Option(help="Seconds to wait before giving up (exit 1, stuck step named).")] = 300,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Drain a running pipeline: upstream steps first, each downstream step once its inputs are
    consumed; returns when every step reports drained, with its final offsets.
    """
    # lazy: ops.pipeline loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow.ops import pipeline as ops

    specs, p = pipeline_or_exit(file, pipeline)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    try:
        out = call(ops.drain, settings, p, timeout=timeout)
    except ops.DrainTimeout as e:
        fail(str(e))
    if json_out:
        print_json({"pipeline": p.name, "steps": {v: s.to_json() for v, s in out.items()}})
    else:
        for v, s in out.items():
            console.print(f"{v}: drained, final offsets {s.final_offsets}")


@app.command()
def status(
    file: SpecFile,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Each step's state, batch, committed offsets, lag, rates, unrouted and dead-letter counts.

    unrouted: records none of a step's out edges' conditions.tags took (dropped or dead-lettered).

    A sink whose failure policy acted gets a line: failed attempts, records sent to its fallback,
    records dropped, and the failure while attempts go on.

    A step with scale gets a line from its autoscaler: its replicas, the desired replicas within
    min..max, why, and on a cluster master the application's executors.

    --json holds every heartbeat field (unrouted_total, dlq_total, sink_retries, fallback_total, ...).
    """
    # lazy: ops.pipeline loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow.ops import pipeline as ops

    specs, p = pipeline_or_exit(file, pipeline)
    settings = reader_settings_or_exit(nats_url, data_dir, specs, p.name)
    st = call(ops.status, settings, p)
    statuses, desired, recovery = st.statuses, st.desired, st.recovery
    if json_out:
        print_json(st.to_json(p.name))
        return
    t = Table("step", "desired", "state", "batch", "lag (msgs)", "in rows/s", "done rows/s", "unrouted", "dlq",
              "heartbeat")
    for v, s in statuses.items():
        if s is None:
            t.add_row(v, desired[v].value, "never reported", "", "", "", "", "", "", "")
            continue
        t.add_row(v, desired[v].value, s.state, str(s.batch_id), str(sum(s.lag.values())),
                  f"{s.input_rows_per_s:,.0f}", f"{s.processed_rows_per_s:,.0f}", str(s.unrouted_total), str(s.dlq_total),
                  f"{s.age():.0f}s ago")
    console.print(t)
    for v, s in statuses.items():  # a sink's failure policy, when it did anything (retryStrategy, fallback)
        if s is not None and (s.sink_retries or s.fallback_total or s.dropped_total or s.sink_error):
            console.print(f"sink {v}: {s.sink_retries} failed attempts, {s.fallback_total} records to the fallback "
                          f"({s.refused_total} refused one by one), {s.dropped_total} dropped"
                          + (f"; retrying: {s.sink_error}" if s.sink_error else ""), markup=False, highlight=False)
    from isbflow.ops.status import replicas_line  # lazy: keeps --help light

    for v, s in statuses.items():  # a step with scale: its autoscaler's replicas and last decision
        line = replicas_line(v, s)
        if line:
            console.print(line, markup=False, highlight=False)
    if recovery:
        console.print(ops.recovery_line(recovery), markup=False, highlight=False)


@app.command()
def advise(
    file: SpecFile,
    keys: Annotated[bool, typer.Option(
        "--keys", help="Decode a hot partition's newest frames for its most frequent partitionKey values "
                       "(reads buffer data: logs in as the admin, not the read-only reader).")] = False,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
) -> None:
    """A tuning report from what the steps measured: per step its processing rate, pending messages,
    utilization (last batch time over the latency budget, limits.readTimeout) and the replicas
    Numaflow's autoscaler formula asks for (with the vertex's scale, or Numaflow's defaults); per edge
    its hot partitions (lag or messages written more than 2x the siblings' median and at least 10
    messages above it); readBatchSize, bufferMaxLength and latency-budget advice. It reports; a
    running step with scale is scaled by its autoscaler with the same formula ('pipeline status'
    shows its replicas). Exit 0; 1 when the ISB service cannot be read.

    --json prints {"pipeline", "generated_at", "scaler", "thresholds": {"hot_factor",
    "hot_floor_messages", "sample_frames", "full_batch"}, "vertices": [{"vertex", "role", "state",
    "partitions", "rate", "input_rate", "pending", "pending_unit" (events | frames),
    "batch_seconds", "budget_seconds", "utilization", "desired_replicas", "scale": {...},
    "scale_configured", "advice": \\[lines]}], "edges": [{"from_vertex", "to_vertex",
    "partition_key", "partitions": [{"partition", "stream", "lag", "written", "hot", "why",
    "keys": [{"key", "share"}] | null}], "hot": \\[partition numbers], "keys_note"}]}.

    Example: isbflow pipeline advise -f pipelines/logs.yaml --json
    """
    # lazy: ops.advise loads the NATS client and pyarrow, which 'isbflow --help' must not pay for
    from isbflow.ops.advise import advise_sync

    specs, p = pipeline_or_exit(file, pipeline)
    settings = (settings_or_exit(nats_url, data_dir, specs, p.name) if keys
                else reader_settings_or_exit(nats_url, data_dir, specs, p.name))
    report = call(advise_sync, settings, p, sample=keys)
    if json_out:
        print_json(report.to_json())
        return
    t = Table("step", "state", "rate (rows/s)", "pending", "batch / budget", "utilization", "desired replicas")
    for v in report.vertices:
        t.add_row(v.vertex, v.state, f"{v.rate:,.0f}", f"{v.pending:,} {v.pending_unit}",
                  f"{v.batch_seconds:.2f}s / {v.budget_seconds:g}s" if v.batch_seconds is not None
                  else f"- / {v.budget_seconds:g}s",
                  f"{v.utilization:.0%}" if v.utilization is not None else "",
                  "" if v.desired_replicas is None else str(v.desired_replicas))
    console.print(t)
    for v in report.vertices:
        for line in v.advice:
            console.print(f"{v.vertex}: {line}", markup=False, highlight=False)
    for e in report.edges:
        for q in e.partitions:
            if q.hot:
                keys_text = (", keys " + ", ".join(f"{k['key']!r} {k['share']:.0%}" for k in q.keys)) if q.keys else ""
                console.print(f"edge {e.from_vertex}->{e.to_vertex}: partition {q.partition} is hot ({q.why}){keys_text}",
                              markup=False, highlight=False)
        if e.hot and e.keys_note:
            console.print(f"edge {e.from_vertex}->{e.to_vertex}: {e.keys_note}", markup=False, highlight=False)
    console.print(report.scaler, markup=False, highlight=False)


def register(root: typer.Typer) -> None:
    import isbflow.cli.rescale  # noqa: F401  # lazy: a cycle: it adds 'pipeline rescale' to this module's app
    root.add_typer(app, name="pipeline")
    root.add_typer(step_app, name="step")
    zero.register(app)
