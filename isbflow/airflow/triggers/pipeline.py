"""``PipelineStateTrigger``: waits, in the triggerer, until every step of a pipeline reports a state.

It polls the steps' heartbeats in the pipeline's status bucket over one
nats-py connection (asynchronously: the triggerer runs many triggers in one
event loop) and judges them with :func:`isbflow.steps.launch.judge_state`.
It fires exactly one event, a :class:`~isbflow.steps.launch.StateCheck` as a
dict: ``{"done": true, ...}`` once every step is in ``target_state``, or
``{"done": false, "problem": "...", ...}`` as soon as waiting cannot help: a
step reports ``failed``, or, given the ``launch`` record, the driver process
is gone or has sent no heartbeat for ``heartbeat_timeout`` seconds after its
``startup_grace``. The wait's overall limit is the deferral's ``timeout``.

Its arguments are stored in the metadata DB: they hold names and paths only;
credentials are read from the Airflow connection when it runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from isbflow.airflow.hooks.jetstream import JetStreamHook
from isbflow.ops import watch
from isbflow.ops.watch import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_STARTUP_GRACE
from isbflow.spec import SpecError, load_specs


class PipelineStateTrigger(BaseTrigger):
    """Fire once every step of ``pipeline`` (from ``spec_file``) reports ``target_state``.

    :param spec_file: absolute path of the spec file.
    :param pipeline: the pipeline's name.
    :param target_state: a :class:`isbflow.isb.state.Observed` value, e.g. ``running``.
    :param nats_conn_id: Airflow connection of the ISB service.
    :param data_dir: isbflow's data dir (the hook's fallback to the embedded server).
    :param launch: the launch record (``LaunchRecord.to_json()``) whose heartbeats count, or None.
    :param poll_interval: seconds between reads of the status bucket.
    """

    def __init__(self, *, spec_file: str, pipeline: str, target_state: str, nats_conn_id: str,
                 data_dir: str | None = None, launch: dict[str, Any] | None = None, poll_interval: float = 2.0,
                 heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                 startup_grace: float = DEFAULT_STARTUP_GRACE) -> None:
        super().__init__()
        self.spec_file = spec_file
        self.pipeline = pipeline
        self.target_state = target_state
        self.nats_conn_id = nats_conn_id
        self.data_dir = data_dir
        self.launch = launch
        self.poll_interval = poll_interval
        self.heartbeat_timeout = heartbeat_timeout
        self.startup_grace = startup_grace

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {
            "spec_file": self.spec_file, "pipeline": self.pipeline, "target_state": self.target_state,
            "nats_conn_id": self.nats_conn_id, "data_dir": self.data_dir, "launch": self.launch,
            "poll_interval": self.poll_interval, "heartbeat_timeout": self.heartbeat_timeout,
            "startup_grace": self.startup_grace,
        })

    async def run(self) -> AsyncIterator[TriggerEvent]:
        launch = watch.LaunchRecord.from_json(self.launch) if self.launch else None
        try:
            specs = load_specs([self.spec_file])
            p = specs.pipelines[self.pipeline]
            hook = JetStreamHook(self.nats_conn_id, data_dir=self.data_dir)
            settings = await hook.aget_settings(specs.service_for(p))
        except (SpecError, KeyError, watch.Unreachable) as e:
            yield TriggerEvent(watch.StateCheck(False, f"cannot watch pipeline {self.pipeline!r}: {e}",
                                                {}).to_json())
            return
        vertices = watch.watched_steps(p, launch)
        last: dict[str, str] | None = None
        try:
            async with watch.session(settings, name="isbflow-trigger") as nc:
                while True:
                    check = await watch.observe_state(nc, p.name, vertices, self.target_state, launch,
                                                      self.heartbeat_timeout, self.startup_grace)
                    if check.steps != last:
                        self.log.info("pipeline %s, waiting for %s: %s", p.name, self.target_state, check.steps)
                        last = check.steps
                    if check.done or check.problem:
                        break
                    await asyncio.sleep(self.poll_interval)
        except watch.Unreachable as e:
            yield TriggerEvent(watch.StateCheck(False, f"cannot watch pipeline {self.pipeline!r}: {e}",
                                                {}).to_json())
            return
        yield TriggerEvent(check.to_json())
