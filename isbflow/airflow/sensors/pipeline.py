"""``PipelineStateSensor``: waits until every step of a pipeline reports a state (e.g. ``running``).

Deferrable by default: after one immediate check it hands the wait to
:class:`~isbflow.airflow.triggers.pipeline.PipelineStateTrigger` and frees its
worker slot; with ``deferrable=False`` it pokes like any sensor. Either way it
judges the heartbeats with :func:`isbflow.steps.launch.judge_state`, so it
fails at once, with the reason and the driver log's last lines, when a step
reports ``failed`` or when the pipeline's recorded launch (``<data
dir>/launches/<pipeline>.json``, written by ``PipelineStartOperator``) has
exited or stopped sending heartbeats; ``timeout`` bounds the whole wait.
XCom: each step's observed state.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.airflow.operators.pipeline import PipelineTarget, resolve_target
from isbflow.airflow.triggers.pipeline import PipelineStateTrigger
from isbflow.ops import watch
from isbflow.ops.watch import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_STARTUP_GRACE,
    LaunchRecord,
    StateCheck,
)


class PipelineStateSensor(BaseSensorOperator):
    """Wait until every step of the pipeline reports ``target_state``.

    :param pipeline_file: spec file; a relative name is looked up under ``pipelines_dir``.
    :param pipeline: the pipeline, when the file holds several.
    :param target_state: ``running``, ``draining``, ``drained``, ... (:class:`isbflow.isb.state.Observed`).
    :param watch_launch: judge only heartbeats of the recorded launch and fail when its driver dies.
    :param heartbeat_timeout: seconds of silence after which a running driver counts as stalled.
    :param startup_grace: seconds a launch may take before its first heartbeat.
    :param deferrable: wait in the triggerer (default) instead of a worker slot.
    """

    template_fields: Sequence[str] = ("pipeline_file", "pipelines_dir", "pipeline", "nats_conn_id", "data_dir",
                                      "target_state")
    ui_color = "#c7f0e8"

    def __init__(self, *, pipeline_file: str, pipelines_dir: str | None = None, pipeline: str | None = None,
                 target_state: str = "running", nats_conn_id: str = JetStreamHook.default_conn_name,
                 data_dir: str | None = None, watch_launch: bool = True,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 startup_grace: float = DEFAULT_STARTUP_GRACE, deferrable: bool = True,
                 poke_interval: float = 2.0, timeout: float = 600.0, **kwargs: Any) -> None:
        super().__init__(poke_interval=poke_interval, timeout=timeout, **kwargs)
        self.pipeline_file = pipeline_file
        self.pipelines_dir = pipelines_dir
        self.pipeline = pipeline
        self.target_state = target_state
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir
        self.watch_launch = watch_launch
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_grace = startup_grace
        self.deferrable = deferrable

    def _target(self) -> tuple[PipelineTarget, LaunchRecord | None]:
        t = resolve_target(self.pipeline_file, self.pipelines_dir, self.pipeline or None, self.nats_conn_id,
                           self.data_dir or None)
        return t, watch.read_launch(t.data_dir, t.pipeline.name) if self.watch_launch else None

    def _check(self, t: PipelineTarget, launch: LaunchRecord | None) -> StateCheck:
        try:
            check = watch.state(t.settings, t.pipeline, self.target_state, launch, self.heartbeat_timeout,
                                self.startup_grace, name="isbflow-airflow-sensor")
        except watch.Unreachable as e:
            raise RuntimeError(str(e)) from None
        self.log.info("pipeline %s, waiting for %s: %s", t.pipeline.name, self.target_state, check.steps)
        return check

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        t, launch = self._target()
        check = self._check(t, launch)
        if check.done or check.problem:
            return self.execute_complete(context, check.to_json())
        self.defer(
            trigger=PipelineStateTrigger(
                spec_file=str(t.path.absolute()), pipeline=t.pipeline.name, target_state=self.target_state,
                nats_conn_id=self.nats_conn_id, data_dir=str(t.data_dir),
                launch=launch.to_json() if launch else None, poll_interval=self.poke_interval,
                heartbeat_timeout=self.heartbeat_timeout, startup_grace=self.startup_grace),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def poke(self, context: Any) -> PokeReturnValue:
        t, launch = self._target()
        check = self._check(t, launch)
        if check.problem:
            raise AirflowFailException(check.problem)
        return PokeReturnValue(is_done=check.done, xcom_value=check.steps)

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, str]:
        """Resume after the trigger fired (or after the first check): fail on a problem."""
        if event.get("problem"):
            raise AirflowFailException(event["problem"])
        if not event.get("done"):
            raise AirflowFailException(f"pipeline {self.pipeline_file}: steps never reached "
                                       f"{self.target_state}: {event.get('steps')}")
        self.log.info("every step is %s: %s", self.target_state, event.get("steps"))
        return event.get("steps", {})
