"""The ``sink`` of a sink vertex: its table (Delta or PostgreSQL), and what happens when writing fails.

The failure policy is Numaflow's, in its words (``sink.retryStrategy``,
``sink.fallback``; applied by :mod:`isbflow.steps.sink_policy`):

- ``retryStrategy.backoff``: ``interval`` (the wait before the first retry,
  default 1 s; Numaflow's 1 ms would spin against a database that is down),
  ``steps`` (attempts, the first one included, before ``onFailure``; default
  unlimited), ``factor`` (>= 1, each wait is the previous one times it),
  ``cap`` (the longest wait) and ``jitter`` (0 <= j < 1, a random share added);
- ``retryStrategy.onFailure``: when ``steps`` attempts failed, ``retry`` (default:
  start the backoff again, for ever), ``fallback`` (the batch goes to the
  fallback sink, each record with the reason and the attempt count) or ``drop``
  (the batch's records are counted as dropped, never silently);
- ``fallback``: a Delta or PostgreSQL table (no fallback or retry strategy of its
  own) that receives what the primary refused: whole batches after
  ``onFailure: fallback``, and the records the primary refuses one by one (a
  constraint violation, a value that does not fit its column) whatever
  ``onFailure`` says. Without a fallback those go to the dead-letter buffer.

Rules checked here, each located at the sink: ``onFailure: fallback`` needs a
``fallback``; ``fallback`` and ``drop`` need ``backoff.steps`` (with unlimited
attempts they would never happen); a ``cap`` below the ``interval``; a fallback
writing the primary's own table.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, StrictInt, model_validator

from isbflow.spec.fields import Duration, SafePath, SpecModel, is_absolute, one_of_message
from isbflow.spec.postgres import PostgresSink

SINK_KINDS = ("delta", "postgres")
#: isbflow's default wait between attempts (Numaflow's is 1 ms)
DEFAULT_INTERVAL = 1.0


class DeltaSink(SpecModel):
    """A Delta table. ``path`` is relative to the data dir; an absolute path (another disk, a
    mount) must be asked for with ``external: true``, so no spec leaves the data dir by accident."""

    path: SafePath
    """The table's folder: relative to the data dir (``ISBFLOW_HOME``), or absolute with ``external: true``."""
    partitionBy: list[str] = Field(default_factory=list)
    """Columns the table is partitioned by (Delta partition columns). Default: none."""
    external: bool = False
    """Allows an absolute ``path`` (another disk, a mount). Default false."""

    @model_validator(mode="after")
    def _inside(self) -> DeltaSink:
        if is_absolute(self.path) and not self.external:
            raise ValueError(f"path {self.path!r} is outside the data dir: use a relative path, or set "
                             "'external: true' to write there on purpose")
        return self


class OnFailure(StrEnum):
    """Numaflow's ``retryStrategy.onFailure``: what happens once ``backoff.steps`` attempts failed."""

    RETRY = "retry"
    FALLBACK = "fallback"
    DROP = "drop"


class Backoff(SpecModel):
    """Numaflow's ``retryStrategy.backoff``. ``steps`` counts attempts, the first one included."""

    interval: Duration = Field(default=DEFAULT_INTERVAL, ge=0.001, le=3600.0)
    """The wait before the first retry, a duration (``500ms``, ``2s``) or seconds, from 1 ms to 1 h. Default 1 s
    (Numaflow's 1 ms would spin against a database that is down)."""
    steps: StrictInt | None = Field(default=None, ge=1)
    """Attempts, the first one included, before ``onFailure`` applies. Default: unlimited."""
    factor: float = Field(default=1.0, ge=1.0, le=100.0)
    """Each wait is the previous one times this, 1 to 100. Default 1 (a constant wait)."""
    cap: Duration | None = Field(default=None, ge=0.001, le=86400.0)
    """The longest wait, a duration or seconds, from 1 ms to 1 day, at least ``interval``. Default: none."""
    jitter: float = Field(default=0.0, ge=0.0, lt=1.0)
    """A random share added to each wait, 0 to below 1 (0.2: up to 20% more). Default 0."""

    @model_validator(mode="after")
    def _cap(self) -> Backoff:
        if self.cap is not None and self.cap < self.interval:
            raise ValueError(f"cap ({self.cap:g}s) is below interval ({self.interval:g}s): the longest wait "
                             "cannot be shorter than the first")
        return self

    def wait(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based), before jitter."""
        seconds = self.interval * self.factor ** max(0, attempt - 1)
        return min(seconds, self.cap) if self.cap is not None else seconds


class RetryStrategy(SpecModel):
    """Numaflow's ``sink.retryStrategy``."""

    backoff: Backoff = Field(default_factory=Backoff)
    """How long to wait between attempts, and how many. Default: 1 s, for ever."""
    onFailure: OnFailure = OnFailure.RETRY
    """Once ``backoff.steps`` attempts failed: ``retry`` (start the backoff again), ``fallback`` (the batch
    goes to the fallback sink) or ``drop`` (its records are counted as dropped). Default ``retry``."""


class FallbackSink(SpecModel):
    """Numaflow's ``sink.fallback``: the table a sink's refused records go to (exactly one kind).

    Its rows are the primary's columns plus ``_isb_error`` (why), ``_isb_attempts``
    (attempts made), ``_isb_app`` and ``_isb_batch`` (the sink's app id and Spark
    batch id: what makes a replayed batch commit nothing there either)."""

    delta: DeltaSink | None = None
    """A Delta table."""
    postgres: PostgresSink | None = None
    """A PostgreSQL table."""

    @model_validator(mode="after")
    def _one_kind(self) -> FallbackSink:
        kinds = [k for k in SINK_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(one_of_message("a fallback sink", SINK_KINDS, kinds))
        return self


class Sink(SpecModel):
    """Where a sink vertex lands its rows: a Delta table or a PostgreSQL table (exactly one), and
    optionally Numaflow's ``retryStrategy`` and ``fallback``."""

    delta: DeltaSink | None = None
    """Write a Delta table (exactly once, per batch)."""
    postgres: PostgresSink | None = None
    """Write a PostgreSQL table (one transaction per batch)."""
    retryStrategy: RetryStrategy | None = None
    """What happens when writing fails: waits, attempts, then ``onFailure``. Default: retry every 1 s, for ever."""
    fallback: FallbackSink | None = None
    """The table refused records go to. Default: none (they go to the dead-letter buffer)."""

    @model_validator(mode="after")
    def _one_kind(self) -> Sink:
        kinds = [k for k in SINK_KINDS if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(one_of_message("a sink", SINK_KINDS, kinds))
        on_failure = self.retryStrategy.onFailure if self.retryStrategy else OnFailure.RETRY
        if on_failure == OnFailure.FALLBACK and self.fallback is None:
            raise ValueError("retryStrategy.onFailure is 'fallback' but the sink has no fallback: add "
                             "fallback (a delta or postgres table), or set onFailure to retry or drop")
        if on_failure != OnFailure.RETRY and self.retryStrategy.backoff.steps is None:
            raise ValueError(f"retryStrategy.onFailure {on_failure.value!r} needs retryStrategy.backoff.steps "
                             "(attempts before it applies): with unlimited attempts it never happens")
        if self.fallback is not None and self.table_name(self) == self.table_name(self.fallback):
            raise ValueError(f"the fallback writes the sink's own table ({self.table_name(self)}): give it "
                             "another table")
        return self

    @staticmethod
    def table_name(s: Sink | FallbackSink) -> str:
        return f"delta:{s.delta.path}" if s.delta is not None else f"postgres:{s.postgres.table}"

    @property
    def on_failure(self) -> OnFailure:
        return self.retryStrategy.onFailure if self.retryStrategy else OnFailure.RETRY
