"""Typed models of the two spec kinds: ``InterStepBufferService`` and ``Pipeline``.

The spec is validated once, at the edge (:mod:`isbflow.spec.load`); the rest of
isbflow sees only these objects, never raw dicts. Field names follow Numaflow
where the concept is the same (``interStepBufferServiceName``, ``bufferConfig``,
``limits.readBatchSize`` ...), so a Numaflow user recognises them.

Durations are Go-style strings (``72h``, ``30s``, ``1m30s``) or numbers of
seconds; sizes are integers of bytes or strings with a unit (``64MiB``, ``1GB``).
Both are normalised here: durations to float seconds, sizes to int bytes.
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from isbflow.spec import graph
from isbflow.spec.expectations import catalog_problems
from isbflow.spec.names import NAME_PATTERN, VERTEX_ROLES
from isbflow.spec.times import check_time_expression, parse_duration

# Every pattern here ends in ``\Z``: ``$`` also matches before a final newline.
_NAME_RE = re.compile(NAME_PATTERN)
#: partitions of one vertex: each is a stream (and a Spark read task); more is a typo, not a design
MAX_PARTITIONS = 64

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "ki": 1024, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mi": 1024**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gi": 1024**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "ti": 1024**4, "tib": 1024**4,
}


def parse_size(value: Any) -> int:
    """``"64MiB"`` -> 67108864; ``-1`` means unlimited where the field allows it."""
    if isinstance(value, bool):
        raise ValueError("must be a size in bytes such as 1048576 or '1MiB'")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < -1:
            raise ValueError(f"must be a size >= 0 (or -1 for unlimited), got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m:
            return int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()])
        if value.strip() == "-1":
            return -1
    raise ValueError(f"must be a size in bytes such as 1048576 or '1MiB', got {value!r}")


Duration = Annotated[float, BeforeValidator(parse_duration)]
Size = Annotated[int, BeforeValidator(parse_size)]


class _Model(BaseModel):
    """Strict-ish base: unknown fields are errors; values are checked, not coerced wildly."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def check_name(value: str) -> str:
    if not _NAME_RE.match(value):
        raise ValueError(
            f"{value!r} is not a valid name: use lowercase letters, digits and '-', "
            "start and end with a letter or digit, at most 48 characters"
        )
    return value


Name = Annotated[str, BeforeValidator(lambda v: check_name(v) if isinstance(v, str) else v)]


def check_path(value: str) -> str:
    """A sink table or landing folder: relative ones live under the data dir, so no ``..``
    segment may leave it; no leading ``-`` (never read as an option) and no control characters."""
    if not value.strip():
        raise ValueError("must not be empty")
    if value.startswith("-"):
        raise ValueError(f"{value!r} must not start with '-'")
    if any(not c.isprintable() for c in value):
        raise ValueError(f"{value!r} holds control characters")
    if ".." in re.split(r"[/\\]", value):
        raise ValueError(f"{value!r} must not contain '..' (relative paths stay under the data dir)")
    return value


def _is_absolute(path: str) -> bool:
    return path.startswith(("/", "\\")) or bool(re.match(r"^[A-Za-z]:", path)) or "://" in path


SafePath = Annotated[str, BeforeValidator(lambda v: check_path(v) if isinstance(v, str) else v)]


def _one_of_message(what: str, allowed: tuple[str, ...], found: list[str]) -> str:
    need = f"{what} needs exactly one of: {', '.join(allowed)}"
    if not found:
        return f"{need} (found none)"
    return f"{need} (found {' and '.join(repr(f) for f in found)})"


SOURCE_KINDS = ("jetstream", "files")


class Metadata(_Model):
    name: Name
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


# ---------------------------------------------------------------- ISB service


class Retention(StrEnum):
    LIMITS = "Limits"
    INTEREST = "Interest"
    WORK_QUEUE = "WorkQueue"


class Storage(StrEnum):
    FILE = "file"
    MEMORY = "memory"


class StreamConfig(_Model):
    """``bufferConfig.stream``: how each edge-partition stream is configured."""

    retention: Retention = Retention.LIMITS
    maxMsgs: StrictInt = Field(default=-1, ge=-1)
    maxAge: Duration = 72 * 3600.0
    maxBytes: Size = -1
    storage: Storage = Storage.FILE
    replicas: StrictInt = Field(default=1, ge=1, le=5)
    duplicates: Duration = 120.0


class ConsumerConfig(_Model):
    """``bufferConfig.consumer``: the durable consumer each reading step uses."""

    ackWait: Duration = 60.0
    maxAckPending: StrictInt = Field(default=25000, ge=1)


class BufferConfig(_Model):
    stream: StreamConfig = Field(default_factory=StreamConfig)
    consumer: ConsumerConfig = Field(default_factory=ConsumerConfig)


class JetStreamSettings(_Model):
    """Server settings for the embedded nats-server (ignored for an external URL)."""

    max_payload: Size = Field(default=8 * 1024 * 1024, gt=0)
    max_memory_store: Size = 1024**3
    max_file_store: Size = 10 * 1024**3


class TLSConfig(_Model):
    caFile: str | None = None
    certFile: str | None = None
    keyFile: str | None = None
    insecureSkipVerify: bool = False


class AuthConfig(_Model):
    """Credentials by reference only: an Airflow connection id, a creds file, or a
    file holding ``user:password`` / a token. Secrets never sit in a spec."""

    connectionId: str | None = None
    credsFile: str | None = None
    userPasswordFile: str | None = None
    tokenFile: str | None = None


class JetStreamService(_Model):
    url: str = "embedded"
    replicas: StrictInt = Field(default=1, ge=1, le=5)
    persistence: bool = True
    settings: JetStreamSettings = Field(default_factory=JetStreamSettings)
    bufferConfig: BufferConfig = Field(default_factory=BufferConfig)
    tls: TLSConfig | None = None
    auth: AuthConfig | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if v == "embedded":
            return v
        for part in v.split(","):
            part = part.strip()
            if not re.match(r"^(nats|tls|ws|wss)://[A-Za-z0-9.\-\[\]:@%_]+\Z", part):
                raise ValueError(
                    f"{part!r} is not a NATS URL: use 'embedded' or nats://host:port[,nats://...]"
                )
        return v


class InterStepBufferServiceSpec(_Model):
    jetstream: JetStreamService = Field(default_factory=JetStreamService)


class InterStepBufferService(_Model):
    apiVersion: str | None = None
    kind: Literal["InterStepBufferService"]
    metadata: Metadata = Field(default_factory=lambda: Metadata(name="default"))
    spec: InterStepBufferServiceSpec = Field(default_factory=InterStepBufferServiceSpec)

    @property
    def name(self) -> str:
        return self.metadata.name


# ------------------------------------------------------------------- Pipeline


class OnFull(StrEnum):
    RETRY_UNTIL_SUCCESS = "retryUntilSuccess"
    DISCARD_LATEST = "discardLatest"


class OnBufferLoss(StrEnum):
    FAIL = "fail"
    REPLAY = "replay"


class Limits(_Model):
    """Numaflow's vertex limits. ``bufferUsageLimit`` is a fraction in (0, 1]."""

    readBatchSize: StrictInt | None = Field(default=None, ge=1)
    bufferMaxLength: StrictInt | None = Field(default=None, ge=1)
    bufferUsageLimit: float | None = None

    @field_validator("bufferUsageLimit")
    @classmethod
    def _usage(cls, v: float | None) -> float | None:
        if v is not None and not (0 < v <= 1):
            raise ValueError(f"must be in (0, 1], e.g. 0.8 for 80%, got {v!r}")
        return v


DEFAULT_LIMITS = Limits(readBatchSize=100_000, bufferMaxLength=1_000_000, bufferUsageLimit=0.8)


class JetStreamSource(_Model):
    """External producers publish one JSON event per message on ``subject``."""

    subject: str
    stream: Name | None = None

    @field_validator("subject")
    @classmethod
    def _subject(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*\Z", v):
            raise ValueError(f"{v!r} is not a plain NATS subject (tokens of letters, digits, '_' '-' joined by '.')")
        return v


class FilesSource(_Model):
    """A landing folder of JSON-lines files."""

    path: SafePath
    pattern: str = "*.jsonl"


class Source(_Model):
    jetstream: JetStreamSource | None = None
    files: FilesSource | None = None
    schema_: str | None = Field(default=None, alias="schema")
    """Spark DDL of one event, e.g. ``"ts TIMESTAMP, service STRING, msg STRING"``."""

    @model_validator(mode="after")
    def _one_kind(self) -> Source:
        kinds = [k for k in SOURCE_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(_one_of_message("a source", SOURCE_KINDS, kinds))
        return self


class DeltaSink(_Model):
    """A Delta table. ``path`` is relative to the data dir; an absolute path (another disk, a
    mount) must be asked for with ``external: true``, so no spec leaves the data dir by accident."""

    path: SafePath
    partitionBy: list[str] = Field(default_factory=list)
    external: bool = False

    @model_validator(mode="after")
    def _inside(self) -> DeltaSink:
        if _is_absolute(self.path) and not self.external:
            raise ValueError(f"path {self.path!r} is outside the data dir: use a relative path, or set "
                             "'external: true' to write there on purpose")
        return self


class Sink(_Model):
    delta: DeltaSink


class Reference(_Model):
    """A reference table (Kafka Streams' GlobalKTable) kept in a KV bucket."""

    name: Name
    key: str


class OutputMode(StrEnum):
    """How a step emits rows: ``append`` (each row once) or ``update`` (a streaming
    aggregation's current value of every key a micro-batch changed, again on each change)."""

    APPEND = "append"
    UPDATE = "update"


_COLUMN_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")


class Udf(_Model):
    """A Spark step: ``transform`` names ``module:function`` (DataFrame -> DataFrame).

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


class Vertex(_Model):
    name: Name
    source: Source | None = None
    udf: Udf | None = None
    sink: Sink | None = None
    partitions: StrictInt = Field(default=1, le=MAX_PARTITIONS)
    limits: Limits | None = None
    onFull: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    onBufferLoss: OnBufferLoss = OnBufferLoss.FAIL

    @field_validator("partitions")
    @classmethod
    def _partitions(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be >= 1, got {v}")
        return v

    @model_validator(mode="after")
    def _one_role(self) -> Vertex:
        roles = [r for r in VERTEX_ROLES if getattr(self, r) is not None]
        if len(roles) != 1:
            raise ValueError(_one_of_message("a vertex", VERTEX_ROLES, roles))
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


class Edge(_Model):
    # `from` is a Python keyword: the attribute is `from_`, the YAML key `from`.
    from_: str = Field(alias="from")
    to: str
    partitionKey: str | None = None


class QualityGate(StrEnum):
    FAIL = "fail"
    WARN = "warn"


class Expectation(_Model):
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


class QualityRetention(_Model):
    """How many quality reports a sink keeps: the newest ``runs``, none older than ``maxAge``.

    Either bound may be left out (``null``); the older runs are pruned after each
    run and the pruning is reported.
    """

    runs: StrictInt | None = Field(default=50, ge=1)
    maxAge: Duration | None = None


class SinkQuality(_Model):
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


class Replay(_Model):
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
        from croniter import croniter  # Airflow's own cron parser

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


class PipelineSpec(_Model):
    interStepBufferServiceName: Name = "default"
    limits: Limits | None = None
    vertices: list[Vertex]
    edges: list[Edge] = Field(default_factory=list)
    quality: list[SinkQuality] = Field(default_factory=list)
    replays: list[Replay] = Field(default_factory=list)
    autoRecover: bool = False

    @field_validator("replays")
    @classmethod
    def _unique_replays(cls, v: list[Replay]) -> list[Replay]:
        names = [r.name for r in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"replay name(s) {', '.join(twice)} used more than once (each names a DAG)")
        return v


class Pipeline(_Model):
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

    def ancestors(self, name: str) -> set[str]:
        """Every vertex with a path to ``name`` (not ``name`` itself, unless on a cycle)."""
        from isbflow.spec import (
            graph,  # graph imports this module's constants: a cycle at import time
        )

        return graph.reach(name, lambda n: [e.from_ for e in self.inputs(n)])

    def descendants(self, name: str) -> set[str]:
        """Every vertex reachable from ``name`` (not ``name`` itself, unless on a cycle)."""
        return graph.reach(name, lambda n: [e.to for e in self.outputs(n)])

    def topological_order(self) -> list[str]:
        """Vertex names, every vertex after all its inputs (the spec has no cycle)."""
        return graph.topological_order([v.name for v in self.spec.vertices],
                                       [(e.from_, e.to) for e in self.spec.edges])
