"""``PipelineLagTrigger``: waits, in the triggerer, until every buffer of a pipeline has lag <= N.

It polls :func:`isbflow.steps.lag.pipeline_lag` over one nats-py connection
and fires one event: ``{"done": true, "lags": {...}}`` once the largest lag is
at most ``max_lag``, or ``{"done": false, "problem": "..."}`` when it cannot
watch (bad spec, unreachable service). The overall limit is the deferral's
``timeout``. Its arguments are names and paths only; credentials come from
the Airflow connection when it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.spec import SpecError, load_specs


def lag_event(lags: list[Any], max_lag: int) -> dict[str, Any]:
    """The event (and XCom) for one look: per stream its lag, the largest one, and whether it is low enough."""
    by_stream = {b.stream: b.lag for b in lags}
    worst = max(by_stream.values(), default=0)
    return {"done": worst <= max_lag, "max_lag": max_lag, "worst": worst, "lags": by_stream,
            "missing": sorted(b.stream for b in lags if b.missing)}


class PipelineLagTrigger(BaseTrigger):
    """Fire once every buffer of ``pipeline`` (from ``spec_file``) has lag <= ``max_lag``.

    :param spec_file: absolute path of the spec file.
    :param pipeline: the pipeline's name.
    :param max_lag: the largest lag (messages not yet committed downstream) that counts as caught up.
    :param nats_conn_id: Airflow connection of the ISB service.
    :param data_dir: isbflow's data dir (the hook's fallback to the embedded server).
    :param include_sources: count the JetStream source streams too, not only the edges.
    :param poll_interval: seconds between looks.
    """

    def __init__(self, *, spec_file: str, pipeline: str, max_lag: int, nats_conn_id: str,
                 data_dir: str | None = None, include_sources: bool = True, poll_interval: float = 5.0) -> None:
        super().__init__()
        self.spec_file = spec_file
        self.pipeline = pipeline
        self.max_lag = max_lag
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir
        self.include_sources = include_sources
        self.poll_interval = poll_interval

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "spec_file": self.spec_file, "pipeline": self.pipeline, "max_lag": self.max_lag,
            "nats_conn_id": self.nats_conn_id, "data_dir": self.data_dir,
            "include_sources": self.include_sources, "poll_interval": self.poll_interval,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        # lazy: ops.watch loads pyarrow and nats-py (~0.3 CPU-s); DAG parsing imports this via sensors/lag.py
        from isbflow.ops import watch

        def problem(e: Exception) -> TriggerEvent:
            return TriggerEvent({"done": False, "problem": f"cannot watch the lag of pipeline {self.pipeline!r}: {e}"})

        try:
            specs = load_specs([self.spec_file])
            p = specs.pipelines[self.pipeline]
            hook = JetStreamHook(self.nats_conn_id, data_dir=self.data_dir)
            settings = await hook.aget_settings(specs.service_for(p))
        except (SpecError, KeyError, watch.Unreachable) as e:
            yield problem(e)
            return
        last = None
        try:
            async with watch.session(settings, name="isbflow-lag-trigger") as nc:
                while True:
                    event = lag_event(await watch.pipeline_lag(nc, p, self.include_sources), self.max_lag)
                    if event["worst"] != last:
                        self.log.info("pipeline %s: largest lag %s (waiting for <= %s): %s", p.name,
                                      event["worst"], self.max_lag, event["lags"])
                        last = event["worst"]
                    if event["done"]:
                        break
                    await asyncio.sleep(self.poll_interval)
        except watch.Unreachable as e:
            yield problem(e)
            return
        yield TriggerEvent(event)
