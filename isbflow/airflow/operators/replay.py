"""``PipelineReplayOperator``: replay a pipeline from its sources, ``recover`` or ``reprocess``.

- ``recover`` runs :func:`isbflow.recovery.recover.recover`: detect lost
  buffers, drain, recreate the lost region, rewind the sources to the offset
  ledger's low offsets, replay (sinks merge on ``_isb_id``), verify. It takes
  no range. With ``dry_run`` it runs :func:`isbflow.recovery.plan.plan_recover`
  instead: what was lost, what would be drained, recreated and moved aside,
  and how many records would be replayed from which offset; nothing changes.
- ``reprocess`` runs ``isbflow.recovery.reprocess.reprocess`` over a range of
  source offsets (``from_offset``/``to_offset``) *or* of event time
  (``from_time``/``to_time``), replacing the sinks' earlier output for that
  range; ``dry_run`` is passed on. The module is imported when needed: an
  isbflow without it fails the task saying so.

Time bounds are the expressions of :mod:`isbflow.spec.times` (``yesterday``,
``today``, ``-6h``, ISO dates), resolved against the run's data interval, so a
scheduled replay (``replays:`` in the spec, ``dags/pipeline_replay_schedules.py``)
covers the same range however late it runs.

``shadow`` (reprocess only) writes the range's new output into shadow tables
and runs the sinks' suites there (the live sinks are untouched, no asset event);
XCom carries ``shadow_run``, the diffs and the suites' verdicts, and a suite
that fails fails the task naming the check. :class:`PipelinePromoteOperator`
then promotes a shadow run into the live sinks (one Delta commit per raw sink):
the run this DAG run's replay task made, or one named (``run``) after a review.

XCom ``return_value``: the report JSON (the plan's for a dry run), plus
``replay_mode`` and ``replay_range`` (the range as asked, times resolved). A report
that is not ``ok`` (a sink check failed) fails the task after the XCom is
written. A replay that changed sinks adds asset events for them
(:mod:`isbflow.airflow.assets`), which schedules ``pipeline_quality``.
Spark runs in the task's process (``master``), started only when needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from airflow.sdk.exceptions import AirflowFailException, AirflowSkipException

from isbflow.airflow.assets import emit_sink_events, sinks_alias
from isbflow.airflow.operators.isb import as_bool
from isbflow.airflow.operators.pipeline import PipelineOperatorBase
from isbflow.ops import replay as ops_replay
from isbflow.ops.spark import SparkOnDemand
from isbflow.spec.times import TimeExpressionError, resolve_range

_EMPTY = ("", "none", "null")


@dataclass(frozen=True)
class ReplayRange:
    """A reprocess range: by source offsets or by event time (UTC), each side open when None."""

    from_offset: int | str | None = None
    to_offset: int | str | None = None
    from_time: datetime | None = None
    to_time: datetime | None = None

    @property
    def empty(self) -> bool:
        return all(x is None for x in (self.from_offset, self.to_offset, self.from_time, self.to_time))

    def to_json(self) -> dict[str, Any]:
        return {"from_offset": self.from_offset, "to_offset": self.to_offset,
                "from_time": self.from_time.isoformat() if self.from_time else None,
                "to_time": self.to_time.isoformat() if self.to_time else None}


def _optional(value: Any) -> Any:
    """A templated optional value: ``None``, ``""`` and ``"None"`` all mean 'not given'."""
    if value is None or (isinstance(value, str) and value.strip().lower() in _EMPTY):
        return None
    return value.strip() if isinstance(value, str) else value


def _offset(name: str, value: Any) -> int | str | None:
    """A source offset: a sequence number (the only source partition), or reprocess's
    ``<source>:N`` forms passed on as text (reprocess checks them against the sources)."""
    value = _optional(value)
    if value is None:
        return None
    if isinstance(value, bool):
        raise AirflowFailException(f"{name}: {value!r} is not a source offset (a sequence number >= 1)")
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        n = int(value)
        if n < 1:
            raise AirflowFailException(f"{name}: source offsets start at 1, got {n}")
        return n
    if isinstance(value, str) and ":" in value:
        return value
    raise AirflowFailException(f"{name}: {value!r} is not a source offset (a sequence number >= 1, or "
                               "<source>:<sequence>)")


def reference_times(context: Any) -> tuple[datetime, datetime]:
    """(data interval start, end) of the run: what relative time expressions are resolved against."""
    end = context.get("data_interval_end") or getattr(context.get("dag_run"), "run_after", None) \
        or datetime.now(UTC)
    start = context.get("data_interval_start") or end
    return start, end


def parse_range(from_offset: Any, to_offset: Any, from_time: Any, to_time: Any,
                start: datetime, end: datetime) -> ReplayRange:
    """Check and resolve a replay range; a wrong one fails the task naming the field."""
    lo, hi = _offset("from_offset", from_offset), _offset("to_offset", to_offset)
    if isinstance(lo, int) and isinstance(hi, int) and lo > hi:
        raise AirflowFailException(f"from_offset {lo} is after to_offset {hi}")
    ft, tt = _optional(from_time), _optional(to_time)
    try:
        tlo, thi = resolve_range(str(ft) if ft else None, str(tt) if tt else None, end, start)
    except TimeExpressionError as e:
        raise AirflowFailException(f"from_time/to_time: {e}") from None
    if (lo is not None or hi is not None) and (tlo is not None or thi is not None):
        raise AirflowFailException("give a range by source offsets (from_offset/to_offset) OR by event time "
                                   "(from_time/to_time), not both")
    return ReplayRange(lo, hi, tlo, thi)


class PipelineReplayOperator(PipelineOperatorBase):
    """Replay a pipeline (module docstring); XCom: the report (or the dry run's plan).

    :param mode: ``recover`` or ``reprocess``.
    :param from_offset: reprocess: the first source offset (sequence) of the range.
    :param to_offset: reprocess: the last source offset of the range.
    :param from_time: reprocess: event-time start (a time expression, see :mod:`isbflow.spec.times`).
    :param to_time: reprocess: event-time end.
    :param dry_run: show what would be replayed without changing anything.
    :param master: Spark master of the replay's session (``local[2]``).
    :param drain_timeout: recover: seconds the drain of still-running steps may take.
    :param shadow: reprocess into shadow tables and run the suites there (module docstring).
    :param promote_run: when given, this DAG run only promotes that shadow run: the task skips.
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "mode", "from_offset", "to_offset",
                                      "from_time", "to_time", "dry_run", "master", "shadow", "promote_run")
    ui_color = "#f0c7d4"

    def __init__(self, *, mode: str = "recover", from_offset: int | str | None = None,
                 to_offset: int | str | None = None, from_time: str | None = None, to_time: str | None = None,
                 dry_run: bool | str = False, master: str = "local[2]", drain_timeout: float = 300.0,
                 shadow: bool | str = False, promote_run: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [sinks_alias()])
        super().__init__(**kwargs)
        self.mode = mode
        self.from_offset = from_offset
        self.to_offset = to_offset
        self.from_time = from_time
        self.to_time = to_time
        self.dry_run = dry_run
        self.master = master
        self.drain_timeout = drain_timeout
        self.shadow = shadow
        self.promote_run = promote_run

    def execute(self, context: Any) -> dict:
        if _optional(self.promote_run) is not None:
            raise AirflowSkipException(f"this run promotes shadow run {self.promote_run}: nothing to replay")

        mode = str(self.mode).strip().lower()
        if mode not in ops_replay.MODES:
            raise AirflowFailException(f"mode {self.mode!r} is not one of {', '.join(ops_replay.MODES)}")
        t = self.target()
        rng = parse_range(self.from_offset, self.to_offset, self.from_time, self.to_time, *reference_times(context))
        dry, shadow = as_bool(self.dry_run), as_bool(self.shadow)
        self.log.info("replay of pipeline %s (%s): mode %s, range %s, dry run %s", t.pipeline.name, t.path, mode,
                      rng.to_json(), dry)
        if mode == "recover" and not rng.empty:
            raise AirflowFailException(
                f"mode recover takes no range (got {rng.to_json()}): it replays from the offset ledger's low "
                "offsets. Use mode reprocess to run a range again.")

        def on_phase(ph: Any) -> None:
            self.log.info("%s %s: %s %s (%.1fs)", mode, t.pipeline.name, ph.name, ph.state, ph.seconds)

        with SparkOnDemand(self.master, f"isbflow-replay-{t.pipeline.name}") as spark_for:
            try:
                result = ops_replay.replay(
                    spark_for, t.specs, t.pipeline, t.settings, t.data_dir, mode=mode, dry_run=dry,
                    from_offset=rng.from_offset, to_offset=rng.to_offset, from_time=rng.from_time,
                    to_time=rng.to_time, drain_timeout=self.drain_timeout if mode == "recover" else None,
                    on_phase=on_phase, shadow=shadow)
            except ops_replay.Unreachable as e:
                raise RuntimeError(str(e)) from None  # retries apply
            except ops_replay.ReplayError as e:
                raise AirflowFailException(str(e)) from None
        report = json.loads(json.dumps(result.to_json(), default=str))
        report["replay_mode"] = mode
        report["replay_range"] = rng.to_json()  # as asked, times resolved against this run
        summary = "\n".join(ops_replay.summary(result))
        self.log.info("%s", summary)
        changed = not dry and not shadow and report.get("state") != "nothing-lost"
        if changed:
            emit_sink_events(context, t.pipeline, t.data_dir, by=f"replay-{mode}")
        if not report.get("ok", False):
            context["ti"].xcom_push(key="return_value", value=report)
            raise AirflowFailException(f"replay of pipeline {t.pipeline.name} ({mode}) did not pass its checks:\n"
                                       f"{summary}")
        return report


class PipelinePromoteOperator(PipelineOperatorBase):
    """Promote a shadow reprocess into the live sinks; XCom: the promote's report.

    The run promoted is ``run`` when given (a shadow reviewed on the Quality page), else, with
    ``promote`` true, the ``shadow_run`` of ``replay_task_id``'s XCom (this DAG run's shadow,
    whose suites passed: a failing suite fails that task, and this one does not run). Nothing
    to promote skips the task. A refused promote (a failed suite, naming the check; a live sink
    whose range changed since the shadow; a run promoted already) fails it. The promoted sinks
    get asset events.

    :param run: the shadow run id (``reprocess-<time>``) to promote.
    :param promote: promote this DAG run's shadow (from the replay task's XCom).
    :param replay_task_id: the task whose XCom names the shadow run.
    :param master: Spark master (aggregate windows are recomputed in Spark).
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "run", "promote", "master")
    ui_color = "#c7e9d4"

    def __init__(self, *, run: str | None = None, promote: bool | str = False, replay_task_id: str = "replay",
                 master: str = "local[2]", **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [sinks_alias()])
        super().__init__(**kwargs)
        self.run = run
        self.promote = promote
        self.replay_task_id = replay_task_id
        self.master = master

    def execute(self, context: Any) -> dict:
        run = _optional(self.run)
        if run is None and as_bool(self.promote):
            shadowed = context["ti"].xcom_pull(task_ids=self.replay_task_id) or {}
            run = shadowed.get("shadow_run")
            if run is None:
                raise AirflowSkipException(f"task {self.replay_task_id} made no shadow run (give shadow: true)")
        if run is None:
            raise AirflowSkipException("nothing to promote: no promote_run given, and promote is off")
        t = self.target()

        def on_phase(ph: Any) -> None:
            self.log.info("promote %s %s: %s %s (%.1fs)", run, t.pipeline.name, ph.name, ph.state, ph.seconds)

        with SparkOnDemand(self.master, f"isbflow-promote-{t.pipeline.name}") as spark_for:
            try:
                result = ops_replay.promote(spark_for, t.specs, t.pipeline, t.settings, t.data_dir, str(run),
                                            on_phase=on_phase)
            except ops_replay.Unreachable as e:
                raise RuntimeError(str(e)) from None  # retries apply
            except ops_replay.ReplayError as e:
                raise AirflowFailException(str(e)) from None
        report = json.loads(json.dumps(result.to_json(), default=str))
        summary = "\n".join(ops_replay.summary(result))
        self.log.info("%s", summary)
        emit_sink_events(context, t.pipeline, t.data_dir, by="replay-promote")
        if not report.get("ok", False):
            context["ti"].xcom_push(key="return_value", value=report)
            raise AirflowFailException(f"promote of {run} did not pass its checks:\n{summary}")
        return report
