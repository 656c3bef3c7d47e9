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

from isbflow.isb.state import Desired, Observed, StepStatus, all_status, set_desired
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


#: how a step ended its drain (``drain_steps``): its final state, or ``gone`` (no status, or a
#: heartbeat that stayed still, in a tolerant drain)
ENDED_STATES = (Observed.DRAINED, Observed.FAILED, Observed.STOPPED)


async def drain_steps(
    nc,
    pipeline: Pipeline,
    steps: list[str] | None = None,
    *,
    timeout: float = 300.0,
    poll: float = 0.5,
    on_update: Callable[[dict[str, StepStatus | None]], None] | None = None,
    silent_after: float | None = None,
) -> dict[str, str]:
    """The drain loop: tell ``steps`` (default: all) to drain, upstream first; vertex -> how each ended.

    A step is told to drain once every step feeding it among ``steps`` has ended, so its input
    buffers hold everything that will ever arrive. With ``silent_after`` None (a healthy
    pipeline), only ``drained`` ends a step: a failed step raises :class:`DrainTimeout` at once,
    and a step that never reported or went quiet holds the drain until ``timeout``. With
    ``silent_after`` set (a pipeline that just lost a buffer, :mod:`isbflow.recovery`), a step
    that fails or stops has ended too, and one without a status or whose heartbeat stayed
    still that long is ``gone``. Raises :class:`DrainTimeout` naming the first step still
    running after ``timeout`` seconds.
    """
    steps = pipeline.topological_order() if steps is None else steps
    order = [v for v in pipeline.topological_order() if v in steps]
    tolerant = silent_after is not None
    ended: dict[str, str] = {}
    told: set[str] = set()
    beats: dict[str, tuple[float, float]] = {}  # vertex -> (heartbeat time, when we saw it change)
    started = time.monotonic()
    while True:
        statuses = await all_status(nc, pipeline.name, order)
        now = time.monotonic()
        for v in order:
            s = statuses.get(v)
            if v in ended:
                continue
            if s is not None and s.state == Observed.DRAINED:
                ended[v] = str(s.state)
            elif s is not None and s.state == Observed.FAILED and not tolerant:
                raise DrainTimeout(pipeline.name, v, s, now - started)
            elif not tolerant:
                continue
            elif s is None:
                ended[v] = "gone"
            elif s.state in ENDED_STATES:
                ended[v] = str(s.state)
            else:
                seen = beats.get(v)
                if seen is None or seen[0] != s.updated_at:
                    beats[v] = (s.updated_at, now)
                elif now - seen[1] > silent_after:
                    ended[v] = "gone"
        for v in order:
            if v not in told and v not in ended and all(u in ended or u not in steps
                                                        for u in upstream(pipeline, v)):
                await set_desired(nc, pipeline.name, v, Desired.DRAINING)
                told.add(v)
        if on_update is not None:
            on_update(statuses)
        if len(ended) == len(order):
            return ended
        if now - started > timeout:
            stuck = next(v for v in order if v not in ended)
            raise DrainTimeout(pipeline.name, stuck, statuses.get(stuck), timeout)
        await asyncio.sleep(poll)


async def drain_pipeline(
    nc,
    pipeline: Pipeline,
    timeout: float = 300.0,
    poll: float = 0.5,
    on_update: Callable[[dict[str, StepStatus | None]], None] | None = None,
) -> dict[str, StepStatus]:
    """Drain every step of a healthy pipeline, upstream first; return each step's final status."""
    await drain_steps(nc, pipeline, timeout=timeout, poll=poll, on_update=on_update)
    statuses = await all_status(nc, pipeline.name, pipeline.topological_order())
    return {v: s for v, s in statuses.items() if s is not None}


async def resume_pipeline(nc, pipeline: Pipeline) -> None:
    """Set every step's desired state back to ``running`` (before a restart)."""
    for v in pipeline.topological_order():
        await set_desired(nc, pipeline.name, v, Desired.RUNNING)
