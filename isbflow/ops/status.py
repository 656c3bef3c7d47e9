"""A pipeline's live state as one record: step heartbeats, desired states, rates, dead letters, last recovery.

What the Pipelines page shows and ``status`` commands print. Async: read on one open connection
(the page reads several pipelines inside its own timeout).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import BucketNotFoundError

from isbflow.isb import naming
from isbflow.isb import state as st
from isbflow.isb.buffers import stream_state
from isbflow.isb.store import BucketMissing
from isbflow.recovery.status import last_recovery, recovery_line
from isbflow.spec.models import Pipeline

__all__ = ["LIVE_STATES", "NotProvisioned", "PipelineState", "Observed", "StepStatus", "naming", "read",
           "replicas_line"]

Observed = st.Observed
StepStatus = st.StepStatus
LIVE_STATES = {st.Observed.STARTING.value, st.Observed.RUNNING.value, st.Observed.DRAINING.value}


class NotProvisioned(Exception):
    """The pipeline has no status bucket on the ISB service yet."""


@dataclass
class PipelineState:
    statuses: dict[str, StepStatus | None]
    desired: dict[str, str | None]
    rates: dict[str, list] = field(default_factory=dict)
    dlq_messages: int | None = None
    recovery: str | None = None
    recovery_state: str | None = None


def replicas_line(vertex: str, status: StepStatus | None) -> str | None:
    """A step's autoscaler in one line (its heartbeat's ``replicas``: the last decision), or None for a
    step without ``scale``: ``in: replicas 2, desired 2 (1..2; backlog: pending [96000], 41,000.0 rows/s);
    executors 2 of 2``."""
    r = status.replicas if status is not None else None
    if not r:
        return None
    line = (f"{vertex}: replicas {r.get('target')}, desired {r.get('desired')} ({r.get('min')}..{r.get('max')}; "
            f"{r.get('why')}: pending {r.get('pending')}, {float(r.get('rate') or 0):,.1f} rows/s")
    if r.get("cooldown_left_s"):
        line += f", {float(r['cooldown_left_s']):.0f}s of cooldown left"
    line += ")"
    executors = r.get("executors")
    if executors:
        line += f"; executors {executors.get('live') if executors.get('live') is not None else '?'} of {executors.get('target')}"
    return line


async def read(nc: Any, p: Pipeline) -> PipelineState:
    """Everything the status and control buckets and the dead-letter stream hold for ``p``."""
    order = p.topological_order()
    try:
        statuses = await st.all_status(nc, p.name, order)
    except (BucketNotFoundError, BucketMissing):
        raise NotProvisioned(f"no status bucket {naming.status_bucket(p.name)} on the ISB service: the pipeline "
                             "is not provisioned yet (run the isb_provision DAG)") from None
    try:
        desired: dict[str, str | None] = {v: (await st.get_desired(nc, p.name, v)).value for v in order}
    except (BucketNotFoundError, BucketMissing):
        desired = dict.fromkeys(order)
    out = PipelineState(statuses, desired, {v: await st.get_rates(nc, p.name, v) for v in order})
    dlq = await stream_state(nc, naming.dlq_stream(p.name))
    out.dlq_messages = dlq.messages if dlq is not None else None
    recovery = await last_recovery(nc, p.name)
    if recovery:
        out.recovery, out.recovery_state = recovery_line(recovery, time.time()), recovery.get("state")
    return out
