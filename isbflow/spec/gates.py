"""The pipeline spec's quality gates (``spec.quality``) and scheduled replays (``spec.replays``).

Both are re-exported by :mod:`isbflow.spec.models`, where the rest of the ``Pipeline`` kind is.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, StrictInt, ValidationInfo, field_validator, model_validator

from isbflow.spec.expectations import catalog_problems
from isbflow.spec.fields import Duration, Name, SpecModel
from isbflow.spec.times import check_time_expression


class QualityGate(StrEnum):
    """What a failed quality check does: ``fail`` the run, or ``warn`` and go on."""

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
    """A GX expectation's snake-case name, e.g. ``expect_column_values_to_not_be_null``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The expectation's arguments, e.g. ``{column: service}``. Default: none."""

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
    """Reports kept per sink, the newest; ``null``: no bound by count. Default 50."""
    maxAge: Duration | None = None
    """Reports older than this (a duration, e.g. ``30d``, or seconds) are pruned. Default: no bound by age."""


class SinkQuality(SpecModel):
    """The quality gate of one sink: its expectations on top of the built-in checks.

    ``freshness``: the newest event may be at most this old (built-in check);
    ``schedule``: a cron expression or preset for the control plane (not used
    by ``isbflow quality run``, which runs now).
    """

    sink: str
    """The sink vertex checked."""
    expectations: list[Expectation] = Field(default_factory=list)
    """GX expectations on the sink's table, on top of the built-in checks. Default: none."""
    onFailure: QualityGate = QualityGate.FAIL
    """``fail`` (the run fails: exit 1, a failed task) or ``warn`` (reported, the run passes). Default ``fail``."""
    schedule: str | None = None
    """When Airflow runs the gate: a cron expression or a preset such as ``@hourly`` (``isbflow quality run``
    runs now whatever it says). Default: no schedule of its own."""
    freshness: Duration | None = None
    """The newest event may be at most this old (a duration, e.g. ``15m``, or seconds). Default: not checked."""
    retention: QualityRetention = Field(default_factory=QualityRetention)
    """How many quality reports are kept. Default: the newest 50."""


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
    """The replay's name, unique in the pipeline: its DAG is ``replay_<pipeline>_<name>``."""
    mode: Literal["recover", "reprocess"] = "reprocess"
    """``reprocess`` (run an event-time range again) or ``recover`` (replay from the offset ledger's low
    offsets). Default ``reprocess``."""
    schedule: str
    """A cron expression (``0 2 * * *``) or a preset such as ``@daily``."""
    fromTime: str | None = None
    """Start of the event-time range, included: ``yesterday``, ``today``, ``-6h``, an ISO date or time.
    Default: open."""
    toTime: str | None = None
    """End of the event-time range, excluded; the same forms as ``fromTime``. Default: open."""

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


