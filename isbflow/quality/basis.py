"""What completeness and the window recount are judged against: the offset ledger and the steps' commits.

:func:`read_ledger_basis` reads from the ISB service, in this order:

- the ledger KV (the source offsets each sink has committed,
  :mod:`isbflow.isb.ledger`);
- per sink, its committed low watermark
  (:func:`isbflow.isb.ledger.committed_watermarks`): the source offset every step
  from the source to the sink has committed, proven by walking the steps'
  committed offsets; as each step is confirmed, the event-time watermark of its
  Spark queries (:func:`step_watermark`) is noted, so an aggregate sink knows which
  windows its aggregating step has closed *and* it has committed;
- then per JetStream source partition (``<source>/0``), the source stream's first
  and last sequence (what may be in flight), and the dead-lettered ids.

The :class:`LedgerBasis` is what :func:`isbflow.quality.checks.ledger_completeness`
and :func:`isbflow.quality.checks.window_recompute` take. Without the ISB service
a run falls back to :class:`isbflow.quality.checks.SinkOffsetBasis` and to the
aggregating step's checkpoint watermark alone (:func:`offline_closure`).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

from nats.js.errors import NotFoundError

from isbflow.isb import ledger, naming
from isbflow.isb import state as st
from isbflow.isb.buffers import stream_state
from isbflow.isb.connect import NatsSettings, run_with
from isbflow.isb.dlq import read_dead_letters
from isbflow.isb.ledger import CommittedWatermark, PartitionRanges
from isbflow.quality.checks import WindowClosure
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir

#: seconds a running step gets to commit what its input buffers held (see committed_watermarks)
DEFAULT_WAIT_S = 30.0


@dataclass(frozen=True)
class SourcePartition:
    """A source partition's stream and the sequences it holds now."""

    partition: str
    stream: str
    first: int
    last: int


@dataclass
class LedgerBasis:
    """The ledger's view of a pipeline at one moment (module docstring)."""

    pipeline: str
    settings: NatsSettings
    sources: dict[str, SourcePartition]
    kv: dict[str, PartitionRanges]
    dead: PartitionRanges
    watermarks: dict[str, CommittedWatermark]

    def held(self, sink: str, path: str | None, version: int | None = None) -> PartitionRanges:
        """What the ledger says ``sink`` committed (KV and the table's commit history up to ``version``)."""
        return ledger.sink_ranges(self.kv, sink, path, version)

    def stored_at(self, partition: str, seq: int) -> float | None:
        """When the source stream stored record ``seq`` of ``partition`` (the next one it holds
        when that one is gone); None when unknown."""
        src = self.sources.get(partition)
        if src is None:
            return None

        async def get(nc):
            try:
                m = await nc.jsm().get_msg(src.stream, seq=seq, next=True)
            except NotFoundError:
                return None
            return m.time.timestamp() if m.time else None

        try:
            return run_with(self.settings, get, name=f"isbflow-quality-{self.pipeline}")
        except Exception:  # noqa: BLE001 - the age is a measure in the report, never worth failing it
            return None

    def source_committed(self) -> dict[str, int]:
        """Per JetStream source partition, the offset its source step has committed now (when the ISB
        service no longer answers: the last offset the source held, the most that can be past it)."""
        async def get(nc):
            out = {}
            for part, src in self.sources.items():
                out[part] = await st.get_committed(nc, self.pipeline, part.rpartition("/")[0], src.stream) or 0
            return out

        try:
            return run_with(self.settings, get, name=f"isbflow-quality-{self.pipeline}")
        except Exception:  # noqa: BLE001 - a bound that only makes windows wait, never fail
            return {part: src.last for part, src in self.sources.items()}


def read_ledger_basis(settings: NatsSettings, p: Pipeline, data_dir: str | Path, *,
                      wait_s: float = DEFAULT_WAIT_S, dead_letter_limit: int = 1_000_000) -> LedgerBasis:
    """The pipeline's :class:`LedgerBasis` now (every sink's watermark). Raises
    :class:`isbflow.isb.connect.IsbUnreachable` when the ISB service cannot be reached."""
    sinks = [v.name for v in p.spec.vertices if v.sink is not None]

    async def go(nc) -> LedgerBasis:
        kv = await ledger.read(nc, p.name)
        marks = await ledger.committed_watermarks(
            nc, p, sinks, wait_s=wait_s, on_confirmed=lambda v: step_watermark(data_dir, p, v))
        sources = {}  # after the walk: what the sources hold by now is what may be in flight
        for v in p.spec.vertices:
            if v.source is not None and v.source.jetstream is not None:
                stream = naming.source_stream(p, v.name)
                info = await stream_state(nc, stream)
                if info is not None:
                    part = f"{v.name}/0"
                    sources[part] = SourcePartition(part, stream, max(1, info.first_seq), info.last_seq)
        return LedgerBasis(p.name, settings, sources, kv, {}, marks)

    basis = run_with(settings, go, name=f"isbflow-quality-{p.name}")
    letters = asyncio.run(read_dead_letters(settings, p.name, limit=dead_letter_limit))
    basis.dead = ledger.dead_letter_ranges(d.get("origin") for d in letters)
    return basis


# ------------------------------------------------------------------ event-time watermarks


def query_watermark(checkpoint: Path) -> int | None:
    """The event-time watermark (epoch ms) after the query's last committed micro-batch: Spark's
    ``nextBatchWatermarkMs`` in the checkpoint's commit log. None: no batch committed yet."""
    commits = Path(checkpoint) / "commits"
    if not commits.is_dir():
        return None
    batches = sorted((int(f.name) for f in commits.iterdir() if f.name.isdigit()), reverse=True)
    for b in batches[:3]:  # the newest may be half written
        for line in (commits / str(b)).read_text().splitlines()[1:]:
            try:
                meta = json.loads(line)
            except ValueError:
                continue
            if isinstance(meta, dict) and "nextBatchWatermarkMs" in meta:
                return int(meta["nextBatchWatermarkMs"])
    return None


def step_watermark(data_dir: str | Path, p: Pipeline, vertex: str) -> int | None:
    """The watermark the query of ``vertex`` has reached; None when it has committed nothing. 0 is
    Spark's "no watermark" (a step without one)."""
    return query_watermark(DataDir(Path(data_dir)).checkpoint(p.name, vertex, p.query_to(vertex)))


def aggregating_step(p: Pipeline, sink: str, data_dir: str | Path) -> str | None:
    """The step whose watermark closes ``sink``'s windows: the nearest upstream step with one."""
    for v in reversed(p.topological_order()):
        if v in p.ancestors(sink) and p.vertex(v).udf is not None and (step_watermark(data_dir, p, v) or 0) > 0:
            return v
    return None


def ledger_closure(basis: LedgerBasis, p: Pipeline, sink: str, data_dir: str | Path,
                   raw_in_flight: int) -> WindowClosure:
    """Windows closed by the aggregating step's watermark *and* committed into ``sink``."""
    mark = basis.watermarks.get(sink)
    step = aggregating_step(p, sink, data_dir)
    if step is None:
        return WindowClosure(None, "no step upstream of this sink has an event-time watermark yet",
                             raw_in_flight=raw_in_flight)
    if mark is None or not mark.confirmed:
        why = mark.behind.reason if mark and mark.behind else "no committed watermark"
        at = mark.behind.vertex if mark and mark.behind else sink
        return WindowClosure(None, f"step {at!r}: {why}; every window waits", step, raw_in_flight)
    wm = (mark.marks or {}).get(step)
    if not isinstance(wm, int):
        return WindowClosure(None, f"step {step!r} has committed no micro-batch", step, raw_in_flight)
    return WindowClosure(wm * 1000, f"the watermark of step {step!r}, committed into {sink!r}", step, raw_in_flight)


def offline_closure(p: Pipeline, sink: str, data_dir: str | Path) -> WindowClosure:
    """Without the ISB service: the aggregating step's checkpoint watermark (whether the sink has
    committed what the step emitted before it is not known)."""
    step = aggregating_step(p, sink, data_dir)
    if step is None:
        return WindowClosure(None, "no step upstream of this sink has an event-time watermark yet")
    wm = step_watermark(data_dir, p, step)
    return WindowClosure(None if wm is None else wm * 1000,
                         f"the checkpoint watermark of step {step!r} (not confirmed committed into {sink!r}: "
                         "the ISB service was not asked)", step)
