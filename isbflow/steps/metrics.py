"""Prometheus metrics of a running pipeline's steps, served by the step process on 127.0.0.1.

``isbflow pipeline run --metrics-port N`` (or ``step run``; or the environment
variable ``ISBFLOW_METRICS_PORT``) serves ``/metrics`` on ``127.0.0.1:N``
(``-1``: a free port; ``0``, the default: off). ``ISBFLOW_METRICS_HOST`` changes
the bind address (e.g. ``0.0.0.0`` inside a container, so Prometheus on the
container network can scrape it). While it runs, the endpoint is recorded in
``<data dir>/metrics/<key>.json`` (``key``: the pipeline, or
``<pipeline>.<step>``) as a Prometheus ``file_sd`` target list::

    [{"targets": ["127.0.0.1:9108"], "labels": {"isbflow_key": "logs", "pid": "1234"}}]

so Prometheus (``file_sd_configs`` over that folder) discovers every running
step process; the file is removed when the process stops.

The runner calls :meth:`PipelineMetrics.observe` with every heartbeat (after
each step's start and end in ``available-now``, every couple of seconds and on
every state change in ``continuous``). It walks each query's
``recentProgress`` since the last call, so no micro-batch is missed or counted
twice however far apart the calls are (Spark keeps the last 100 progress
reports per query). Series (labels ``pipeline``, ``step`` and as noted):

- ``isbflow_step_records_in_total``: input rows of the step's micro-batches
  (one query per step, whatever its out degree);
- ``isbflow_step_records_out_total`` (``to``: the downstream vertex, or
  ``delta`` for a sink's table): rows the step published anew to that edge's
  buffers (from the writer's per-batch stats: duplicates and dead letters
  excluded), or rows the sink wrote;
- ``isbflow_step_batch_duration_seconds`` (histogram): wall time of each
  micro-batch that ran (Spark's ``triggerExecution``); its ``_count`` is the
  number of batches;
- ``isbflow_step_last_batch_timestamp_seconds``: when the last batch ended
  (stall alerts);
- ``isbflow_step_lag_messages`` (``stream``): messages in an input stream past
  what the step has committed (frames on internal edges, events on a source);
- ``isbflow_buffer_usage_ratio`` (``stream``, ``step``: the reader): frames not
  yet committed by the reading step over the buffer's capacity in frames,
  ``ceil(bufferMaxLength / frameRows)``: the writer's back-pressure (or
  ``onFull`` discards) starts at ``isbflow_buffer_usage_limit_ratio``
  (``bufferUsageLimit``). Internal edges only (a source stream has no
  ``bufferMaxLength``);
- ``isbflow_step_dead_letters_total``: records the step sent to the dead-letter buffer;
- ``isbflow_step_unrouted_records_total``: records no out edge's ``conditions.tags`` took;
- ``isbflow_sink_retries_total``, ``isbflow_sink_fallback_records_total``,
  ``isbflow_sink_dropped_records_total``, ``isbflow_sink_refused_records_total``: a
  sink's failure policy (:mod:`isbflow.steps.sink_policy`): failed attempts to write a
  batch, records sent to its fallback, records dropped by ``onFailure: drop``, records
  it refused one by one (to the fallback or the dead letters);
- ``isbflow_step_state`` (``state``): 1 for the step's current state, 0 for the others;
- a step with ``scale`` (its autoscaler, :mod:`isbflow.steps.autoscale_apply`):
  ``isbflow_vertex_current_replicas`` and ``isbflow_vertex_desired_replicas`` (the last decision's
  replicas and what Numaflow's formula asked for within ``min``..``max``),
  ``isbflow_vertex_scale_decisions_total`` (``direction``: ``up``, ``down``, ``none``: the
  autoscaler's looks at the step, by what they did) and, on a cluster master,
  ``isbflow_application_executors`` (``kind``: ``target``, what the application asks the
  cluster manager for; ``live``, the executors registered now).

Each runner has its own :class:`~prometheus_client.CollectorRegistry` (no
process-wide state; two runners in one process do not collide).
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from isbflow.connector.options import DEFAULT_FRAME_ROWS
from isbflow.isb import naming
from isbflow.isb.state import Observed
from isbflow.spec.paths import DataDir

if TYPE_CHECKING:
    from isbflow.spec.models import Pipeline
    from isbflow.steps.runner import PipelineRunner, StepRun

log = logging.getLogger(__name__)

HOST = "127.0.0.1"
SINK_TARGET = "delta"
BATCH_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
STEP = ["pipeline", "step"]


class PipelineMetrics:
    """The metric families of one pipeline's steps, in their own registry."""

    def __init__(self, pipeline: Pipeline, registry: CollectorRegistry | None = None,
                 frame_rows: int = DEFAULT_FRAME_ROWS):
        self.pipeline = pipeline
        self.registry = registry if registry is not None else CollectorRegistry()
        self.frame_rows = frame_rows
        r = self.registry
        self.records_in = Counter("isbflow_step_records_in", "Input rows of the step's micro-batches",
                                  STEP, registry=r)
        self.records_out = Counter("isbflow_step_records_out",
                                   "Rows the step published anew to an edge's buffers (to=vertex) or wrote "
                                   "to its Delta table (to=delta)", [*STEP, "to"], registry=r)
        self.batch_duration = Histogram("isbflow_step_batch_duration_seconds",
                                        "Wall time of each micro-batch that ran (triggerExecution)", STEP,
                                        buckets=BATCH_BUCKETS, registry=r)
        self.last_batch = Gauge("isbflow_step_last_batch_timestamp_seconds",
                                "Unix time at which the step's last micro-batch ended", STEP, registry=r)
        self.lag = Gauge("isbflow_step_lag_messages",
                         "Messages in an input stream past what the step has committed", [*STEP, "stream"],
                         registry=r)
        self.buffer_usage = Gauge("isbflow_buffer_usage_ratio",
                                  "Frames not yet committed by the reading step over the buffer's capacity "
                                  "(bufferMaxLength / frameRows)", [*STEP, "stream"], registry=r)
        self.buffer_limit = Gauge("isbflow_buffer_usage_limit_ratio",
                                  "bufferUsageLimit: the usage at which writers apply onFull", [*STEP, "stream"],
                                  registry=r)
        self.dead_letters = Counter("isbflow_step_dead_letters",
                                    "Records the step sent to the dead-letter buffer", STEP, registry=r)
        self.unrouted = Counter("isbflow_step_unrouted_records",
                                "Records no out edge's conditions.tags took (dropped, or dead-lettered with "
                                "onUnrouted: deadLetter)", STEP, registry=r)
        self.sink_retries = Counter("isbflow_sink_retries", "Failed attempts of a sink to write a batch "
                                    "(retryStrategy)", STEP, registry=r)
        self.sink_fallback = Counter("isbflow_sink_fallback_records", "Records a sink sent to its fallback "
                                     "(after its retries, or refused one by one)", STEP, registry=r)
        self.sink_dropped = Counter("isbflow_sink_dropped_records", "Records a sink dropped after its retries "
                                    "(retryStrategy.onFailure: drop)", STEP, registry=r)
        self.sink_refused = Counter("isbflow_sink_refused_records", "Records a sink's table refused one by one "
                                    "(to the fallback, or the dead letters)", STEP, registry=r)
        self.state = Gauge("isbflow_step_state", "1 for the step's current state, 0 for the others",
                           [*STEP, "state"], registry=r)
        self.current_replicas = Gauge("isbflow_vertex_current_replicas", "The step's replicas now (task slots "
                                      "per micro-batch; executors on a cluster master)", STEP, registry=r)
        self.desired_replicas = Gauge("isbflow_vertex_desired_replicas", "The replicas the autoscaler's last "
                                      "decision asked for, within min..max", STEP, registry=r)
        self.scale_decisions = Counter("isbflow_vertex_scale_decisions", "The autoscaler's looks at the step, by "
                                       "what they did (up, down, none)", [*STEP, "direction"], registry=r)
        self.executors = Gauge("isbflow_application_executors", "Executors of the Spark application on a cluster "
                               "master (kind: target asked for, live registered)", ["pipeline", "kind"], registry=r)
        self._seen: dict[tuple[str, str | None], str] = {}  # (step, to) -> timestamp of the last progress
        self._totals: dict[tuple[str, str], int] = {}  # (step, counter) -> the status total counted so far

    # ------------------------------------------------------------------ observing
    def observe(self, runner: PipelineRunner, run: StepRun) -> None:
        """Fold what happened since the last call into the series of ``run``'s step.

        Never raises: a metrics problem is logged and must not stop a pipeline."""
        try:
            self._observe(run)
        except Exception:  # noqa: BLE001 - metrics are best effort
            log.exception("metrics of step %s", run.vertex)

    def _observe(self, run: StepRun) -> None:
        step = run.vertex
        labels = {"pipeline": self.pipeline.name, "step": step}
        self.records_in.labels(**labels)  # every series exists (at 0) from the first heartbeat on
        self.dead_letters.labels(**labels)
        self.unrouted.labels(**labels)
        for i, rq in enumerate(run.queries):
            outs: list[tuple[str | None, str | None]] = list(rq.edges) or [(None, None)]  # a sink
            for to, _ in outs:
                self.records_out.labels(**labels, to=to or SINK_TARGET)
            for prog in self._new_progress((step, rq.to), rq.query.recentProgress or []):
                if "addBatch" not in (prog.get("durationMs") or {}):
                    continue  # an idle trigger (no batch ran)
                if i == 0:
                    self.records_in.labels(**labels).inc(int(prog.get("numInputRows") or 0))
                    self.batch_duration.labels(**labels).observe(prog["durationMs"].get("triggerExecution", 0) / 1e3)
                    self.last_batch.labels(**labels).set(_epoch(prog.get("timestamp")))
                for to, stats_dir in outs:
                    self.records_out.labels(**labels, to=to or SINK_TARGET).inc(self._rows_out(stats_dir, prog))
        status = run.status
        if status is None:
            return
        self._count_up(self.dead_letters, labels, "dlq", status.dlq_total)
        self._count_up(self.unrouted, labels, "unrouted", status.unrouted_total)
        if self.pipeline.vertex(step).sink is not None:
            for counter, name in ((self.sink_retries, "sink_retries"), (self.sink_fallback, "fallback_total"),
                                  (self.sink_dropped, "dropped_total"), (self.sink_refused, "refused_total")):
                counter.labels(**labels)
                self._count_up(counter, labels, name, getattr(status, name))
        for stream, lag in status.lag.items():
            self.lag.labels(**labels, stream=stream).set(lag)
        limits = self.pipeline.vertex(step).effective_limits(self.pipeline.spec.limits)
        for ep in naming.edge_partitions(self.pipeline):
            if ep.to_vertex != step:
                continue
            self.buffer_usage.labels(**labels, stream=ep.stream).set(
                buffer_usage(status.lag.get(ep.stream, 0), limits.bufferMaxLength, self.frame_rows))
            self.buffer_limit.labels(**labels, stream=ep.stream).set(limits.bufferUsageLimit or 0.0)
        for state in Observed:
            self.state.labels(**labels, state=state.value).set(1.0 if status.state == state else 0.0)
        if status.replicas:
            self._observe_replicas(labels, status.replicas)

    def _observe_replicas(self, labels: dict, r: dict) -> None:
        """The autoscaler's last decision of a step (``StepStatus.replicas``)."""
        self.current_replicas.labels(**labels).set(r.get("target") or 0)
        self.desired_replicas.labels(**labels).set(r.get("desired") or 0)
        ups, downs = int(r.get("ups") or 0), int(r.get("downs") or 0)
        for direction, total in (("up", ups), ("down", downs), ("none", int(r.get("looks") or 0) - ups - downs)):
            self.scale_decisions.labels(**labels, direction=direction)
            self._count_up(self.scale_decisions, {**labels, "direction": direction}, f"scale_{direction}", total)
        executors = r.get("executors") or {}
        for kind in ("target", "live"):
            if executors.get(kind) is not None:
                self.executors.labels(pipeline=labels["pipeline"], kind=kind).set(executors[kind])

    def _count_up(self, counter: Counter, labels: dict, name: str, total: int | None) -> None:
        """Add what a running total of the step's status gained since the last observation (a
        total that goes back, after a restart re-reads fewer stats, adds nothing)."""
        key = (labels["step"], name)
        seen = self._totals.get(key, 0)
        total = int(total or 0)
        if total > seen:
            counter.labels(**labels).inc(total - seen)
            self._totals[key] = total

    def _new_progress(self, key: tuple[str, str | None], progress: list[dict]) -> list[dict]:
        """Progress reports newer than the last one seen for this query (timestamps only grow)."""
        last = self._seen.get(key, "")
        new = [p for p in progress if str(p.get("timestamp") or "") > last]
        if new:
            self._seen[key] = str(new[-1].get("timestamp"))
        return new

    @staticmethod
    def _rows_out(stats_dir: str | None, prog: dict) -> int:
        """Rows a batch wrote on one out edge (``stats_dir``: the writer's stats of that edge), or,
        for a sink (None), into the sink."""
        if stats_dir:  # the jetstream writer's stats of this batch: rows stored anew
            path = Path(stats_dir) / f"batch-{prog['batchId']}.json"
            try:
                return int(json.loads(path.read_text()).get("rows") or 0)
            except (OSError, ValueError):
                return 0
        out = int((prog.get("sink") or {}).get("numOutputRows") or 0)
        if out < 0:
            # a foreachBatch sink (Delta, PostgreSQL): Spark reports -1; a sink vertex runs no
            # transform, so the batch's input rows are the rows handed to the sink
            out = int(prog.get("numInputRows") or 0)
        return max(0, out)


def buffer_usage(lag_frames: int, buffer_max_length: int | None, frame_rows: int = DEFAULT_FRAME_ROWS) -> float:
    """Uncommitted frames over the buffer's capacity in frames (0 when unbounded)."""
    if not buffer_max_length:
        return 0.0
    return lag_frames / max(1, math.ceil(buffer_max_length / frame_rows))


def _epoch(ts: str | None) -> float:
    if not ts:
        return 0.0
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def series_names(registry: CollectorRegistry) -> set[str]:
    """Every series name the registry's families expose (``_total``, ``_bucket``... included)."""
    names: set[str] = set()
    for family in registry.collect():
        if family.type == "counter":
            names |= {f"{family.name}_total", f"{family.name}_created"}
        elif family.type == "histogram":
            names |= {f"{family.name}_{s}" for s in ("bucket", "sum", "count", "created")}
        else:
            names.add(family.name)
    return names


# ---------------------------------------------------------------------------------- serving

@dataclass
class MetricsServer:
    """The HTTP server of ``/metrics`` and where it is recorded."""

    url: str
    port: int
    record: Path | None
    _httpd: Any

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self.record is not None:
            self.record.unlink(missing_ok=True)


def record_path(data_dir: str | Path, key: str) -> Path:
    return Path(data_dir).absolute() / "metrics" / f"{key}.json"


def read_targets(data_dir: str | Path, key: str) -> list[dict] | None:
    """The ``file_sd`` record of a running step process (None when none runs)."""
    try:
        return json.loads(record_path(data_dir, key).read_text())
    except FileNotFoundError:
        return None


def serve(runner: PipelineRunner, port: int, data_dir: str | Path | None = None, key: str | None = None,
          host: str | None = None) -> MetricsServer:
    """Attach a :class:`PipelineMetrics` to ``runner`` and serve it on ``host:port`` (``host``:
    ``ISBFLOW_METRICS_HOST``, else 127.0.0.1; ``port`` -1 or 0 here: any free port). With
    ``data_dir`` the endpoint is recorded as a ``file_sd`` target list in
    ``<data dir>/metrics/<key>.json`` (``key`` defaults to the pipeline name)."""
    host = host or os.environ.get("ISBFLOW_METRICS_HOST") or HOST
    key = key or runner.p.name
    metrics = PipelineMetrics(runner.p)
    runner.metrics = metrics
    httpd, _ = start_http_server(max(0, port), addr=host, registry=metrics.registry)
    bound = int(httpd.server_port)
    # a wildcard bind is scraped through the host's name (the container's, in compose)
    target = f"{socket.gethostname() if host in ('0.0.0.0', '::') else host}:{bound}"
    record = None
    if data_dir is not None:
        record = record_path(data_dir, key)
        DataDir(data_dir).make(record.parent)  # 0700, like the data dir
        tmp = record.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": [target], "labels": {"isbflow_key": key, "pid": str(os.getpid())}}]))
        tmp.replace(record)  # Prometheus never reads a half-written file
    return MetricsServer(f"http://{target}/metrics", bound, record, httpd)
