"""Typed models of the ``Pipeline`` kind (the ``InterStepBufferService`` kind is in
:mod:`isbflow.spec.isbsvc`, the shared value types in :mod:`isbflow.spec.fields`; both
are re-exported here so ``from isbflow.spec.models import X`` finds every spec type).

The spec is validated once, at the edge (:mod:`isbflow.spec.load`); the rest of
isbflow sees only these objects, never raw dicts. Field names follow Numaflow
where the concept is the same (``interStepBufferServiceName``, ``bufferConfig``,
``limits.readBatchSize`` ...), so a Numaflow user recognises them.

Durations are Go-style strings (``72h``, ``30s``, ``1m30s``) or numbers of
seconds; sizes are integers of bytes or strings with a unit (``64MiB``, ``1GB``).
Both are normalised: durations to float seconds, sizes to int bytes.

Numaflow's dialect (:mod:`isbflow.spec.numaflow`): ``bufferUsageLimit`` is a
percentage as in Numaflow, and Numaflow fields isbflow has no use for are refused
with what it does instead.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Field,
    StrictInt,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from isbflow.spec import constants, derived, graph
from isbflow.spec.conditions import ForwardConditions, TagConditions, TagOperator  # noqa: F401 - re-exported
from isbflow.spec.constants import OnFull  # noqa: F401 - re-exported
from isbflow.spec.expectations import catalog_problems
from isbflow.spec.fields import (  # noqa: F401 - re-exported
    MAX_PARTITIONS,
    NAME_RE,
    Duration,
    Metadata,
    Name,
    SafePath,
    Size,
    SpecModel,
    check_name,
    check_path,
    is_absolute,
    one_of_message,
    parse_size,
)
from isbflow.spec.isbsvc import (  # noqa: F401 - re-exported
    AuthConfig,
    BufferConfig,
    DeadLetterConfig,
    InterStepBufferService,
    InterStepBufferServiceSpec,
    JetStreamService,
    JetStreamSettings,
    Retention,
    Storage,
    StreamConfig,
    TLSConfig,
)
from isbflow.spec.names import VERTEX_ROLES
from isbflow.spec.postgres import PostgresSink  # noqa: F401 - re-exported
from isbflow.spec.sinks import (  # noqa: F401 - re-exported
    SINK_KINDS,
    Backoff,
    DeltaSink,
    FallbackSink,
    OnFailure,
    RetryStrategy,
    Sink,
)
from isbflow.spec.times import check_time_expression, parse_duration  # noqa: F401 - re-exported
from isbflow.spec.transforms import declared_package_problem

SOURCE_KINDS = ("jetstream", "files")


class OnBufferLoss(StrEnum):
    FAIL = "fail"
    REPLAY = "replay"


class OnUnrouted(StrEnum):
    """What a step does with a record none of its out edges' ``conditions`` take."""

    DROP = "drop"
    DEAD_LETTER = "deadLetter"


def _usage_percent(value: Any) -> Any:
    """``bufferUsageLimit`` as written (percent, Numaflow's unit) -> the fraction isbflow uses."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        hint = (f" (a fraction? write {round(value * 100)} for {round(value * 100)}%)"
                if isinstance(value, float) and 0 < value <= 1 else "")
        raise ValueError(f"must be a whole percentage from 1 to 100 as in Numaflow, e.g. 80 for 80%, "
                         f"got {value!r}{hint}")
    if not 1 <= value <= 100:
        raise ValueError(f"must be a percentage from 1 to 100 as in Numaflow, e.g. 80 for 80%, got {value!r}")
    return value / 100


class Limits(SpecModel):
    """Numaflow's vertex limits.

    ``bufferUsageLimit`` is written in percent as in Numaflow (1..100, ``85`` means 85%)
    and held as a fraction (``0.85``): the share of ``bufferMaxLength`` at which writers
    apply ``onFull``. Dumping the model writes percent again, so a dump validates back.

    ``readTimeout`` is a step's latency budget, as in Numaflow (how long a read may wait
    before the batch goes on): here the micro-batch trigger interval of a source step's query,
    pipeline-wide and overridable per vertex (default 5 s, chosen from the cost curve; Numaflow's
    is 1 s; 10 ms to 1 h). Steps that read buffers are event-driven in a continuous run (they
    start when their input grows) unless a vertex sets its own.
    """

    readBatchSize: StrictInt | None = Field(default=None, ge=1)
    bufferMaxLength: StrictInt | None = Field(default=None, ge=1)
    bufferUsageLimit: Annotated[float | None, BeforeValidator(_usage_percent)] = None
    readTimeout: Duration | None = Field(default=None, ge=0.01, le=3600.0)

    @field_serializer("bufferUsageLimit")
    def _as_percent(self, v: float | None) -> int | None:
        return None if v is None else round(v * 100)


DEFAULT_LIMITS = Limits(readBatchSize=constants.READ_BATCH_SIZE, bufferMaxLength=constants.BUFFER_MAX_LENGTH,
                        bufferUsageLimit=constants.BUFFER_USAGE_LIMIT, readTimeout=constants.READ_TIMEOUT_S)


class JetStreamSource(SpecModel):
    """External producers publish one JSON event per message on ``subject``."""

    subject: str
    stream: Name | None = None

    @field_validator("subject")
    @classmethod
    def _subject(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*\Z", v):
            raise ValueError(f"{v!r} is not a plain NATS subject (tokens of letters, digits, '_' '-' joined by '.')")
        problem = derived.reserved("subject", v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("stream")
    @classmethod
    def _stream(cls, v: str | None) -> str | None:
        problem = derived.reserved("stream", v) if v is not None else None
        if problem:
            raise ValueError(problem)
        return v


class FilesSource(SpecModel):
    """A landing folder of JSON-lines files."""

    path: SafePath
    pattern: str = "*.jsonl"


class Source(SpecModel):
    jetstream: JetStreamSource | None = None
    files: FilesSource | None = None
    schema_: str | None = Field(default=None, alias="schema")
    """Spark DDL of one event, e.g. ``"ts TIMESTAMP, service STRING, msg STRING"``."""

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        kinds = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(one_of_message("a source", SOURCE_KINDS, kinds))
        return self


class Reference(SpecModel):
    """A reference table (Kafka Streams' GlobalKTable) kept in a KV bucket."""

    name: Name
    key: str


class OutputMode(StrEnum):
    """How a step emits rows: ``append`` (each row once) or ``update`` (a streaming
    aggregation's current value of every key a micro-batch changed, again on each change)."""

    APPEND = "append"
    UPDATE = "update"


_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class Udf(SpecModel):
    """A Spark step: ``transform`` names ``module:function`` (DataFrame -> DataFrame), resolved when
    the spec is loaded (:mod:`isbflow.spec.transforms` says from where).

    ``output: update`` (with ``keys``, the columns that identify a result row,
    e.g. ``[window_start, service]``) is for a streaming aggregation: every
    micro-batch emits the current value of each key it changed, so windows still
    open are visible too, and the sink downstream upserts on ``keys``.
    """

    transform: str
    references: list[Reference] = Field(default_factory=list)
    output: OutputMode = OutputMode.APPEND
    keys: list[str] = Field(default_factory=list, validate_default=True)

    @field_validator("transform")
    @classmethod
    def _entry(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z", v):
            raise ValueError(f"{v!r} must be 'package.module:function'")
        return v

    @field_validator("keys")
    @classmethod
    def _keys(cls, v: list[str], info: ValidationInfo) -> list[str]:
        output = info.data.get("output")
        if output == OutputMode.UPDATE and not v:
            raise ValueError("required when output is 'update': the columns that identify a result row, "
                             "e.g. [window_start, service]")
        if v and output == OutputMode.APPEND:
            raise ValueError("only for output 'update' (the columns a sink upserts on); remove keys or set "
                             "output: update")
        bad = [k for k in v if not isinstance(k, str) or not _COLUMN_RE.match(k)]
        if bad:
            raise ValueError(f"must be plain column names (letters, digits, '_'), got {bad!r}")
        twice = sorted({k for k in v if v.count(k) > 1})
        if twice:
            raise ValueError(f"column(s) {twice} named twice")
        return v


class Vertex(SpecModel):
    name: Name
    source: Source | None = None
    udf: Udf | None = None
    sink: Sink | None = None
    partitions: StrictInt = Field(default=1, le=MAX_PARTITIONS)
    limits: Limits | None = None
    onFull: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    onBufferLoss: OnBufferLoss = OnBufferLoss.FAIL
    #: a record no out edge's ``conditions.tags`` take: dropped and counted (Numaflow's rule), or
    #: dead-lettered with its tags as the reason; only on a udf with conditional out edges
    onUnrouted: OnUnrouted = OnUnrouted.DROP

    @field_validator("partitions")
    @classmethod
    def _partitions(cls, v: int, info: ValidationInfo) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        if v != 1 and info.data.get("source") is not None:
            raise ValueError(f"a source vertex owns no buffer (it reads its own stream), so it has no partitions, "
                             f"got {v}: partition the buffers it writes by setting partitions on the vertices it "
                             "feeds (and partitionKey on the edge)")
        return v

    @model_validator(mode="after")
    def _one_role(self) -> Vertex:
        roles = [r for r in VERTEX_ROLES if getattr(self, r) is not None]
        if len(roles) != 1:
            raise ValueError(one_of_message("a vertex", VERTEX_ROLES, roles))
        return self

    @property
    def role(self) -> Literal["source", "udf", "sink"]:
        return "source" if self.source else "udf" if self.udf else "sink"

    def effective_limits(self, pipeline_limits: Limits | None) -> Limits:
        merged = DEFAULT_LIMITS.model_dump()
        for layer in (pipeline_limits, self.limits):
            if layer is not None:
                merged.update({k: v for k, v in layer.model_dump().items() if v is not None})
        return Limits(**merged)


class Edge(SpecModel):
    # `from` is a Python keyword: the attribute is `from_`, the YAML key `from`.
    from_: str = Field(alias="from")
    to: str
    partitionKey: str | None = None
    #: only records whose ``_tags`` match reach this edge (:mod:`isbflow.steps.routing`)
    conditions: ForwardConditions | None = None


class QualityGate(StrEnum):
    FAIL = "fail"
    WARN = "warn"


class Expectation(SpecModel):
    """One GX expectation by its name, e.g. ``expect_column_values_to_not_be_null``.

    The name must be one of GX's registered expectations and the argument
    names known and complete (checked against the catalog of
    :mod:`isbflow.spec.expectations`, without importing GX); values are
    checked by constructing the GX expectation (``isbflow quality check`` and
    every quality run).
    """

    expectation: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    @field_validator("expectation")
    @classmethod
    def _known(cls, v: str) -> str:
        problems = [m for f, m in catalog_problems(v, {}) if f == "expectation"]
        if problems:
            raise ValueError(problems[0])
        return v

    @field_validator("kwargs")
    @classmethod
    def _arguments(cls, v: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        name = info.data.get("expectation")
        if isinstance(name, str):  # an unknown name was reported on its own field
            problems = [f"{f.removeprefix('kwargs.')}: {m}" for f, m in catalog_problems(name, v)]
            if problems:
                raise ValueError("; ".join(problems))
        return v


class QualityRetention(SpecModel):
    """How many quality reports a sink keeps: the newest ``runs``, none older than ``maxAge``.

    Either bound may be left out (``null``); the older runs are pruned after each
    run and the pruning is reported.
    """

    runs: StrictInt | None = Field(default=50, ge=1)
    maxAge: Duration | None = None


class SinkQuality(SpecModel):
    """The quality gate of one sink: its expectations on top of the built-in checks.

    ``freshness``: the newest event may be at most this old (built-in check);
    ``schedule``: a cron expression or preset for the control plane (not used
    by ``isbflow quality run``, which runs now).
    """

    sink: str
    expectations: list[Expectation] = Field(default_factory=list)
    onFailure: QualityGate = QualityGate.FAIL
    schedule: str | None = None
    freshness: Duration | None = None
    retention: QualityRetention = Field(default_factory=QualityRetention)


#: Airflow's cron presets; anything else must be a cron expression
SCHEDULE_PRESETS = ("@hourly", "@daily", "@weekly", "@monthly", "@quarterly", "@yearly")


class Replay(SpecModel):
    """A scheduled replay: the Airflow DAG ``replay_<pipeline>_<name>`` runs it on ``schedule``.

    ``fromTime``/``toTime`` bound a ``reprocess`` by event time, written as the
    time expressions of :mod:`isbflow.spec.times` (``yesterday``, ``today``,
    ``-6h``, an ISO date...), resolved against each run's data interval; left
    out, that side is open. A ``recover`` replay takes no range (it replays from
    the offset ledger's low offsets).
    """

    name: Name
    mode: Literal["recover", "reprocess"] = "reprocess"
    schedule: str
    fromTime: str | None = None
    toTime: str | None = None

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, v: str) -> str:
        if v.strip() in SCHEDULE_PRESETS:
            return v.strip()
        # lazy: croniter (Airflow's own cron parser) is Airflow's dependency, not a direct one of
        # isbflow's; only a cron `schedule` needs it
        from croniter import croniter

        if v.startswith("@") or not croniter.is_valid(v):
            raise ValueError(f"{v!r} is not a cron expression (e.g. '0 2 * * *') or one of "
                             f"{', '.join(SCHEDULE_PRESETS)}")
        return v

    @field_validator("fromTime", "toTime")
    @classmethod
    def _time(cls, v: str | None) -> str | None:
        return None if v is None else check_time_expression(v)

    @model_validator(mode="after")
    def _range_fits_mode(self) -> Replay:
        if self.mode == "recover" and (self.fromTime or self.toTime):
            raise ValueError("a recover replay takes no fromTime/toTime: it replays from the offset "
                             "ledger's low offsets (use mode: reprocess for a time range)")
        return self


_PACKAGE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


class PipelineSpec(SpecModel):
    """``transformPackages``: packages (besides the project's ``spark_apps`` and the package
    holding the spec) whose modules the udfs' transforms may name; see :mod:`isbflow.spec.transforms`."""

    interStepBufferServiceName: Name = "default"
    limits: Limits | None = None
    vertices: list[Vertex]
    edges: list[Edge] = Field(default_factory=list)
    quality: list[SinkQuality] = Field(default_factory=list)
    replays: list[Replay] = Field(default_factory=list)
    autoRecover: bool = False
    transformPackages: list[str] = Field(default_factory=list)

    @field_validator("transformPackages")
    @classmethod
    def _packages(cls, v: list[str]) -> list[str]:
        for name in v:
            if not isinstance(name, str) or not _PACKAGE_RE.match(name):
                raise ValueError(f"{name!r} is not a Python package name (e.g. acme_transforms or acme.etl)")
            problem = declared_package_problem(name)
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("replays")
    @classmethod
    def _unique_replays(cls, v: list[Replay]) -> list[Replay]:
        names = [r.name for r in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replay name(s) {', '.join(twice)} used more than once (each names a DAG)")
        return v


class Pipeline(SpecModel):
    apiVersion: str | None = None
    kind: Literal["Pipeline"]
    metadata: Metadata
    spec: PipelineSpec

    @property
    def name(self) -> str:
        return self.metadata.name

    def vertex(self, name: str) -> Vertex:
        for v in self.spec.vertices:
            if v.name == name:
                return v
        raise KeyError(name)

    def inputs(self, name: str) -> list[Edge]:
        return [e for e in self.spec.edges if e.to == name]

    def outputs(self, name: str) -> list[Edge]:
        return [e for e in self.spec.edges if e.from_ == name]

    def query_to(self, name: str) -> str | None:
        """What names vertex ``name``'s one Spark query (``paths.query_name(name, to)``): the target of
        its only out edge, else None (a sink; or a vertex with several out edges, which one query
        writes in one pass). A one-edge vertex keeps the name of the days of one query per edge, so
        its checkpoint carries on."""
        outs = self.outputs(name)
        return outs[0].to if len(outs) == 1 else None

    def ancestors(self, name: str) -> set[str]:
        """Every vertex with a path to ``name`` (not ``name`` itself, unless on a cycle)."""
        return graph.reach(name, lambda n: [e.from_ for e in self.inputs(n)])

    def descendants(self, name: str) -> set[str]:
        """Every vertex reachable from ``name`` (not ``name`` itself, unless on a cycle)."""
        return graph.reach(name, lambda n: [e.to for e in self.outputs(n)])

    def filtered(self, name: str) -> bool:
        """True when an edge on some path to ``name`` has ``conditions``: ``name`` receives a subset
        of the records (conditional forwarding), not every one."""
        upstream = self.ancestors(name) | {name}
        return any(e.conditions is not None and e.to in upstream for e in self.spec.edges)

    def gate(self, name: str) -> Edge | None:
        """The edge with ``conditions`` every path to ``name`` passes through, when it is the only
        such edge on any path to ``name``: what it does not take never reaches ``name`` (the offset
        ledger records those offsets as routed away, :mod:`isbflow.isb.routed`). None otherwise."""
        upstream = self.ancestors(name) | {name}
        conditional = [e for e in self.spec.edges if e.conditions is not None and e.to in upstream]
        if len(conditional) != 1:
            return None
        gate = conditional[0]
        def around(n: str) -> list[str]:
            return [e.to for e in self.outputs(n) if e is not gate]

        sources = [v.name for v in self.spec.vertices if not self.inputs(v.name)]
        return None if any(name in graph.reach(s, around) for s in sources) else gate

    def topological_order(self) -> list[str]:
        """Vertex names, every vertex after all its inputs (the spec has no cycle)."""
        return graph.topological_order([v.name for v in self.spec.vertices],
                                       [(e.from_, e.to) for e in self.spec.edges])
