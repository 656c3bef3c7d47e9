"""The drain protocol, control side (after FLINK-32700).

``drain_pipeline`` sets each step's control key to ``draining`` in
topological order: a step is told to drain only once every step feeding it
reports ``drained``, so its input buffers hold everything that will ever
arrive and its frozen end offsets cover it all. The "no more data" mark thus
travels through the pipeline like Flink's final watermark. It returns the
final status of every step, or raises :class:`DrainTimeout` naming the step
that did not finish.

The step side (freezing end offsets, stopping the query after the last
commit, publishing ``drained``) is in :mod:`isbflow.steps.runner`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from isbflow.isb.state import Desired, Observed, StepStatus, get_status, set_desired
from isbflow.spec.models import Pipeline


class DrainTimeout(Exception):
    """Draining did not finish in time; the message names the stuck step and its state."""

    def __init__(self, pipeline: str, vertex: str, status: StepStatus | None, timeout: float):
        self.vertex = vertex
        self.status = status
        if status is None:
            what = "has never reported (is the pipeline running?)"
        else:
            lag = sum(status.lag.values()) if status.lag else 0
            what = (f"is {status.state} at batch {status.batch_id}, {lag} message(s) behind, "
                    f"last heartbeat {status.age():.0f}s ago")
            if status.error:
                what += f"; error: {status.error}"
        super().__init__(f"drain of pipeline {pipeline!r} timed out after {timeout:.0f}s: step {vertex!r} {what}")


def upstream(pipeline: Pipeline, vertex: str) -> list[str]:
    return [e.from_ for e in pipeline.inputs(vertex)]


async def drain_pipeline(
    nc,
    pipeline: Pipeline,
    timeout: float = 300.0,
    poll: float = 0.5,
    on_update: Callable[[dict[str, StepStatus | None]], None] | None = None,
) -> dict[str, StepStatus]:
    """Drain every step, upstream first; return each step's final status."""
    order = pipeline.topological_order()
    deadline = time.monotonic() + timeout
    told: set[str] = set()
    while True:
        statuses = {v: await get_status(nc, pipeline.name, v) for v in order}
        drained = {v for v, s in statuses.items() if s is not None and s.state == Observed.DRAINED}
        for v in order:
            if v not in told and all(u in drained for u in upstream(pipeline, v)):
                await set_desired(nc, pipeline.name, v, Desired.DRAINING)
                told.add(v)
        if on_update is not None:
            on_update(statuses)
        if len(drained) == len(order):
            return {v: s for v, s in statuses.items() if s is not None}
        failed = [v for v, s in statuses.items() if s is not None and s.state == Observed.FAILED]
        if failed:
            v = failed[0]
            raise DrainTimeout(pipeline.name, v, statuses[v], timeout - (deadline - time.monotonic()))
        if time.monotonic() > deadline:
            stuck = next(v for v in order if v not in drained)
            raise DrainTimeout(pipeline.name, stuck, statuses[stuck], timeout)
        await asyncio.sleep(poll)


async def resume_pipeline(nc, pipeline: Pipeline) -> None:
    """Set every step's desired state back to ``running`` (before a restart)."""
    for v in pipeline.topological_order():
        await set_desired(nc, pipeline.name, v, Desired.RUNNING)
