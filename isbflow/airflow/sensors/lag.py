"""``PipelineLagSensor``: waits until every buffer of a pipeline has lag <= ``max_lag``.

Lag is measured from the buffers (:mod:`isbflow.steps.lag`: a stream's last
sequence minus what its reading step has committed), so it answers "has the
pipeline caught up?" for a running pipeline and after a batch run alike. Use
it before a quality run or a drain that should see everything produced so far.

Deferrable by default: after one immediate look it hands the wait to
:class:`~isbflow.airflow.triggers.lag.PipelineLagTrigger` and frees its worker
slot; ``deferrable=False`` pokes instead. ``timeout`` bounds the wait. XCom:
each buffer's lag at the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator, PokeReturnValue
from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.airflow.operators.pipeline import PipelineTarget, resolve_target
from isbflow.airflow.triggers.lag import PipelineLagTrigger, lag_event


class PipelineLagSensor(BaseSensorOperator):
    """Wait until the pipeline's lag on every buffer is at most ``max_lag`` messages.

    :param pipeline_file: spec file; a relative name is looked up under ``pipelines_dir``.
    :param pipeline: the pipeline, when the file holds several.
    :param max_lag: the largest lag that counts as caught up (default 0: everything committed).
    :param include_sources: count the JetStream source streams too (default), not only the edges.
    :param deferrable: wait in the triggerer (default) instead of a worker slot.
    """

    template_fields: Sequence[str] = ("pipeline_file", "pipelines_dir", "pipeline", "nats_conn_id", "data_dir",
                                      "max_lag")
    ui_color = "#c7e8f0"

    def __init__(self, *, pipeline_file: str, pipelines_dir: str | None = None, pipeline: str | None = None,
                 max_lag: int | str = 0, include_sources: bool = True,
                 nats_conn_id: str = JetStreamHook.default_conn_name, data_dir: str | None = None,
                 deferrable: bool = True, poke_interval: float = 5.0, timeout: float = 1800.0,
                 **kwargs: Any) -> None:
        super().__init__(poke_interval=poke_interval, timeout=timeout, **kwargs)
        self.pipeline_file = pipeline_file
        self.pipelines_dir = pipelines_dir
        self.pipeline = pipeline
        self.max_lag = max_lag
        self.include_sources = include_sources
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir
        self.deferrable = deferrable

    def _target(self) -> PipelineTarget:
        return resolve_target(self.pipeline_file, self.pipelines_dir, self.pipeline or None, self.nats_conn_id,
                              self.data_dir or None)

    def _look(self, t: PipelineTarget) -> dict[str, Any]:
        # lazy: ops.watch loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import watch

        try:
            event = lag_event(watch.lag(t.settings, t.pipeline, self.include_sources, name="isbflow-lag-sensor"),
                              int(self.max_lag))
        except watch.Unreachable as e:
            raise RuntimeError(str(e)) from None
        self.log.info("pipeline %s: largest lag %s (waiting for <= %s): %s", t.pipeline.name, event["worst"],
                      self.max_lag, event["lags"])
        return event

    def execute(self, context: Any) -> Any:
        if not self.deferrable:
            return super().execute(context)
        t = self._target()
        event = self._look(t)
        if event["done"]:
            return self.execute_complete(context, event)
        self.defer(
            trigger=PipelineLagTrigger(spec_file=str(t.path.absolute()), pipeline=t.pipeline.name,
                                       max_lag=int(self.max_lag), nats_conn_id=self.nats_conn_id,
                                       data_dir=str(t.data_dir), include_sources=self.include_sources,
                                       poll_interval=self.poke_interval),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def poke(self, context: Any) -> PokeReturnValue:
        event = self._look(self._target())
        return PokeReturnValue(is_done=event["done"], xcom_value=event["lags"])

    def execute_complete(self, context: Any, event: dict[str, Any]) -> dict[str, int]:
        """Resume after the trigger fired (or after the first look): fail on a problem."""
        if event.get("problem"):
            raise AirflowFailException(event["problem"])
        self.log.info("pipeline %s caught up: every buffer's lag <= %s: %s", self.pipeline_file, self.max_lag,
                      event.get("lags"))
        return event.get("lags", {})
