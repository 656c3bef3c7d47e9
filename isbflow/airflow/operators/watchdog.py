"""``PipelineWatchdogOperator``: one look at a pipeline; fail loudly, or start a recovery.

It runs :func:`isbflow.recovery.watchdog.watch` (stale heartbeats, a driver that
exited, failed steps, lag growing run after run, buffer loss) and then:

- nothing wrong (or no step running): succeeds, logging a one-line summary;
  the recover task downstream, if any, is skipped;
- problems, the spec has ``autoRecover: true`` and the DAG gave a
  ``recover_task_id`` (a ``TriggerDagRunOperator`` of ``pipeline_replay`` in
  recover mode, downstream of this task): succeeds with a warning listing the
  problems and lets that task run, so the trigger is a task of the run that
  the UI shows and ``dag.test()`` can check. While a recovery already runs it
  is not triggered again;
- problems otherwise: fails (no retries) with a message naming each problem:
  the step and its heartbeat's age, the lag trend, the lost stream and range.

XCom ``return_value``: the :class:`~isbflow.recovery.watchdog.WatchReport` JSON
plus ``action`` (``none``, ``recover``, ``recovery-running`` or ``fail``); it is
written before the task fails too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.providers.standard.operators.branch import BranchMixIn
from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.operators.pipeline import PipelineOperatorBase
from isbflow.ops import watch
from isbflow.ops.watch import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_LAG_GROWTH_RUNS,
    DEFAULT_STARTUP_GRACE,
)


class PipelineWatchdogOperator(PipelineOperatorBase, BranchMixIn):
    """Watch one pipeline (module docstring).

    :param heartbeat_timeout: seconds after which a live step's heartbeat is stale.
    :param startup_grace: the same for a step still ``starting``.
    :param lag_growth_runs: consecutive growing lag samples that count as a problem.
    :param recover_task_id: the downstream task that triggers a recovery (followed only when the
        spec has ``autoRecover: true`` and something is wrong; skipped otherwise).
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "heartbeat_timeout",
                                      "startup_grace", "lag_growth_runs")
    ui_color = "#f0d8c7"
    inherits_from_skipmixin = True  # like BaseBranchOperator: it may skip its downstream task

    def __init__(self, *, heartbeat_timeout: float | str = DEFAULT_HEARTBEAT_TIMEOUT,
                 startup_grace: float | str = DEFAULT_STARTUP_GRACE,
                 lag_growth_runs: int | str = DEFAULT_LAG_GROWTH_RUNS, recover_task_id: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_grace = startup_grace
        self.lag_growth_runs = lag_growth_runs
        self.recover_task_id = recover_task_id

    def execute(self, context: Any) -> dict:
        try:
            t = self.target()
        except watch.NotStarted as e:  # a native service never started here: none of its steps runs
            self.log.info("%s: idle (%s)", self.pipeline_file, e)
            return self._finish(context, {"pipeline": self.pipeline or self.pipeline_file, "action": "none",
                                          "idle": str(e)}, follow=False)
        p = t.pipeline
        try:
            report = watch.watchdog(t.settings, p, t.data_dir, heartbeat_timeout=float(self.heartbeat_timeout),
                                    startup_grace=float(self.startup_grace),
                                    lag_growth_runs=int(self.lag_growth_runs))
        except watch.Unreachable as e:
            raise RuntimeError(str(e)) from None
        out = report.to_json()
        summary = report.summary()
        if report.healthy:
            out["action"] = "none"
            self.log.info("%s", summary)
            return self._finish(context, out, follow=False)
        if report.recovery_running:
            out["action"] = "recovery-running"
            self.log.warning("WARN %s\na recovery of %s is running already: not starting another", summary, p.name)
            return self._finish(context, out, follow=False)
        if p.spec.autoRecover and self.recover_task_id:
            out["action"] = "recover"
            self.log.warning("WARN %s\nautoRecover: triggering pipeline_replay (mode recover) through task %s",
                             summary, self.recover_task_id)
            return self._finish(context, out, follow=True)
        out["action"] = "fail"
        context["ti"].xcom_push(key="return_value", value=out)
        advice = ("autoRecover is on but this DAG has no recover task for it (the DAG file was parsed before "
                  "the spec changed?)" if p.spec.autoRecover else
                  "set autoRecover: true in the spec to recover automatically")
        raise AirflowFailException(f"{summary}\nSee the step logs; run pipeline_replay (mode recover) after buffer "
                                   f"loss, pipeline_start after a dead driver; or {advice}.")

    def _finish(self, context: Any, out: dict, follow: bool) -> dict:
        """Return ``out`` as XCom, running the recover task downstream only when ``follow``."""
        if self.recover_task_id:
            # skipping raises inside do_branch: the XCom must be written first
            context["ti"].xcom_push(key="return_value", value=out)
            self.do_branch(context, self.recover_task_id if follow else None)
        return out
