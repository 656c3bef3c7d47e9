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
from isbflow.spec.gates import (  # noqa: F401 - re-exported
    SCHEDULE_PRESETS,
    Expectation,
    QualityGate,
    QualityRetention,
    Replay,
    SinkQuality,
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
from isbflow.spec.scale import Scale
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
    """What a step does when records it has not read are gone from its input buffer."""

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
    """The most records a step reads from its input in one micro-batch. Default 100000."""
    bufferMaxLength: StrictInt | None = Field(default=None, ge=1)
    """The most records one partition of a buffer holds that its reader has not committed; past
    ``bufferUsageLimit`` percent of it, writers apply ``onFull``. Default 1000000."""
    bufferUsageLimit: Annotated[float | None, BeforeValidator(
        _usage_percent, json_schema_input_type=Annotated[int, Field(ge=1, le=100)] | None)] = None
    """Percent (1 to 100, as in Numaflow) of ``bufferMaxLength`` at which a buffer counts as full. Default 80."""
    readTimeout: Duration | None = Field(default=None, ge=0.01, le=3600.0)
    """A step's latency budget: the micro-batch trigger interval of a source step, a duration (``5s``) or
    seconds, from 10 ms to 1 h. Default 5 s (Numaflow's is 1 s)."""

    @field_serializer("bufferUsageLimit")
    def _as_percent(self, v: float | None) -> int | None:
        return None if v is None else round(v * 100)


DEFAULT_LIMITS = Limits(readBatchSize=constants.READ_BATCH_SIZE, bufferMaxLength=constants.BUFFER_MAX_LENGTH,
                        bufferUsageLimit=constants.BUFFER_USAGE_LIMIT, readTimeout=constants.READ_TIMEOUT_S)


class JetStreamSource(SpecModel):
    """External producers publish one JSON event per message on ``subject``."""

    subject: str
    """The NATS subject producers publish on, e.g. ``logs.events`` (tokens of letters, digits, '_' and
    '-' joined by '.'; no wildcards)."""
    stream: Name | None = None
    """The JetStream stream holding ``subject``. Default: ``src-<pipeline>-<vertex>``, created by
    ``isbflow isb apply``."""

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
    """The landing folder, relative to the data dir (``ISBFLOW_HOME``) unless absolute."""
    pattern: str = "*.jsonl"
    """A glob of the file names read (other files, e.g. ``*.tmp``, are never read). Default ``*.jsonl``."""


class Source(SpecModel):
    """Where a source vertex reads events: exactly one of ``jetstream`` or ``files``."""

    jetstream: JetStreamSource | None = None
    """Read JSON events published on a NATS JetStream subject."""
    files: FilesSource | None = None
    """Read JSON-lines files landed in a folder."""
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
    """The table's name; the transform receives it as a keyword argument (``-`` read as ``_``)."""
    key: str
    """The key column the table's rows are stored and joined by."""


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
    """The transform, ``package.module:function``: a function DataFrame -> DataFrame, e.g.
    ``spark_apps.logs:parse``."""
    references: list[Reference] = Field(default_factory=list)
    """Reference tables the transform joins against, each passed as a keyword argument. Default: none."""
    output: OutputMode = OutputMode.APPEND
    """``append`` (each row once) or ``update`` (a streaming aggregation's current rows). Default ``append``."""
    keys: list[str] = Field(default_factory=list, validate_default=True)
    """With ``output: update``: the columns that identify a result row, which the sink upserts on."""

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
    """A step of the pipeline: exactly one of ``source``, ``udf`` or ``sink``."""

    name: Name
    """The vertex's name, unique in the pipeline (edges name it)."""
    source: Source | None = None
    """Makes this vertex a source: where events come from."""
    udf: Udf | None = None
    """Makes this vertex a Spark transform step."""
    sink: Sink | None = None
    """Makes this vertex a sink: the table its input lands in."""
    partitions: StrictInt = Field(default=1, le=MAX_PARTITIONS)
    """Partitions of this vertex's input buffer (one stream each, read in parallel), 1 to 64. Default 1;
    a source vertex has none of its own."""
    limits: Limits | None = None
    """This vertex's limits, over the pipeline's ``limits``."""
    scale: Scale | None = None
    """Numaflow's autoscaling settings: replicas are the vertex's task slots per micro-batch (on a cluster
    master, the application's executors), acted on by the step's autoscaler (docs/autoscaling.md);
    ``min: 0`` stops an idle pipeline's driver only under ``isbflow pipeline scale-to-zero``."""
    onFull: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    """What writers to this vertex's buffer do when it is full: ``retryUntilSuccess`` (wait: back-pressure)
    or ``discardLatest`` (drop and count). Default ``retryUntilSuccess``."""
    onBufferLoss: OnBufferLoss = OnBufferLoss.FAIL
    """When records this step has not read are gone from its input buffer: ``fail`` (the step stops, naming
    the stream and the lost range) or ``replay`` (the loss is logged and recorded in the offsets, and the step
    goes on from what the buffer holds now). Default ``fail``."""
    onUnrouted: OnUnrouted = OnUnrouted.DROP
    """A record no out edge's ``conditions.tags`` take: ``drop`` (counted, Numaflow's rule) or
    ``deadLetter`` (with its tags as the reason); only on a udf with conditional out edges. Default ``drop``."""

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
    """A buffer between two vertices: ``from`` writes it, ``to`` reads it."""

    # `from` is a Python keyword: the attribute is `from_`, the YAML key `from`.
    from_: str = Field(alias="from")
    """The vertex the edge leaves."""
    to: str
    """The vertex the edge enters (its buffer is this vertex's input)."""
    partitionKey: str | None = None
    """The column whose value picks the partition of ``to``'s buffer: records with the same value go to the
    same partition, in order. Default: spread evenly."""
    conditions: ForwardConditions | None = None
    """Only records whose ``_tags`` match reach this edge (Numaflow's conditional forwarding). Default: every
    record."""


_PACKAGE_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


class PipelineSpec(SpecModel):
    """``transformPackages``: packages (besides the project's ``spark_apps`` and the package
    holding the spec) whose modules the udfs' transforms may name; see :mod:`isbflow.spec.transforms`."""

    interStepBufferServiceName: Name = "default"
    """The InterStepBufferService whose JetStream holds the buffers. Default ``default``."""
    limits: Limits | None = None
    """Limits of every vertex, unless a vertex sets its own."""
    vertices: list[Vertex]
    """The steps: sources, udfs (Spark transforms) and sinks."""
    edges: list[Edge] = Field(default_factory=list)
    """The buffers between vertices; the graph has no cycle."""
    quality: list[SinkQuality] = Field(default_factory=list)
    """Quality gates of the sinks. Default: none."""
    replays: list[Replay] = Field(default_factory=list)
    """Scheduled replays, each an Airflow DAG. Default: none."""
    autoRecover: bool = False
    """When the watchdog DAG finds a problem (a stale step, a lost buffer ...), it starts a recovery
    (``pipeline_replay`` in recover mode) instead of failing. Default false."""
    transformPackages: list[str] = Field(default_factory=list)
    """Python packages, besides ``spark_apps`` and the spec's own, whose modules transforms may name.
    Default: none."""

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
    """A pipeline: vertices (source, udf and sink steps) joined by edges (buffers on JetStream)."""

    apiVersion: str | None = None
    """``isbflow.io/v1alpha1``; any value is accepted (a Numaflow spec's too)."""
    kind: Literal["Pipeline"]
    """``Pipeline``."""
    metadata: Metadata
    """The pipeline's name (in every stream, bucket and DAG of it), labels and annotations."""
    spec: PipelineSpec
    """The pipeline itself."""

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
