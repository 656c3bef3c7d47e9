"""A pipeline's tuning report: what ``isbflow pipeline advise`` prints and the Pipelines page shows.

Read from the ISB service only (no Spark): each step's heartbeat (``step.<vertex>``: the last
micro-batch's rates and wall time), its rate history (``rates.<vertex>``) and, for every input
buffer, the stream's last sequence and what its reader committed (:mod:`isbflow.steps.lag`).

Per vertex:

- ``rate``: processed rows/s, the mean of the rate history's minutes over the vertex's
  ``scale.lookbackSeconds`` (Numaflow's default 120 s without ``scale``) that saw rows, else the
  heartbeat's last batch;
- ``pending``: messages of its inputs not committed yet (events on a source stream, frames of
  up to ``frameRows`` records on an internal edge);
- ``utilization``: the last batch's wall time over the latency budget (the effective
  ``limits.readTimeout``); above 1 the step cannot keep its budget;
- ``desired_replicas``: Numaflow's autoscaler formula (:func:`isbflow.steps.autoscale.desired_replicas`,
  the one the runner's autoscaler acts on), per input partition and the largest taken, in units of
  the step's parallelism now (1: what it has). A
  source: ``round(pending / rate / targetProcessingSeconds)``. A udf or sink, on its buffer in
  frames (``limit = ceil(bufferMaxLength * bufferUsageLimit / frameRows)``, ``target = capacity *
  targetBufferAvailability / 100``): ``1 + replicasPerScaleUp`` when ``pending >= limit``, else
  ``round(target / (limit - pending))``. Nothing pending and no rate: 0. Then at least 1 where
  something is pending, at most ``pending``, and within ``scale.min``..``scale.max``;
- ``advice``: readBatchSize, bufferMaxLength and latency-budget lines from what was measured
  (:func:`vertex_advice` states the rules).

Per edge with more than one partition, hot partitions (:func:`hot`): a partition whose ``lag``
or ``written`` (messages since the stream was created: its share of what the edge carried) is
more than :data:`HOT_FACTOR` times the median of its siblings' and at least :data:`HOT_FLOOR`
messages above it. With ``partitionKey`` set and ``sample_keys``, the hot partition's newest
:data:`SAMPLE_FRAMES` frames are decoded and its most frequent keys given with their share of
the rows sampled; this reads buffer data, which the read-only ``reader`` role may not.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from isbflow.connector.options import DEFAULT_FRAME_ROWS
from isbflow.isb import frames, naming
from isbflow.isb.buffers import read_range, stream_state
from isbflow.isb.connect import run_with
from isbflow.isb.state import StepStatus, all_status, get_rates
from isbflow.spec.models import Pipeline, Vertex
from isbflow.spec.scale import Scale
from isbflow.steps.autoscale import desired_replicas
from isbflow.steps.lag import BufferLag, pipeline_lag

#: a partition is hot when its measure is more than this times its siblings' median ...
HOT_FACTOR = 2.0
#: ... and at least this many messages (frames) above it: a few frames of difference is noise
HOT_FLOOR = 10
#: frames of a hot partition decoded to find its dominant keys (at most frameRows records each)
SAMPLE_FRAMES = 4
#: keys named per hot partition
TOP_KEYS = 3
#: a batch this close to readBatchSize counts as capped
FULL_BATCH = 0.9
#: utilization below which a source's latency budget could be shorter
IDLE_UTILIZATION = 0.05
#: the least readTimeout the report suggests (shorter budgets cost CPU per event: docs/performance.md)
MIN_SUGGESTED_BUDGET_S = 0.5

SCALER = ("desired_replicas is what Numaflow's formula asks for, in units of each step's parallelism now; "
          "the runner's autoscaler acts on a vertex's scale (its step's status shows its replicas: "
          "docs/autoscaling.md)")


@dataclass
class PartitionAdvice:
    partition: int
    stream: str
    lag: int  # messages its reader has not committed
    written: int  # messages written since the stream was created (its last sequence)
    hot: bool = False
    why: str | None = None  # the measure and the median it beat, when hot
    keys: list[dict[str, Any]] | None = None  # [{"key": value, "share": 0..1}] of the rows sampled


@dataclass
class EdgeAdvice:
    from_vertex: str
    to_vertex: str
    partition_key: str | None
    partitions: list[PartitionAdvice]
    hot: list[int] = field(default_factory=list)
    keys_note: str | None = None  # why no keys are given for a hot partition


@dataclass
class VertexAdvice:
    vertex: str
    role: str
    state: str  # the heartbeat's state, "unknown" when the step never reported
    partitions: int
    rate: float  # processed rows/s (module docstring)
    input_rate: float  # arrival rows/s of the last batch
    pending: int
    pending_unit: str  # "events" (a source stream) or "frames" (internal edges)
    batch_seconds: float | None
    budget_seconds: float  # the effective limits.readTimeout
    utilization: float | None
    desired_replicas: int | None  # None: nothing measured yet
    scale: dict[str, Any]  # the scale settings used (Numaflow's defaults when the vertex has none)
    scale_configured: bool
    advice: list[str] = field(default_factory=list)


@dataclass
class Advice:
    pipeline: str
    generated_at: float
    scaler: str
    thresholds: dict[str, Any]
    vertices: list[VertexAdvice]
    edges: list[EdgeAdvice]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ pure rules


def hot(values: list[int], factor: float = HOT_FACTOR, floor: int = HOT_FLOOR) -> list[tuple[bool, float]]:
    """For each value: (hot, the median of the others). Hot: more than ``factor`` times that median
    and at least ``floor`` above it. Fewer than two values: none is hot."""
    out = []
    for i, v in enumerate(values):
        others = values[:i] + values[i + 1:]
        if not others:
            out.append((False, 0.0))
            continue
        med = float(statistics.median(others))
        out.append((v > factor * med and v - med >= floor, med))
    return out


def mean_rate(status: StepStatus | None, history: list[dict[str, float]], lookback_s: float,
              now: float) -> float:
    """Processed rows/s: the mean of the history's minutes within ``lookback_s`` that saw rows (a
    minute is kept when it starts within the window), else the heartbeat's last batch, else 0."""
    recent = [float(p.get("out", 0.0)) for p in history
              if float(p.get("t", 0)) + 60 >= now - lookback_s and float(p.get("out", 0.0)) > 0]
    if recent:
        return sum(recent) / len(recent)
    return float(status.processed_rows_per_s) if status is not None else 0.0


def vertex_advice(va: VertexAdvice, v: Vertex, p: Pipeline, pending: dict[str, int], limit_frames: int,
                  onfull: str) -> list[str]:
    """The report's lines for one vertex, from what was measured. The rules:

    - the last batch took longer than the latency budget: more cores, executors or partitions, or a
      readTimeout of 1.25 times the batch;
    - the last batch read at least :data:`FULL_BATCH` of ``readBatchSize`` with input still pending
      (batches are capped): a readBatchSize of what the step processes in its budget at its rate,
      when that is larger; else the batches already fill the budget: more cores;
    - an input buffer holds at least 80% of what writers fill before ``onFull``: more replicas for
      the reader, or a larger ``bufferMaxLength``;
    - ``bufferMaxLength * bufferUsageLimit`` holds fewer records than two batches of a writer
      (its ``readBatchSize``): the writer waits on each batch (Numaflow's tip: a buffer holds several
      reads); at least twice that;
    - a source's last batch used under :data:`IDLE_UTILIZATION` of its budget: a shorter
      readTimeout (four times the batch, at least :data:`MIN_SUGGESTED_BUDGET_S`) for lower latency;
    - desired replicas above 1: the parallelism Numaflow's formula asks for.
    """
    out: list[str] = []
    if va.state == "unknown":
        return ["no heartbeat yet: run the pipeline (continuous or available-now) so the step measures its rates"]
    limits = v.effective_limits(p.spec.limits)
    rbs, budget, b = limits.readBatchSize or 0, va.budget_seconds, va.batch_seconds
    if b is not None and b > budget:
        out.append(f"the last batch took {b:.1f}s, over the {budget:g}s latency budget (limits.readTimeout): add "
                   f"cores or executors (or partitions on its input), or raise readTimeout to {math.ceil(b * 1.25)}s")
    batch_rows = round(va.rate * b) if b else 0
    total_pending = sum(pending.values())
    if rbs and batch_rows >= FULL_BATCH * rbs and total_pending > 0:
        fits = math.ceil(va.rate * budget)
        if fits > rbs:
            out.append(f"batches are full (~{batch_rows:,} rows of readBatchSize {rbs:,}) with {total_pending:,} "
                       f"{va.pending_unit} pending: raise limits.readBatchSize to {fits:,} (what the step processes "
                       f"in its {budget:g}s budget at {va.rate:,.0f} rows/s)")
        else:
            out.append(f"batches are full (~{batch_rows:,} rows of readBatchSize {rbs:,}) and already fill the "
                       f"{budget:g}s budget: add cores or executors rather than a larger readBatchSize")
    if v.source is None:
        for stream, n in sorted(pending.items()):
            if n >= 0.8 * limit_frames:
                out.append(f"buffer {stream} holds {n:,} of the {limit_frames:,} frames writers fill before onFull "
                           f"({onfull}): more replicas for {v.name} (cores, executors, partitions) or a larger "
                           "limits.bufferMaxLength")
        held = (limits.bufferMaxLength or 0) * (limits.bufferUsageLimit or 0)
        for e in p.inputs(v.name):
            writer = p.vertex(e.from_).effective_limits(p.spec.limits).readBatchSize or 0
            if writer and held < 2 * writer:
                need = math.ceil(2 * writer / (limits.bufferUsageLimit or 1))
                out.append(f"bufferMaxLength x bufferUsageLimit holds {held:,.0f} records, less than two batches of "
                           f"{e.from_} (readBatchSize {writer:,}): the writer waits on every batch; raise "
                           f"limits.bufferMaxLength to at least {need:,}")
    elif va.utilization is not None and va.utilization < IDLE_UTILIZATION and budget > MIN_SUGGESTED_BUDGET_S:
        shorter = max(MIN_SUGGESTED_BUDGET_S, math.ceil((b or 0) * 4 * 10) / 10)
        if shorter < budget:
            out.append(f"batches take {b:.2f}s of the {budget:g}s budget: limits.readTimeout could be {shorter:g}s for "
                       "lower latency (more batches cost more CPU per event: docs/performance.md)")
    if va.desired_replicas is not None and va.desired_replicas > 1:
        out.append(f"Numaflow's formula asks for {va.desired_replicas}x this step's parallelism now: more cores or "
                   "executors" + ("" if v.source else ", or more partitions on its input"))
    return out


# ------------------------------------------------------------------ reading the ISB service


async def sample_keys(nc: Any, stream: str, column: str, frames_n: int = SAMPLE_FRAMES) -> list[dict[str, Any]]:
    """The most frequent values of ``column`` in the newest ``frames_n`` frames of ``stream``, with
    their share of the rows read (empty when the stream holds none)."""
    st = await stream_state(nc, stream)
    if st is None or st.messages == 0:
        return []
    counts: Counter = Counter()
    first = max(st.first_seq, st.last_seq - frames_n + 1)
    async for chunk in read_range(nc, stream, first, st.last_seq, on_gap=lambda a, b: None):
        for _, data, headers, _ in chunk:
            rows = headers.get(frames.HDR_ROWS) if isinstance(headers, dict) else None
            for batch in frames.read_frame(data, rows):
                if column in batch.schema.names:
                    counts.update(batch.column(column).to_pylist())
    total = sum(counts.values())
    return [{"key": k if isinstance(k, str | int | float | bool) or k is None else str(k),
             "share": round(n / total, 4)} for k, n in counts.most_common(TOP_KEYS)] if total else []


async def advise(nc: Any, p: Pipeline, *, sample: bool = False, now: float | None = None) -> Advice:
    """The tuning report of ``p`` (module docstring) from what the ISB service holds now;
    ``sample``: decode the hot partitions' newest frames for their dominant keys."""
    now = time.time() if now is None else now
    order = p.topological_order()
    statuses = await all_status(nc, p.name, order)
    lags: list[BufferLag] = await pipeline_lag(nc, p)
    by_stream = {b.stream: b for b in lags}
    vertices = []
    for name in order:
        v = p.vertex(name)
        s = statuses.get(name)
        scale = v.scale or Scale()
        limits = v.effective_limits(p.spec.limits)
        pending = {b.stream: b.lag for b in lags if b.reader == name}
        capacity = max(1, math.ceil((limits.bufferMaxLength or 0) / DEFAULT_FRAME_ROWS))
        limit_frames = max(1, math.ceil((limits.bufferMaxLength or 0) * (limits.bufferUsageLimit or 0)
                                        / DEFAULT_FRAME_ROWS))
        rate = mean_rate(s, await get_rates(nc, p.name, name), scale.lookbackSeconds, now)
        batch = s.batch_seconds if s is not None and s.batch_seconds > 0 else None
        budget = float(limits.readTimeout or 0) or 1.0
        measured = s is not None
        va = VertexAdvice(
            vertex=name, role=v.role, state=str(s.state) if s is not None else "unknown", partitions=v.partitions,
            rate=round(rate, 3), input_rate=round(s.input_rows_per_s, 3) if s is not None else 0.0,
            pending=sum(pending.values()), pending_unit="events" if v.source is not None else "frames",
            batch_seconds=batch, budget_seconds=budget,
            utilization=round(batch / budget, 4) if batch is not None else None,
            desired_replicas=desired_replicas(
                v.source is not None, scale, rate, list(pending.values()), 1, limit_frames,
                math.floor(capacity * scale.targetBufferAvailability / 100))
            if measured or any(pending.values()) else None,
            scale=scale.model_dump(), scale_configured=v.scale is not None)
        va.advice = vertex_advice(va, v, p, pending, limit_frames, v.onFull.value)
        vertices.append(va)
    edges: dict[tuple[str, str], EdgeAdvice] = {}
    keys = {(e.from_, e.to): e.partitionKey for e in p.spec.edges}
    for ep in naming.edge_partitions(p):
        b = by_stream.get(ep.stream)
        edge = edges.setdefault((ep.from_vertex, ep.to_vertex), EdgeAdvice(
            ep.from_vertex, ep.to_vertex, keys.get((ep.from_vertex, ep.to_vertex)), []))
        edge.partitions.append(PartitionAdvice(ep.partition, ep.stream, b.lag if b else 0, b.last if b else 0))
    for edge in edges.values():
        await _mark_hot(nc, edge, sample)
    return Advice(p.name, now, SCALER, {"hot_factor": HOT_FACTOR, "hot_floor_messages": HOT_FLOOR,
                                        "sample_frames": SAMPLE_FRAMES, "full_batch": FULL_BATCH},
                  vertices, list(edges.values()))


async def _mark_hot(nc: Any, edge: EdgeAdvice, sample: bool) -> None:
    """Mark ``edge``'s hot partitions (by lag, then by messages written) and, when asked, their keys."""
    parts = edge.partitions
    if len(parts) < 2:
        return
    for measure in ("lag", "written"):
        for part, (is_hot, med) in zip(parts, hot([getattr(q, measure) for q in parts]), strict=True):
            if is_hot and not part.hot:
                part.hot, part.why = True, f"{measure} {getattr(part, measure):,} > {HOT_FACTOR:g}x the siblings' median {med:g}"
    edge.hot = [q.partition for q in parts if q.hot]
    if not edge.hot:
        return
    if edge.partition_key is None:
        edge.keys_note = "no partitionKey on this edge: records are spread by row, not by key"
    elif not sample:
        edge.keys_note = "keys not sampled: pass --keys (decodes the hot partitions' newest frames; needs a role that reads buffers)"
    else:
        for q in parts:
            if q.hot:
                try:
                    q.keys = await sample_keys(nc, q.stream, edge.partition_key)
                except Exception as e:  # a role that may not read buffers, a frame that does not decode
                    edge.keys_note = f"keys not sampled from {q.stream}: {str(e).strip() or type(e).__name__}"


def advise_sync(settings: Any, p: Pipeline, *, sample: bool = False) -> Advice:
    """:func:`advise` on a fresh connection, for a caller that is not async (the CLI)."""
    return run_with(settings, lambda nc: advise(nc, p, sample=sample), name="isbflow-advise")
