"""What the UI pages show, as pydantic models: the JSON endpoints return exactly these.

The HTML pages render the same objects, so a script reading ``/api/pipelines``
sees what a user sees.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class RatePoint(BaseModel):
    """One minute of a step's rates (mean over the heartbeats of that minute)."""

    t: float = Field(description="start of the minute, epoch seconds")
    input_rows_per_s: float
    processed_rows_per_s: float


class StepView(BaseModel):
    vertex: str
    role: str  # source | udf | sink
    partitions: int
    desired: str | None = None  # running | draining | stopped (control key)
    state: str  # Observed state, "unknown" when the step never reported
    stale: bool = False  # no heartbeat for longer than the stale limit while it should be live
    heartbeat_age_s: float | None = None
    batch_id: int | None = None
    input_rows_per_s: float = 0.0
    processed_rows_per_s: float = 0.0
    rows_total: int = 0
    dlq_total: int = 0
    unrouted_total: int = 0  # records no out edge's conditions.tags took (Numaflow's "dropped")
    restarts: int = 0
    # a sink's failure policy (retryStrategy, fallback): failed attempts, records to the fallback,
    # records dropped, records refused one by one; the failure while attempts go on
    sink_retries: int = 0
    fallback_total: int = 0
    dropped_total: int = 0
    refused_total: int = 0
    sink_error: str | None = None
    lag: dict[str, int] = Field(default_factory=dict)  # input stream -> messages behind
    lag_total: int = 0
    # a step with scale: its autoscaler's replicas now and what its last decision asked for (within
    # min..max), and that decision in words (isbflow.ops.status.replicas_line); None without scale
    current_replicas: int | None = None
    desired_replicas: int | None = None
    replicas_line: str | None = None
    error: str | None = None
    rates: list[RatePoint] = Field(default_factory=list)


class PartitionView(BaseModel):
    partition: int
    stream: str
    lag: int | None = None  # None: the consuming step has not reported this stream


class EdgeView(BaseModel):
    from_vertex: str
    to_vertex: str
    partition_key: str | None = None
    conditions: str | None = None  # "tags <operator> [values]" for an edge with conditions.tags
    partitions: list[PartitionView]


class StepAdviceView(BaseModel):
    """One step of the tuning report (:mod:`isbflow.ops.advise`, ``isbflow pipeline advise``)."""

    vertex: str
    rate: float  # processed rows/s over the vertex's lookbackSeconds
    pending: int
    pending_unit: str  # events (a source stream) | frames (an edge)
    utilization: float | None = None  # last batch time over the latency budget
    desired_replicas: int | None = None  # Numaflow's formula, in units of the step's parallelism now (advice)
    advice: list[str] = Field(default_factory=list)


class HotPartitionView(BaseModel):
    """A partition whose lag or messages written stand well above its siblings'."""

    from_vertex: str
    to_vertex: str
    partition: int
    why: str | None = None


class RunLink(BaseModel):
    """A DAG run in Airflow's metadata DB, with its UI address."""

    dag_id: str
    run_id: str
    state: str | None = None
    run_after: str | None = None
    start_date: str | None = None
    end_date: str | None = None
    spec: str | None = None  # the spec file the run worked on (its conf, else the DAG's default)
    url: str


class PipelineView(BaseModel):
    file: str  # spec file, relative to the pipelines folder
    name: str | None = None  # pipeline name (None when the spec does not load)
    error: str | None = None  # spec error, one line per problem
    nats_error: str | None = None  # why status could not be read (ISB service unreachable, ...)
    steps: list[StepView] = Field(default_factory=list)
    edges: list[EdgeView] = Field(default_factory=list)
    dlq_stream: str | None = None
    dlq_messages: int | None = None
    last_drain: RunLink | None = None
    last_replay: RunLink | None = None
    recovery: str | None = None  # the last recovery, one line (``isbflow pipeline status`` shows the same)
    recovery_state: str | None = None  # running | recovered | nothing-lost | failed
    advice: list[StepAdviceView] = Field(default_factory=list)  # the tuning report, per step
    hot_partitions: list[HotPartitionView] = Field(default_factory=list)
    advice_error: str | None = None  # why the tuning report could not be made


class PipelinesResponse(BaseModel):
    pipelines_dir: str
    generated_at: float
    stale_after_s: float
    nats: str | None = None  # the ISB service's address (credentials masked)
    nats_error: str | None = None
    runs_error: str | None = None  # why DAG runs could not be read from the metadata DB
    dag_id: str | None = None  # set when shown as a DAG's tab
    dag_run: RunLink | None = None  # that DAG's latest run
    pipelines: list[PipelineView]


class FailedCheck(BaseModel):
    name: str
    unexpected_count: int = 0
    origin: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)


class ShadowDiff(BaseModel):
    """A quality run on a shadow table (a shadow reprocess): the run and its diff against the live rows."""

    run: str
    live_path: str | None = None
    live_version: int | None = None
    range: dict[str, Any] = Field(default_factory=dict)
    rows_before: int = 0
    rows_after: int = 0
    added: int = 0
    removed: int = 0
    changed: int = 0
    unchanged: int = 0
    columns: dict[str, int] = Field(default_factory=dict)  # rows changed per column
    samples: dict[str, list[Any]] = Field(default_factory=dict)  # added / removed rows; changed: key + changes


class QualityRun(BaseModel):
    pipeline: str
    sink: str
    run_id: str
    time: str | None = None
    success: bool | None = None  # None: the report could not be read
    gate: str | None = None
    table_version: int | None = None
    rows: int | None = None
    checks: int = 0
    failures: list[FailedCheck] = Field(default_factory=list)
    error: str | None = None
    report_url: str | None = None  # Data Docs page when the run has one, else the JSON
    json_url: str
    shadow: ShadowDiff | None = None  # set for a run on a shadow table


class SinkRuns(BaseModel):
    pipeline: str
    sink: str
    runs: list[QualityRun]


class QualityResponse(BaseModel):
    reports_dir: str
    sinks: list[SinkRuns]
