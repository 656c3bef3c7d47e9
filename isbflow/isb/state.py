"""Desired and observed state of steps, kept in the pipeline's KV buckets.

* **control** bucket, key ``<vertex>``: the desired state Airflow or the CLI
  sets: ``running`` | ``draining`` | ``stopped``.
* **status** bucket:
  - ``step.<vertex>``: the step's heartbeat (JSON :class:`StepStatus`),
    written by the runner after every micro-batch and at least every few seconds;
  - ``committed.<vertex>.<stream>``: the last sequence of input stream
    ``<stream>`` that step ``<vertex>`` has committed downstream (a sink's Delta
    commit, a step's batch commit). Writers read it for backpressure; space in
    WorkQueue/Interest buffers is released up to it;
  - ``drain.<vertex>``: the end offsets frozen when the step started draining;
  - ``rates.<vertex>``: the step's rates over the last hour, one point per minute
    (:func:`record_rates`, written with every heartbeat; read by the Airflow UI plugin).

Keys and values are plain text/JSON so any client of the store (``nats kv get``, ``redis-cli
HGET``) can read them. The buckets are reached through :func:`isbflow.isb.control.kv`, so the
same code serves every store.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from isbflow.isb import naming
from isbflow.isb.control import kv as _kv


class Desired(StrEnum):
    RUNNING = "running"
    DRAINING = "draining"
    STOPPED = "stopped"


class Observed(StrEnum):
    STARTING = "starting"
    RUNNING = "running"
    DRAINING = "draining"
    DRAINED = "drained"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass
class StepStatus:
    """One step's heartbeat. Rates are rows/s over the last micro-batch; ``batch_seconds`` is its
    wall time (0 until a batch ran)."""

    vertex: str
    state: str = Observed.STARTING
    batch_id: int = -1
    updated_at: float = field(default_factory=time.time)
    committed: dict[str, int] = field(default_factory=dict)  # input stream -> last committed seq
    lag: dict[str, int] = field(default_factory=dict)  # input stream -> messages behind
    input_rows_per_s: float = 0.0
    processed_rows_per_s: float = 0.0
    batch_seconds: float = 0.0  # wall time of the last micro-batch that ran (Spark's triggerExecution)
    rows_total: int = 0
    dlq_total: int = 0
    discarded_total: int = 0
    late_total: int = 0
    unrouted_total: int = 0  # records no out edge's conditions.tags took (dropped or dead-lettered)
    restarts: int = 0  # queries restarted from their checkpoint after a transient failure
    # a sink's failure policy (retryStrategy, fallback; isbflow.steps.sink_policy)
    sink_retries: int = 0  # failed attempts to write a batch
    fallback_total: int = 0  # records sent to the fallback sink
    dropped_total: int = 0  # records dropped by retryStrategy.onFailure: drop
    refused_total: int = 0  # records the sink refused one by one (to the fallback or the dead letters)
    sink_error: str | None = None  # the current failure while attempts go on
    error: str | None = None
    final_offsets: dict[str, Any] | None = None
    app: str | None = None  # Spark application id / launch id
    pid: int | None = None
    #: the step's autoscaler (isbflow.steps.autoscale): its last decision (pending, rate, current,
    #: desired, target, bounds, cooldown) and the application's executors; None without ``scale``
    replicas: dict[str, Any] | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> StepStatus:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def age(self, now: float | None = None) -> float:
        return (now or time.time()) - self.updated_at


async def set_desired(nc, pipeline: str, vertex: str, desired: Desired) -> None:
    kv = await _kv(nc, naming.control_bucket(pipeline))
    await kv.put(vertex, desired.value.encode())


async def get_desired(nc, pipeline: str, vertex: str) -> Desired:
    kv = await _kv(nc, naming.control_bucket(pipeline))
    raw = await kv.get(vertex)
    return Desired(raw.decode()) if raw else Desired.RUNNING


async def put_status(nc, pipeline: str, status: StepStatus) -> None:
    status.updated_at = time.time()
    kv = await _kv(nc, naming.status_bucket(pipeline))
    await kv.put(f"step.{status.vertex}", json.dumps(status.to_json()).encode())


async def get_status(nc, pipeline: str, vertex: str) -> StepStatus | None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    raw = await kv.get(f"step.{vertex}")
    return StepStatus.from_json(json.loads(raw)) if raw else None


async def all_status(nc, pipeline: str, vertices: list[str]) -> dict[str, StepStatus | None]:
    return {v: await get_status(nc, pipeline, v) for v in vertices}


def committed_key(vertex: str, stream: str) -> str:
    return f"committed.{vertex}.{stream}"


async def put_committed(nc, pipeline: str, vertex: str, offsets: dict[str, int]) -> None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    for stream, seq in offsets.items():
        await kv.put(committed_key(vertex, stream), str(int(seq)).encode())


async def get_committed(nc, pipeline: str, vertex: str, stream: str) -> int | None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    raw = await kv.get(committed_key(vertex, stream))
    return int(raw) if raw else None


async def put_drain_point(nc, pipeline: str, vertex: str, offsets: dict[str, Any]) -> None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    await kv.put(f"drain.{vertex}", json.dumps(offsets).encode())


async def get_drain_point(nc, pipeline: str, vertex: str) -> dict[str, Any] | None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    raw = await kv.get(f"drain.{vertex}")
    return json.loads(raw) if raw else None


async def clear_drain_point(nc, pipeline: str, vertex: str) -> None:
    kv = await _kv(nc, naming.status_bucket(pipeline))
    await kv.delete(f"drain.{vertex}")


# ------------------------------------------------------------------ rate history

RATE_POINTS = 60  # one hour ...
RATE_STEP_S = 60.0  # ... of one-minute points


def rates_key(vertex: str) -> str:
    return f"rates.{vertex}"


async def record_rates(nc, pipeline: str, status: StepStatus, now: float | None = None,
                       points: int = RATE_POINTS, step_s: float = RATE_STEP_S) -> list[dict[str, float]]:
    """Fold one heartbeat's rates into the step's bounded history (``rates.<vertex>``); return it.

    A point is one ``step_s`` interval: ``t`` (its start, epoch seconds), ``in`` and
    ``out`` (mean input / processed rows/s over the heartbeats in it), ``n`` (how
    many), ``rows`` and ``at`` (the step's ``rows_total`` and the time of the last
    one). A heartbeat whose ``rows_total`` did not move since the previous one
    counts as 0 rows/s: the status keeps the last micro-batch's rates while a step
    idles, the chart should not. Points older than ``points * step_s`` are dropped,
    so the value stays small (about 4 KB) however long the step runs.
    """
    now = time.time() if now is None else now
    kv = await _kv(nc, naming.status_bucket(pipeline))
    key = rates_key(status.vertex)
    raw = await kv.get(key)
    try:
        history: list[dict[str, float]] = json.loads(raw) if raw else []
    except ValueError:  # a value no reader could use: start over rather than stop the heartbeat
        history = []
    last = history[-1] if history else None
    t = math.floor(now / step_s) * step_s
    if last is not None and float(last.get("t", 0)) > t:  # a heartbeat older than the history: ignore it
        return history
    idle = last is not None and int(last.get("rows", -1)) == status.rows_total
    rate_in = 0.0 if idle else float(status.input_rows_per_s)
    rate_out = 0.0 if idle else float(status.processed_rows_per_s)
    if last is not None and last.get("t") == t:
        n = int(last.get("n", 1))
        last["in"] = (float(last.get("in", 0.0)) * n + rate_in) / (n + 1)
        last["out"] = (float(last.get("out", 0.0)) * n + rate_out) / (n + 1)
        last.update(n=n + 1, rows=status.rows_total, at=now)
    else:
        history.append({"t": t, "in": rate_in, "out": rate_out, "n": 1, "rows": status.rows_total, "at": now})
    oldest = t - (points - 1) * step_s
    history = [p for p in history if float(p.get("t", 0)) >= oldest][-points:]
    await kv.put(key, json.dumps(history, separators=(",", ":")).encode())
    return history


async def get_rates(nc, pipeline: str, vertex: str) -> list[dict[str, float]]:
    """The step's rate history (see :func:`record_rates`), oldest first; empty when none."""
    kv = await _kv(nc, naming.status_bucket(pipeline))
    raw = await kv.get(rates_key(vertex))
    try:
        return json.loads(raw) if raw else []
    except ValueError:
        return []
