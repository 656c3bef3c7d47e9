"""What ``recover`` would do, without doing it: the dry run of :func:`isbflow.recovery.recover.recover`.

:func:`plan_recover` runs recover's read-only parts: detection
(:func:`~isbflow.recovery.recover.detect_loss`), the region of the lost
buffers, the steps that still run (they would be drained), and the low offset
of every source partition (the ledger KV united with the sinks' Delta history,
dead letters counted as done). It reports the buffers that would be deleted
and provisioned again, the checkpoints that would be moved aside and how many
source records would be replayed. It writes nothing: no stream, checkpoint,
epoch file, table or status key changes.

It tells sinks with ``_isb_id`` from aggregate sinks by their Delta table's
schema; only for a sink without a table yet does it start Spark (``spark``,
a session or a function making one) to derive the schema its input would have.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.types as pt

from isbflow.isb import ledger, naming
from isbflow.isb import state as st
from isbflow.isb.buffers import stream_state
from isbflow.isb.connect import NatsSettings, connect
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.loss import DetectedLoss, detect_loss
from isbflow.isb.routed import read_covered
from isbflow.recovery import pg_sinks
from isbflow.recovery.job import missing_references, region_of, running_steps
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.steps.runner import PipelineRunner

log = logging.getLogger(__name__)


@dataclass
class PartitionReplay:
    """One source partition: where the replay would start and how much it would read."""

    partition: str
    stream: str
    low: int  # first sequence to replay
    last: int  # the source stream's last sequence now
    per_sink: dict[str, int]

    @property
    def records(self) -> int:
        return max(0, self.last - self.low + 1)


@dataclass
class RecoveryPlan:
    pipeline: str
    lost: list[DetectedLoss] = field(default_factory=list)
    region: list[str] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    running: list[str] = field(default_factory=list)  # steps recover would drain first
    streams_to_recreate: list[str] = field(default_factory=list)
    checkpoints_to_move: list[str] = field(default_factory=list)
    partitions: list[PartitionReplay] = field(default_factory=list)
    source_lost: dict[str, list[list[int]]] = field(default_factory=dict)
    id_sinks: list[str] = field(default_factory=list)
    merged_by_dimensions: dict[str, list[str]] = field(default_factory=dict)
    #: step -> reference table it joins that no longer exists: recover refuses until it is put again
    missing_references: dict[str, str] = field(default_factory=dict)
    state: str = "nothing-lost"  # nothing-lost | would-recover | would-refuse

    @property
    def records_to_replay(self) -> int:
        return sum(p.records for p in self.partitions)

    @property
    def ok(self) -> bool:
        return True  # a plan changes nothing; what it found is in the fields

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(dry_run=True, ok=self.ok, records_to_replay=self.records_to_replay)
        for p, obj in zip(d["partitions"], self.partitions, strict=True):
            p["records"] = obj.records
        return d

    def summary(self) -> str:
        """The plan in a few lines, for a task log or the terminal."""
        if self.state == "nothing-lost":
            return f"pipeline {self.pipeline}: no buffer lost, recover would do nothing"
        if self.state == "would-refuse":
            return "\n".join([f"pipeline {self.pipeline}: recover WOULD REFUSE (dry run, nothing changed): "
                              "put these reference tables again first (isbflow ref put)"]
                             + [f"  {t} (step {v})" for v, t in self.missing_references.items()])
        lines = [f"pipeline {self.pipeline}: recover WOULD (dry run, nothing changed):"]
        lines += [f"  lost {b.stream}" + ("" if b.first is None else f" from sequence {b.first}"
                                          + (f" to {b.last}" if b.last else "")) + f": {b.reason}"
                  for b in self.lost]
        if self.running:
            lines.append(f"  drain the running steps {', '.join(self.running)}")
        lines.append(f"  recreate {len(self.streams_to_recreate)} buffer(s): {', '.join(self.streams_to_recreate)}")
        lines.append(f"  move aside {len(self.checkpoints_to_move)} checkpoint(s) of {', '.join(self.region)}")
        lines += [f"  replay source {p.partition} ({p.stream}) from sequence {p.low} to {p.last}: "
                  f"{p.records:,} record(s)" for p in self.partitions]
        lines += [f"  LOST AT THE SOURCE {part}: sequences {r}" for part, r in self.source_lost.items()]
        return "\n".join(lines)


def plan_recover(spark, specs: Specs, pipeline: Pipeline, settings: NatsSettings, data_dir: str | Path, *,
                 lost: list[str] | None = None) -> RecoveryPlan:
    """What recover would do now (module docstring). ``spark``: a session or a function making one."""
    p = pipeline
    data_dir = Path(data_dir).absolute()
    plan = RecoveryPlan(p.name)
    loop = asyncio.new_event_loop()
    try:
        nc = loop.run_until_complete(connect(settings, name=f"isbflow-plan-{p.name}"))
        try:
            found = (loop.run_until_complete(detect_loss(nc, p, data_dir)) if not lost
                     else [DetectedLoss(s, "named by the caller") for s in lost])
            plan.lost = found
            if not found:
                return plan
            plan.state = "would-recover"
            sources, region = region_of(p, {b.stream for b in found})
            plan.sources = sorted(sources)
            plan.region = [v for v in p.topological_order() if v in region]
            plan.missing_references = dict(loop.run_until_complete(missing_references(nc, p, plan.region)))
            if plan.missing_references:
                plan.state = "would-refuse"
            state = loop.run_until_complete(_read_state(nc, settings, p, plan))
        finally:
            loop.run_until_complete(nc.close())
    finally:
        loop.close()

    plan.streams_to_recreate = [ep.stream for ep in naming.edge_partitions(p) if ep.from_vertex in region]
    ck = data_dir / "checkpoints" / p.name
    for v in plan.region:
        for n in [v, *[f"{v}-to-{e.to}" for e in p.outputs(v)]]:
            if (ck / n).exists():
                plan.checkpoints_to_move.append(str(ck / n))

    sinks = [v for v in plan.region if p.vertex(v).sink is not None]
    paths = {v: _sink_path(p, v, data_dir) for v in sinks}
    columns = {v: _table_columns(paths[v]) if paths[v] else None for v in sinks}  # None: from the schema
    unknown = [v for v in sinks if columns[v] is None]
    if unknown:  # no table yet: what the sink would hold is the upstream step's output schema
        session = spark() if callable(spark) else spark
        runner = PipelineRunner(session, specs, p, settings, data_dir)
        try:
            for v in unknown:
                schema = runner.output_schema(p.inputs(v)[0].from_)
                columns[v] = [(f.name, not isinstance(f.dataType, _numeric_types())) for f in schema.fields]
        finally:
            runner.close()
    for v in sinks:
        names = [n for n, _ in columns[v]]
        if ledger.ID_COLUMN in names:
            plan.id_sinks.append(v)
        else:
            plan.merged_by_dimensions[v] = [n for n, dimension in columns[v] if dimension]
    pg = {v: pg_sinks.held(pg_sinks.target(p, v, data_dir)) for v in plan.id_sinks if paths[v] is None}
    _low_offsets(plan, state, paths, pg)
    return plan


def _sink_path(p: Pipeline, vertex: str, data_dir: Path) -> str | None:
    """The Delta table of a sink; None for a PostgreSQL sink."""
    if p.vertex(vertex).sink.delta is None:
        return None
    path = Path(p.vertex(vertex).sink.delta.path)
    return str(path if path.is_absolute() else data_dir / path)


def _numeric_types() -> tuple[type, ...]:
    # lazy: pyspark (0.3-1 s) stays out of recovery.plan's own imports
    from pyspark.sql.types import BooleanType, DecimalType, DoubleType, FloatType, IntegralType

    return IntegralType, FloatType, DoubleType, DecimalType, BooleanType


def _table_columns(path: str) -> list[tuple[str, bool]] | None:
    """(column, is a dimension) of the sink's Delta table (None: no table). Dimensions are the
    non-numeric columns, as :func:`isbflow.recovery.job.dimension_columns` counts them."""
    # lazy: deltalake (~0.25 s) stays out of recovery.plan's own imports; only reading a sink's table needs it
    from deltalake.exceptions import TableNotFoundError

    from isbflow.local.delta import load_table

    try:
        schema = pa.schema(load_table(path).schema().to_arrow())  # arro3 -> pyarrow (PyCapsule)
    except TableNotFoundError:
        return None
    numeric = (pt.is_integer, pt.is_floating, pt.is_decimal, pt.is_boolean)
    return [(f.name, not any(test(f.type) for test in numeric)) for f in schema]


@dataclass
class _LedgerState:
    """What the low offsets are computed from, read over one connection."""

    kv: dict[str, ledger.PartitionRanges]
    dead: ledger.PartitionRanges
    #: source partition -> (its stream, first sequence, last sequence)
    streams: dict[str, tuple[str, int, int]]


async def _read_state(nc, settings: NatsSettings, p: Pipeline, plan: RecoveryPlan) -> _LedgerState:
    """Fill ``plan.running`` (steps recover would drain) and read the ledger, dead letters and sources."""
    statuses = await st.all_status(nc, p.name, plan.region)
    plan.running = running_steps(statuses)
    dead: ledger.PartitionRanges = {}
    for src in plan.sources:
        letters = await read_dead_letters(settings, p.name, src, limit=10_000_000)
        dead = ledger.union(dead, ledger.id_ranges(pa.array([d.get("origin") for d in letters], pa.string())))
    streams: dict[str, tuple[str, int, int]] = {}
    for src in plan.sources:
        if p.vertex(src).source.jetstream is None:  # files: read again from their folder
            continue
        stream = naming.source_stream(p, src)
        sst = await stream_state(nc, stream)
        streams[f"{src}/0"] = (stream, max(1, sst.first_seq) if sst else 1, sst.last_seq if sst else 0)
    return _LedgerState(await read_covered(nc, p.name), dead, streams)  # routed elsewhere counts as held


def _low_offsets(plan: RecoveryPlan, state: _LedgerState, paths: dict[str, str | None],
                 pg_held: dict[str, ledger.PartitionRanges]) -> None:
    """recover's phase 4 arithmetic: per source partition, the low offset and what the source lost
    (``pg_held``: a PostgreSQL sink's bookkeeping offsets, where a Delta sink has its history)."""
    held = {v: ledger.union(state.kv.get(v, {}), pg_held[v] if v in pg_held else ledger.from_delta_history(paths[v]))
            for v in plan.id_sinks}
    first = {part: f for part, (_, f, _) in state.streams.items()}
    lows = ledger.low_offsets(held, list(state.streams), dead=state.dead, first=first)
    from_one = ledger.low_offsets(held, list(state.streams), dead=state.dead)
    for part, lo in lows.items():
        stream, f, last = state.streams[part]
        plan.partitions.append(PartitionReplay(part, stream, lo.low, last, lo.per_sink))
        if from_one[part].low < f:
            plan.source_lost[part] = [[from_one[part].low, f - 1]]
