"""Reprocess a source range: run it again through the current step code and replace its earlier output.

The batch half of batch-plus-streaming (DESIGN.md, "Recovery and replay"): a
range of source records, given by **source offsets** or by **event time**, is
read again from the source stream (which keeps its records: retention Limits,
``maxAge``), run through the transforms as they are *now*, and replaces what
the sinks hold for that range. :func:`reprocess` runs these phases, each
logged, timed and published in the pipeline's status bucket (key
``reprocess``, the JSON of :class:`ReprocessReport`):

1. **plan**: resolve the range per source partition (``<source>/<partition>``,
   the prefix of ``_isb_id``) and check it: inside the source stream (not yet
   removed by its limits) and not past what the source step has committed
   (``committed.<source>.<stream>`` in the status bucket). Records the pipeline
   has not processed yet cannot be reprocessed: the stream would write them
   again. Offsets: ``from..to`` inclusive, either side open (the stream's first
   sequence; the committed one). Event time: ``[from, to)`` on the source
   schema's first ``TIMESTAMP`` column (or ``time_column``).
2. **read**: one batch read of the source range (``spark.read.format("jetstream")``
   with ``startingOffsets``/``endingOffsets``; for event time, the partition up
   to its committed offset, filtered on the time column), parsed like the
   source step does. Malformed records are skipped (the dead-letter buffer
   already holds them; counted in ``dead_lettered``). Then no *unconsumed*
   frame of the region's buffers may carry an id of the range (still in
   flight: it would reach the sinks after the replacement).
3. **replace**: per sink with ``_isb_id`` ("raw"): the range's records run
   through the chain of transforms between the source and the sink, in batch
   (not through the buffers), and :func:`isbflow.sinks.delta.replace_keys`
   replaces the sink's rows of the range by them in ONE Delta commit (a merge:
   rows of range ids the new output lacks are deleted, the others updated or
   inserted; nothing outside the range is touched). A reader sees the range all
   old or all new. The commit carries ``isb.offsets`` (the range) and
   ``isb.reprocess`` (what was run), and the range is added to the ledger KV:
   every record of the range has been processed into the sink.
4. **windows**: per sink without ``_isb_id`` ("aggregate", rows keyed by
   ``window_start`` and group columns): the windows the range touches, from
   its old rows (read before the raw sinks change) and its new ones, are
   recomputed in batch from the raw sink fed by the same upstream step, after
   its replacement, through the current aggregation code (a watermark is a
   no-op in batch: every record counts), and replace the sink's rows of those
   windows in one commit (:func:`isbflow.sinks.delta.replace_keys` on the
   sink's keys: a window key no record makes any more is deleted). A sink fed
   by a ``udf.output: update`` step is recomputed by
   :func:`isbflow.recovery.aggregates.recompute`, the code recovery uses too;
   its ``recompute_windows`` upserts and keeps vanished keys, so the writing
   stays here.
5. **verify**: per raw sink, no duplicate ``_isb_id``, the range holds exactly
   the new rows, the row count outside the range is unchanged; per aggregate
   sink, no key twice.

``dry_run``: plan and read only; reports how many records would be re-read
and, per sink, how many rows (windows) the range covers now; nothing changes.

Limits: a stateful streaming step still holding an open window in its state
emits that window again from its state when new records reach it; reprocess
a range whose windows have closed. Offsets are JetStream sequences of the
source stream (one partition per JetStream source, ``<source>/0``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from isbflow.isb import ledger, naming
from isbflow.isb.connect import NatsSettings
from isbflow.recovery.job import (
    RUNNING_HEARTBEAT_S,
    Phase,
    RecoveryJob,
    dimension_columns,
    downstream,
)
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

log = logging.getLogger(__name__)

STATUS_KEY = "reprocess"
#: commit metadata key describing the reprocess that made a commit
REPROCESS_KEY = "isb.reprocess"
OFFSET_FORMS = ("N (the pipeline's only source partition), <source>:N, <source>/<partition>:N, "
                "or a comma list of the last two, e.g. in/0:100")
#: commit attempts when a concurrent writer wins the race (delta-rs CommitFailedError)
COMMIT_ATTEMPTS = 3

OffsetArg = int | str | Mapping[str, int] | None
TimeArg = datetime | str | None


class ReprocessError(Exception):
    """Reprocess could not proceed; the message says which phase, what, and what to do."""


class RangeError(ReprocessError):
    """The range asked for is malformed or cannot be reprocessed (bad input: CLI exit 2)."""


@dataclass
class SinkReplace:
    """What reprocess did (or, dry run, would touch) in one sink."""

    sink: str
    kind: str  # raw (rows carry _isb_id) | aggregate
    path: str = ""
    #: raw: rows of the range before; aggregate: windows (keys) of touched windows before
    rows_before: int = 0
    #: raw: rows the range produces now; aggregate: window rows recomputed
    rows_after: int = 0
    deleted: int = 0
    updated: int = 0
    inserted: int = 0
    version_before: int | None = None
    version: int | None = None
    commits: int = 0
    windows_touched: int = 0
    duplicates: int = 0
    #: raw: rows outside the range added or removed (must be 0)
    outside_changed: int = 0
    #: raw: rows in the range after the commit minus rows_after (must be 0)
    range_mismatch: int = 0
    error: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.duplicates == 0 and self.outside_changed == 0 \
            and self.range_mismatch == 0


@dataclass
class ReprocessReport:
    pipeline: str
    #: offsets | event-time
    mode: str = "offsets"
    dry_run: bool = False
    #: the range as asked (texts)
    asked: dict[str, Any] = field(default_factory=dict)
    time_column: dict[str, str] = field(default_factory=dict)
    #: per source partition, the inclusive sequence ranges reprocessed
    range: dict[str, list[list[int]]] = field(default_factory=dict)
    region: list[str] = field(default_factory=list)
    records_scanned: int = 0
    records_reread: int = 0
    dead_lettered: int = 0
    sinks: list[SinkReplace] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    seconds: float = 0.0
    state: str = "running"  # running | planned (dry run) | reprocessed | failed

    @property
    def ok(self) -> bool:
        return self.state in ("reprocessed", "planned") and all(s.ok for s in self.sinks)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for s, obj in zip(d["sinks"], self.sinks, strict=True):
            s["ok"] = obj.ok
        return d

    def describe_range(self) -> str:
        if not self.range:
            return "no source offsets"
        parts = [f"{part} {rs[0][0]}..{rs[0][1]}" if len(rs) == 1 else
                 f"{part} {ledger.count(rs):,} sequences in {len(rs)} ranges within {rs[0][0]}..{rs[-1][1]}"
                 for part, rs in self.range.items()]
        return "source offsets " + "; ".join(parts)

    def summary(self) -> str:
        """A few lines for a terminal or a task log."""
        what = "dry run of reprocess" if self.dry_run else "reprocess"
        asked = ", ".join(f"{k} {v}" for k, v in self.asked.items() if v is not None)
        lines = [f"{what} of pipeline {self.pipeline} ({self.mode}: {asked}): {self.describe_range()}",
                 f"  {self.records_reread:,} records {'to re-read' if self.dry_run else 're-read'}"
                 + (f" (of {self.records_scanned:,} scanned)" if self.mode == "event-time" else "")
                 + (f", {self.dead_lettered:,} malformed skipped (already dead-lettered)"
                    if self.dead_lettered else "")
                 + (f" through {', '.join(self.region)}" if self.region else "")]
        for s in self.sinks:
            verdict = "ok" if s.ok else "FAILED" + (f" ({s.error})" if s.error else "")
            if self.dry_run:
                unit = "rows" if s.kind == "raw" else "windows"
                lines.append(f"  sink {s.sink} ({s.kind}): the range covers {s.rows_before:,} {unit} now")
                continue
            versions = (f"version {s.version_before} -> {s.version}" if s.commits else "no change")
            if s.kind == "raw":
                lines.append(f"  sink {s.sink}: {s.rows_before:,} rows of the range replaced by {s.rows_after:,} "
                             f"(updated {s.updated:,}, inserted {s.inserted:,}, deleted {s.deleted:,}) in "
                             f"{s.commits} commit(s), {versions}; {s.duplicates} duplicate ids, "
                             f"{s.outside_changed} rows outside changed: {verdict}")
            else:
                lines.append(f"  sink {s.sink}: {s.windows_touched:,} window(s) touched, {s.rows_after:,} rows "
                             f"recomputed (updated {s.updated:,}, inserted {s.inserted:,}, deleted {s.deleted:,})"
                             f" in {s.commits} commit(s), {versions}: {verdict}")
            if s.note:
                lines.append(f"    {s.note}")
        lines.append(f"  {self.state} in {self.seconds:.1f}s")
        return "\n".join(lines)


# ------------------------------------------------------------------ the range


def source_partitions(p: Pipeline) -> list[str]:
    """``<source>/0`` of every JetStream source of ``p`` (a JetStream source is one stream)."""
    return [f"{v.name}/0" for v in p.spec.vertices if v.source is not None and v.source.jetstream is not None]


def _seq(text: Any, where: str) -> int:
    s = str(text).strip()
    if isinstance(text, bool) or not s.isdigit():
        raise RangeError(f"{where}: {text!r} is not a source offset (a sequence number >= 1)")
    n = int(s)
    if n < 1:
        raise RangeError(f"{where}: source offsets start at 1, got {n}")
    return n


def _partition(name: str, partitions: Sequence[str], where: str) -> str:
    name = name.strip()
    part = name if "/" in name else f"{name}/0"
    if part not in partitions:
        raise RangeError(f"{where}: {name!r} is not a source partition of this pipeline "
                         f"(its JetStream source partitions: {', '.join(partitions) or 'none'})")
    return part


def parse_offsets(value: OffsetArg, partitions: Sequence[str], side: str) -> dict[str, int]:
    """``from``/``to`` offsets as ``{<source>/<partition>: seq}`` (``{}`` when not given).

    Forms: an int or digits (the pipeline's only source partition), ``<source>:N``,
    ``<source>/<partition>:N``, a comma list of those, or a mapping of them.
    """
    where = f"{side} offset"
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        if len(partitions) != 1:
            raise RangeError(f"{where} {value!r}: a bare sequence needs a pipeline with one source partition; "
                             f"this one has {', '.join(partitions) or 'none'}: write {OFFSET_FORMS}")
        return {partitions[0]: _seq(value, where)}
    elif isinstance(value, str):
        items = []
        for item in value.split(","):
            name, sep, seq = item.strip().rpartition(":")
            if not sep or not name:
                raise RangeError(f"{where} {value!r}: {item.strip()!r} is not one of {OFFSET_FORMS}")
            items.append((name, seq))
    else:
        raise RangeError(f"{where} {value!r}: expected {OFFSET_FORMS}")
    out: dict[str, int] = {}
    for name, seq in items:
        part = _partition(name, partitions, where)
        if part in out:
            raise RangeError(f"{where} {value!r}: partition {part} is named twice")
        out[part] = _seq(seq, f"{where} {part}")
    return out


def parse_time(value: TimeArg, side: str, now: datetime | None = None) -> datetime | None:
    """An event-time bound in UTC: a datetime (naive means UTC) or a time expression
    (:mod:`isbflow.spec.times`: ISO time or date, ``yesterday``, ``-6h``... relative to ``now``)."""
    from isbflow.spec.times import TimeExpressionError, resolve_time

    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    try:
        return resolve_time(str(value).strip(), now or datetime.now(UTC))
    except TimeExpressionError as e:
        raise RangeError(f"{side} time: {e}") from None


def in_ranges(ids: pa.Array | pa.ChunkedArray, rng: Mapping[str, Sequence[Sequence[int]]]) -> np.ndarray:
    """A boolean mask: which ``_isb_id`` values name a sequence inside ``rng`` (vectorised)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    n = len(ids)
    out = np.zeros(n, dtype=bool)
    if n == 0 or not rng:
        return out
    ids = pc.fill_null(ids.cast(pa.string()), "")
    pieces = pc.split_pattern(ids, "/", max_splits=1, reverse=True)
    two = pc.fill_null(pc.equal(pc.list_value_length(pieces), 2), False).to_numpy(zero_copy_only=False)
    padded = pc.if_else(pa.array(two), pieces, pa.scalar(["", ""], pieces.type))
    names = pc.list_element(padded, 0)
    digits = pc.list_element(padded, 1)
    numeric = pc.fill_null(pc.utf8_is_digit(digits), False)
    seq = pc.if_else(numeric, digits, "0").cast(pa.int64()).to_numpy(zero_copy_only=False)
    numeric = numeric.to_numpy(zero_copy_only=False)
    for part, ranges in rng.items():
        if not ranges:
            continue
        mine = pc.equal(names, part).to_numpy(zero_copy_only=False) & numeric
        if not mine.any():
            continue
        los = np.array([r[0] for r in ranges], dtype=np.int64)
        his = np.array([r[1] for r in ranges], dtype=np.int64)
        idx = np.searchsorted(los, seq, side="right") - 1
        hit = (idx >= 0) & (seq <= his[np.clip(idx, 0, None)])
        out |= mine & hit
    return out


# ------------------------------------------------------------------ helpers


@dataclass
class _Source:
    """One source partition of the range: its stream and what may be read of it."""

    vertex: str
    partition: str
    stream: str
    first: int  # the stream's first sequence
    committed: int  # the last sequence the source step has committed (and the stream holds)
    scan: tuple[int, int] = (1, 0)  # the sequences read (inclusive)
    time_column: str | None = None


@dataclass
class _AggPlan:
    """How an aggregate sink's windows are recomputed: ``steps`` applied to the raw sink's rows."""

    sink: str
    raw: str
    steps: list[str]
    keys: list[str]
    update: bool  # fed by a udf.output: update step (isbflow.recovery.aggregates recomputes it)
    old_windows: pa.Table | None = None  # window_start/window_end the old rows of the range fall in


def _time_column(runner, vertex: str, given: str | None) -> str:
    """The event-time column of source ``vertex``: ``given`` (checked), else its first TIMESTAMP."""
    from pyspark.sql.types import TimestampNTZType, TimestampType

    schema = runner.source_schema(runner.p.vertex(vertex))
    stamps = [f.name for f in schema.fields if isinstance(f.dataType, (TimestampType, TimestampNTZType))]
    if given:
        if given not in schema.fieldNames():
            raise RangeError(f"time column {given!r} is not a column of source {vertex!r} "
                             f"(its schema: {', '.join(schema.fieldNames())})")
        if given not in stamps:
            raise RangeError(f"time column {given!r} of source {vertex!r} is not a TIMESTAMP column")
        return given
    if not stamps:
        raise RangeError(f"source {vertex!r} has no TIMESTAMP column to select event time on "
                         "(source.schema in the spec); reprocess it by source offsets")
    return stamps[0]


def _plan_offsets(sources: dict[str, _Source], lo_map: dict[str, int], hi_map: dict[str, int]) -> None:
    """Set each partition's scan to the asked range, checked against the stream and the committed offset."""
    for part in sorted(set(lo_map) | set(hi_map)):
        s = sources[part]
        lo, hi = lo_map.get(part, s.first), hi_map.get(part, s.committed)
        if lo > hi:
            raise RangeError(f"{part}: the range {lo}..{hi} is empty ('from' must not be after 'to')")
        if lo < s.first:
            raise RangeError(f"{part}: sequences {lo}..{min(hi, s.first - 1)} are no longer in source stream "
                             f"{s.stream} (it starts at {s.first}: removed by its limits or maxAge); "
                             f"start at {s.first} or later")
        if hi > s.committed:
            raise RangeError(f"{part}: 'to' {hi} is past what the pipeline has processed (source step "
                             f"{s.vertex} committed {s.committed} of {s.stream}); reprocessing records the "
                             "pipeline has not processed yet would write them twice: wait until it has, "
                             f"or end the range at {s.committed} or before")
        s.scan = (lo, hi)


async def _check_in_flight(nc, p: Pipeline, region: set[str], rng: ledger.PartitionRanges) -> None:
    """Refuse when an unconsumed frame of a region buffer carries an id of the range."""
    from isbflow.isb import frames
    from isbflow.isb import state as st
    from isbflow.isb.read import read_range, stream_state

    for ep in naming.edge_partitions(p):
        if ep.from_vertex not in region:
            continue
        sst = await stream_state(nc, ep.stream)
        if sst is None or sst.last_seq == 0:
            continue
        done = await st.get_committed(nc, p.name, ep.to_vertex, ep.stream) or 0
        first = max(done + 1, sst.first_seq)
        if first > sst.last_seq:
            continue
        hits = 0
        async for msgs in read_range(nc, ep.stream, first, sst.last_seq, on_gap=lambda a, b: None):
            for _, data, _, _ in msgs:
                for b in frames.decode_batches(data):
                    if ledger.ID_COLUMN in b.schema.names:
                        hits += int(in_ranges(b.column(ledger.ID_COLUMN), rng).sum())
        if hits:
            raise ReprocessError(
                f"{hits} record(s) of the range are still in flight in buffer {ep.stream} ({ep.from_vertex} -> "
                f"{ep.to_vertex}, sequences {first}..{sst.last_seq} not yet committed by {ep.to_vertex}): "
                "they would reach the sinks after the replacement. Let the pipeline process them (or drain "
                "it), then run reprocess again")


def _table_ids(path: str) -> tuple[pa.Array, int | None]:
    """(every ``_isb_id`` of the table, its version); empty and None without a table."""
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    try:
        t = DeltaTable(path)
    except TableNotFoundError:
        return pa.array([], pa.string()), None
    return t.to_pyarrow_table(columns=[ledger.ID_COLUMN]).column(ledger.ID_COLUMN).combine_chunks(), t.version()


def _commit_with_retry(what: str, attempt: Callable[[], Any]) -> Any:
    """``attempt()`` again when a concurrent writer committed first (it re-reads what it replaces)."""
    from deltalake.exceptions import CommitFailedError

    for i in range(COMMIT_ATTEMPTS):
        try:
            return attempt()
        except CommitFailedError as e:
            if i == COMMIT_ATTEMPTS - 1:
                raise ReprocessError(f"{what}: the commit lost {COMMIT_ATTEMPTS} races with concurrent "
                                     f"writers ({e}); run reprocess again") from None
            log.warning("%s: concurrent commit (%s); retrying", what, e)
    raise AssertionError("unreachable")


def _spark_table(spark, path: str):
    """The Delta table's current version as a Spark DataFrame (its Parquet files, as quality reads it)."""
    from deltalake import DeltaTable

    t = DeltaTable(path)
    uris = t.file_uris()
    if uris:
        return spark.read.option("basePath", path).parquet(*uris)
    return spark.createDataFrame(t.schema().to_arrow().empty_table())


def filter_range(spark, df, rng: ledger.PartitionRanges):
    """Rows of ``df`` whose ``_isb_id`` is in ``rng`` (a broadcast range join: no list of ids)."""
    from pyspark.sql import functions as F

    rows = [(part, int(lo), int(hi)) for part, rs in rng.items() for lo, hi in rs]
    if not rows:
        return df.limit(0)
    r = spark.createDataFrame(rows, "__p string, __lo long, __hi long")
    pattern = r"^(.+/[0-9]+)/([0-9]+)$"
    d = (df.withColumn("__part", F.regexp_extract(ledger.ID_COLUMN, pattern, 1))
         .withColumn("__seq", F.regexp_extract(ledger.ID_COLUMN, pattern, 2)))
    d = d.withColumn("__seq", F.when(F.col("__seq") != "", F.col("__seq").cast("long")))
    cond = (F.col("__part") == F.col("__p")) & F.col("__seq").between(F.col("__lo"), F.col("__hi"))
    return d.join(F.broadcast(r), cond, "left_semi").drop("__part", "__seq")


def _agg_plan(runner, sink: str, raw_sinks: list[str]) -> _AggPlan | str:
    """The raw sink and chain of steps that recompute aggregate ``sink``, or why there are none: walk
    up single-input steps until one also feeds a raw sink of the region."""
    p = runner.p
    steps: list[str] = []
    v = sink
    while True:
        ins = p.inputs(v)
        if len(ins) != 1:
            return f"{v!r} has {len(ins)} inputs; windows are recomputed along a single chain of steps"
        up = ins[0].from_
        feeds = [e.to for e in p.outputs(up) if e.to in raw_sinks]
        if feeds and steps:
            break
        if p.vertex(up).udf is None:
            return "no raw sink (with _isb_id) of the range is fed by a step upstream of it"
        steps.insert(0, up)
        v = up
    keys = runner.update_keys(steps[-1])
    if keys:
        return _AggPlan(sink, feeds[0], steps, list(keys), update=True)

    return _AggPlan(sink, feeds[0], steps, dimension_columns(runner.output_schema(steps[-1])), update=False)


def _apply_steps(runner, steps: list[str], df):
    from isbflow.steps.runner import ERROR_COLUMN

    for s in steps:
        df = runner.apply_transform(s, df).drop(ERROR_COLUMN, "_isb_raw")
    return df


def _windows_of(runner, plan: _AggPlan, rows_df) -> pa.Table:
    """The distinct (window_start[, window_end]) the aggregation gives ``rows_df`` (raw sink rows)."""
    out = _apply_steps(runner, plan.steps, rows_df)
    if "window_start" not in out.columns:
        raise ReprocessError(f"aggregate sink {plan.sink!r}: {plan.steps[-1]!r} gives no window_start column "
                             f"({', '.join(out.columns)}); its windows cannot be recomputed")
    cols = ["window_start", *(["window_end"] if "window_end" in out.columns else [])]
    return out.select(*cols).distinct().toArrow()


def _distinct_windows(parts: list[pa.Table]) -> pa.Table:
    names = parts[0].column_names
    merged = pa.concat_tables([t.select(names) for t in parts], promote_options="permissive")
    return merged.group_by(names, use_threads=False).aggregate([])


def _recomputed(spark, runner, plan: _AggPlan, windows: pa.Table, time_columns: Sequence[str]):
    """The aggregate rows of ``windows`` recomputed from the raw sink's current version, in batch.

    A sink fed by a ``udf.output: update`` step goes through
    :func:`isbflow.recovery.aggregates.recompute` (every raw row through the
    chain); any other through the same chain here, reading only the raw rows
    inside ``[min window_start, max window_end)`` when the raw sink has the
    source's event-time column (the windows are taken to be over it).
    """
    from pyspark.sql import functions as F

    touched = spark.createDataFrame(windows.select(["window_start"]))
    if plan.update:
        from isbflow.recovery.aggregates import recompute

        df, _, _ = recompute(spark, runner, plan.sink, runner.data_dir, None, raw_sink=plan.raw)
    else:
        raw = _spark_table(spark, runner.sink_path(runner.p.vertex(plan.raw)))
        tcol = next((c for c in time_columns if c in raw.columns), None)
        if tcol is not None and "window_end" in windows.column_names:
            lo, hi = pc.min(windows.column("window_start")).as_py(), pc.max(windows.column("window_end")).as_py()
            raw = raw.filter((F.col(tcol) >= F.lit(lo)) & (F.col(tcol) < F.lit(hi)))
        df = _apply_steps(runner, plan.steps, raw)
    names = [f.name for f in runner.input_schema(plan.sink).fields if f.name in df.columns]
    return df.join(F.broadcast(touched), "window_start", "left_semi").select(*names)


# ------------------------------------------------------------------ reprocess


class _Run:
    """One reprocess: the phases of the module docstring, sharing the session, runner and report."""

    def __init__(self, spark, runner, job: RecoveryJob, settings: NatsSettings):
        self.spark, self.runner, self.job = spark, runner, job
        self.run, self.nc = job.run, job.nc
        self.p: Pipeline = runner.p
        self.report: ReprocessReport = job.report  # type: ignore[assignment]
        self.settings = settings
        self.sources: dict[str, _Source] = {}
        self.region: set[str] = set()
        self.raw_sinks: list[str] = []
        self.plans: dict[str, _AggPlan] = {}
        self.results: dict[str, SinkReplace] = {}
        self.source_rows: dict[str, Any] = {}  # source vertex -> its parsed rows of the range
        self.outs: dict[str, Any] = {}
        self.cached: list[Any] = []
        self.before: dict[str, tuple[int, int]] = {}  # raw sink -> (rows, rows of the range) before
        self.running: list[str] = []

    # 1. plan
    def plan(self, lo_map: dict[str, int], hi_map: dict[str, int], by_time: bool, time_column: str | None) -> None:
        from isbflow.isb import state as st
        from isbflow.isb.read import stream_state

        t = time.monotonic()
        p, partitions = self.p, source_partitions(self.p)
        for part in (sorted(set(lo_map) | set(hi_map)) if not by_time else partitions):
            src = part.rpartition("/")[0]
            stream = naming.source_stream(p, src)
            sst = self.run(stream_state(self.nc, stream))
            if sst is None:
                raise ReprocessError(f"source stream {stream} of {src!r} does not exist: nothing to read again "
                                     "(provision and run the pipeline first)")
            committed = self.run(st.get_committed(self.nc, p.name, src, stream))
            if committed is None:
                raise RangeError(f"source {src!r} has committed nothing of {stream} yet (status key "
                                 f"{st.committed_key(src, stream)}): run the pipeline before reprocessing")
            s = self.sources[part] = _Source(src, part, stream, max(1, sst.first_seq), min(committed, sst.last_seq))
            if by_time:
                s.time_column = self.report.time_column[src] = _time_column(self.runner, src, time_column)
                s.scan = (s.first, s.committed)
        if not by_time:
            _plan_offsets(self.sources, lo_map, hi_map)
            self.report.range = {part: [list(s.scan)] for part, s in self.sources.items()}
        self.region = downstream(p, {s.vertex for s in self.sources.values()})
        self.report.region = [v for v in p.topological_order() if v in self.region]
        sinks = [v for v in self.report.region if p.vertex(v).sink is not None]
        self.raw_sinks = [v for v in sinks if ledger.ID_COLUMN in self.runner.input_schema(v).fieldNames()]
        for a in (v for v in sinks if v not in self.raw_sinks):
            plan = _agg_plan(self.runner, a, self.raw_sinks)
            if isinstance(plan, str):
                self.results[a] = SinkReplace(a, "aggregate", self._path(a),
                                              error=f"its windows cannot be recomputed: {plan}")
            else:
                self.plans[a] = plan
        statuses = self.run(st.all_status(self.nc, p.name, self.report.region))
        self.running = [v for v, s in statuses.items() if s is not None and s.age() < RUNNING_HEARTBEAT_S
                        and s.state in (st.Observed.RUNNING, st.Observed.DRAINING)]
        self.job.phase("plan", "done", t, range=self.report.range, running=self.running,
                        scan={k: list(s.scan) for k, s in self.sources.items()}, raw_sinks=self.raw_sinks,
                        aggregate_sinks=[v for v in sinks if v not in self.raw_sinks])

    def _path(self, sink: str) -> str:
        return self.runner.sink_path(self.p.vertex(sink))

    # 2. read
    def read(self, t_lo: datetime | None, t_hi: datetime | None, by_time: bool) -> None:
        from pyspark.sql import functions as F

        from isbflow.steps.runner import ERROR_COLUMN

        t, r = time.monotonic(), self.report
        for part, s in self.sources.items():
            lo, hi = s.scan
            if lo > hi:
                continue
            events = (self.spark.read.format("jetstream").option("settings", self.runner.settings_json)
                      .option("streams", s.stream).option("mode", "events").option("sourceName", s.vertex)
                      .option("startingOffsets", json.dumps({s.stream: {"seq": lo - 1}}))
                      .option("endingOffsets", json.dumps({s.stream: {"seq": hi}})).load())
            parsed = self._cache(self.runner.apply_transform(s.vertex, events))
            n = parsed.count()
            r.records_scanned += n
            good = parsed.filter(F.col(ERROR_COLUMN).isNull()).drop(ERROR_COLUMN, "_isb_raw")
            if by_time:
                c = F.col(s.time_column)
                if t_lo is not None:
                    good = good.filter(c >= F.lit(t_lo))
                if t_hi is not None:
                    good = good.filter(c < F.lit(t_hi))
                good = self._cache(good)
                ids = good.select(ledger.ID_COLUMN).toArrow().column(ledger.ID_COLUMN)
                if found := ledger.id_ranges(ids).get(part):
                    r.range[part] = found
                r.records_reread += len(ids)
            else:
                if n != hi - lo + 1:
                    raise ReprocessError(f"{part}: {hi - lo + 1 - n} of sequences {lo}..{hi} are missing from "
                                         f"source stream {s.stream} (removed meanwhile?); nothing was changed")
                r.records_reread += n
                r.dead_lettered += parsed.filter(F.col(ERROR_COLUMN).isNotNull()).count()
            self.source_rows[s.vertex] = good
        if by_time and not r.range:
            raise RangeError(f"no record of the sources has event time in [{t_lo}, {t_hi}): nothing to "
                             f"reprocess ({r.records_scanned:,} records scanned)")
        self.run(_check_in_flight(self.nc, self.p, self.region, r.range))
        # the windows the old rows of the range fall in: read before the raw sinks change
        from isbflow.sinks.delta import sink_version

        for plan in self.plans.values():
            raw_path = self._path(plan.raw)
            if sink_version(raw_path) is not None:
                plan.old_windows = _windows_of(self.runner, plan,
                                               filter_range(self.spark, _spark_table(self.spark, raw_path), r.range))
        self.job.phase("read", "done", t, range=r.range, records_reread=r.records_reread,
                        records_scanned=r.records_scanned, dead_lettered=r.dead_lettered)

    def _cache(self, df):
        df = df.persist()
        self.cached.append(df)
        return df

    def count(self) -> None:
        """Dry run: what the range covers in each sink now."""
        t = time.monotonic()
        for v in self.raw_sinks:
            ids, version = _table_ids(self._path(v))
            self.report.sinks.append(SinkReplace(v, "raw", self._path(v), version_before=version, version=version,
                                                 rows_before=int(in_ranges(ids, self.report.range).sum())))
        for a in self._agg_sinks():
            if a in self.results:
                self.report.sinks.append(self.results[a])
                continue
            n = self.plans[a].old_windows.num_rows if self.plans[a].old_windows is not None else 0
            self.report.sinks.append(SinkReplace(a, "aggregate", self._path(a), rows_before=n, windows_touched=n))
        self.job.phase("count", "done", t, sinks=[asdict(s) for s in self.report.sinks])

    def _agg_sinks(self) -> list[str]:
        return [v for v in self.report.region if self.p.vertex(v).sink is not None and v not in self.raw_sinks]

    def output(self, v: str):
        """The range's rows as vertex ``v`` outputs them (sinks: as they reach it), in batch; None if none."""
        from isbflow.steps.runner import ERROR_COLUMN

        if v not in self.outs:
            vx = self.p.vertex(v)
            if vx.source is not None:
                df = self.source_rows.get(v)
            else:
                ins = [d for d in (self.output(e.from_) for e in self.p.inputs(v)) if d is not None]
                df = None
                for d in ins:
                    df = d if df is None else df.unionByName(d)
                if df is not None and vx.sink is None:
                    df = self.runner.apply_transform(v, df).drop(ERROR_COLUMN, "_isb_raw")
            self.outs[v] = df
        return self.outs[v]

    def _metadata(self) -> dict[str, Any]:
        r = self.report
        return {REPROCESS_KEY: json.dumps({"mode": r.mode, "asked": r.asked, "range": r.range},
                                          separators=(",", ":"), default=str)}

    # 3. replace
    def replace(self) -> None:
        t = time.monotonic()
        for v in self.raw_sinks:
            self.results[v] = res = self._replace_raw(v)
            self.report.sinks.append(res)
            try:
                ledger.record_sync(self.settings, self.p.name, v, self.report.range)
            except Exception as e:  # noqa: BLE001 - the commit's isb.offsets hold the range too
                log.warning("reprocess %s: recording the range in the ledger of %s failed (%s)", self.p.name, v, e)
        self.job.phase("replace", "done", t, sinks={v: asdict(self.results[v]) for v in self.raw_sinks})

    def _replace_raw(self, v: str) -> SinkReplace:
        from isbflow.sinks.delta import delta_arrow_schema, replace_keys

        path, rng = self._path(v), self.report.range
        res = SinkReplace(v, "raw", path)
        df = self.output(v)
        if df is None:
            df = self.spark.createDataFrame([], self.runner.input_schema(v))
        rows = df.toArrow()
        rows = rows.cast(delta_arrow_schema(rows.schema))
        outside = int((~in_ranges(rows.column(ledger.ID_COLUMN), rng)).sum())
        if outside:
            raise ReprocessError(f"sink {v}: {outside} new row(s) carry an _isb_id outside the range (a transform "
                                 f"must carry _isb_id through unchanged); nothing was changed in {v}")
        meta = {**self._metadata(), ledger.OFFSETS_KEY: ledger.to_metadata(rng)}

        def attempt():
            ids, version = _table_ids(path)
            if version is None:
                raise ReprocessError(f"sink {v}: no Delta table at {path} (has the sink committed a batch?)")
            mask = in_ranges(ids, rng)
            res.version_before, res.rows_before = version, int(mask.sum())
            self.before[v] = (len(ids), res.rows_before)
            old = pa.table({ledger.ID_COLUMN: ids.filter(pa.array(mask))})
            return replace_keys(path, rows, old, key=ledger.ID_COLUMN, metadata=meta)

        r = _commit_with_retry(f"sink {v}", attempt)
        res.rows_after = rows.num_rows
        _count_commit(res, r)
        return res

    # 4. windows
    def windows(self) -> None:
        t = time.monotonic()
        aggs = self._agg_sinks()
        for a in aggs:
            if a not in self.results:
                self.results[a] = self._recompute(self.plans[a])
            self.report.sinks.append(self.results[a])
        self.job.phase("windows", "done" if aggs else "skipped", t,
                        sinks={a: asdict(self.results[a]) for a in aggs})

    def _recompute(self, plan: _AggPlan) -> SinkReplace:
        from isbflow.sinks.delta import delta_arrow_schema, replace_keys, sink_version

        path = self._path(plan.sink)
        res = SinkReplace(plan.sink, "aggregate", path, version_before=sink_version(path))
        res.version = res.version_before
        if self.running:
            res.note = (f"steps {', '.join(self.running)} run: a window still open in a streaming step's state "
                        "is emitted again from that state when new records reach it")
        if res.version_before is None:
            res.error = f"no Delta table at {path} (has the sink committed a batch?)"
            return res
        parts = [w for w in (plan.old_windows,) if w is not None]
        new = self.output(plan.raw)
        if new is not None:
            parts.append(_windows_of(self.runner, plan, new))
        windows = _distinct_windows(parts) if parts else None
        if windows is not None and not plan.update:
            windows = self._emitted_only(plan, path, windows, res)
        if windows is None or windows.num_rows == 0:
            return res
        res.windows_touched = windows.num_rows
        time_columns = [c for c in (s.time_column or _first_stamp(self.runner, s.vertex)
                                    for s in self.sources.values()) if c]
        rows = _recomputed(self.spark, self.runner, plan, windows, time_columns).toArrow()
        rows = rows.cast(delta_arrow_schema(rows.schema))
        touched = self.spark.createDataFrame(windows.select(["window_start"]))

        def attempt():
            from pyspark.sql import functions as F

            old = _spark_table(self.spark, path).join(F.broadcast(touched), "window_start", "left_semi")
            old_keys = old.select(*plan.keys).toArrow()
            res.rows_before = old_keys.num_rows
            return replace_keys(path, rows, old_keys, key=plan.keys, metadata=self._metadata())

        r = _commit_with_retry(f"aggregate sink {plan.sink}", attempt)
        res.rows_after = rows.num_rows
        _count_commit(res, r)
        return res

    @staticmethod
    def _emitted_only(plan: _AggPlan, path: str, windows: pa.Table, res: SinkReplace) -> pa.Table:
        """Of ``windows``, those an append-mode aggregate sink holds: the others are still open in the
        streaming step, which emits them once the watermark passes (writing them now would double them)."""
        from deltalake import DeltaTable

        held = DeltaTable(path).to_pyarrow_table(columns=["window_start"]).column("window_start")
        held = pc.unique(held.cast(windows.schema.field("window_start").type).combine_chunks())
        kept = windows.filter(pc.is_in(windows.column("window_start"), value_set=held))
        if kept.num_rows < windows.num_rows:
            res.note = " ".join(filter(None, [res.note, (
                f"{windows.num_rows - kept.num_rows} touched window(s) not yet emitted by {plan.steps[-1]} (still "
                "open in its state) were left to it")]))
        return kept

    # 5. verify
    def verify(self) -> None:
        from deltalake import DeltaTable

        t = time.monotonic()
        rng = self.report.range
        for v in self.raw_sinks:
            res = self.results[v]
            ids, _ = _table_ids(res.path)
            res.duplicates = len(ids) - (pc.count_distinct(ids).as_py() if len(ids) else 0)
            in_now = int(in_ranges(ids, rng).sum())
            res.range_mismatch = in_now - res.rows_after
            total_before, in_before = self.before.get(v, (0, 0))
            res.outside_changed = (len(ids) - in_now) - (total_before - in_before)
        for a, plan in self.plans.items():
            res = self.results[a]
            if res.error is None:
                keys = DeltaTable(res.path).to_pyarrow_table(columns=plan.keys)
                res.duplicates = keys.num_rows - keys.group_by(plan.keys, use_threads=False).aggregate([]).num_rows
        self.job.phase("verify", "done" if all(s.ok for s in self.report.sinks) else "failed", t,
                        sinks=[asdict(s) for s in self.report.sinks])

    def close(self) -> None:
        for df in self.cached:
            try:
                df.unpersist()
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.debug("unpersist failed", exc_info=True)


def _count_commit(res: SinkReplace, r) -> None:
    res.deleted, res.updated, res.inserted = r.deleted, r.updated, r.inserted
    res.commits = 0 if r.version is None else 1
    res.version = res.version_before if r.version is None else r.version


def _first_stamp(runner, vertex: str) -> str | None:
    try:
        return _time_column(runner, vertex, None)
    except RangeError:
        return None


def _check_asked(p: Pipeline, from_offset: OffsetArg, to_offset: OffsetArg, from_time: TimeArg,
                 to_time: TimeArg) -> tuple[dict[str, int], dict[str, int], datetime | None, datetime | None]:
    """The range asked for, parsed: (from offsets, to offsets, from time, to time); RangeError if wrong."""
    by_offsets = from_offset is not None or to_offset is not None
    by_time = from_time is not None or to_time is not None
    if by_offsets and by_time:
        raise RangeError("give a range by source offsets (from/to) OR by event time (from_time/to_time), not both")
    if not (by_offsets or by_time):
        raise RangeError(f"give the range to reprocess: source offsets (from/to: {OFFSET_FORMS}) or event "
                         "times (from_time/to_time)")
    partitions = source_partitions(p)
    if not partitions:
        raise RangeError(f"pipeline {p.name} has no JetStream source: reprocess reads source offsets again from "
                         "a source stream")
    lo_map, hi_map = parse_offsets(from_offset, partitions, "from"), parse_offsets(to_offset, partitions, "to")
    t_lo, t_hi = parse_time(from_time, "from"), parse_time(to_time, "to")
    if t_lo is not None and t_hi is not None and t_lo >= t_hi:
        raise RangeError(f"the event-time range [{t_lo.isoformat()}, {t_hi.isoformat()}) is empty: 'from' must "
                         "lie before 'to'")
    return lo_map, hi_map, t_lo, t_hi


def reprocess(spark, specs: Specs, pipeline: Pipeline, settings: NatsSettings, data_dir: Path, *,
              from_offset: OffsetArg = None, to_offset: OffsetArg = None, from_time: TimeArg = None,
              to_time: TimeArg = None, dry_run: bool = False, on_phase: Callable[[Phase], None] | None = None,
              time_column: str | None = None) -> ReprocessReport:
    """Reprocess a source range of ``pipeline`` (module docstring); returns the report.

    The range is by source offsets (``from_offset``/``to_offset``: see
    :func:`parse_offsets`; both included) or by event time
    (``from_time``/``to_time``: datetimes or time expressions; ``[from, to)``,
    on ``time_column`` or each source's first TIMESTAMP column), each side open
    when None, not both kinds. ``spark`` is a SparkSession or a function making
    one. Raises :class:`RangeError` for a range that is malformed or cannot be
    reprocessed, :class:`ReprocessError` when a phase cannot proceed; the report
    so far is in the status bucket (key ``reprocess``) either way.
    """

    from isbflow.steps.runner import PipelineRunner

    p = pipeline
    by_time = from_time is not None or to_time is not None
    report = ReprocessReport(p.name, mode="event-time" if by_time else "offsets", dry_run=dry_run)
    report.asked = ({"from_time": _text(from_time), "to_time": _text(to_time)} if by_time
                    else {"from": _text(from_offset), "to": _text(to_offset)})
    job = RecoveryJob(settings, p, report, verb="reprocess", status_key=STATUS_KEY, on_phase=on_phase)
    run = None
    try:
        lo_map, hi_map, t_lo, t_hi = _check_asked(p, from_offset, to_offset, from_time, to_time)
        spark = spark() if callable(spark) else spark
        job.connect()
        run = _Run(spark, PipelineRunner(spark, specs, p, settings, Path(data_dir).absolute()), job, settings)
        run.plan(lo_map, hi_map, by_time, time_column)
        run.read(t_lo, t_hi, by_time)
        if dry_run:
            run.count()
            report.state = "planned"
        else:
            run.replace()
            run.windows()
            run.verify()
            report.state = "reprocessed"
        job.publish()
        return report
    except BaseException as e:
        job.failed(e)
        raise
    finally:
        if run is not None:
            run.close()
            run.runner.close()
        job.close()


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat() if isinstance(value, datetime) else str(value)
