"""Reprocess a source range: run it again through the current step code and replace its earlier output.

The batch half of batch-plus-streaming (docs/concepts/replays.md): a
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
   schema's first ``TIMESTAMP`` column (or ``time_column``). The parsing and
   checks are :mod:`isbflow.recovery.reprocess_plan`.
2. **read** (:mod:`isbflow.recovery.reprocess_read`): one batch read of the
   source range (for event time, the partition up to its committed offset,
   filtered on the time column), parsed like the source step does. Malformed
   records are skipped (the dead-letter buffer already holds them; counted in
   ``dead_lettered``). Then no *unconsumed* frame of the region's buffers may
   carry an id of the range (it would reach the sinks after the replacement).
3. **replace**: per sink with ``_isb_id`` ("raw"): the range's records run
   through the chain of transforms between the source and the sink, in batch
   (not through the buffers), and :func:`isbflow.sinks.delta.replace_keys`
   replaces the sink's rows of the range by them in ONE Delta commit (a merge:
   rows of range ids the new output lacks are deleted, the others updated or
   inserted; nothing outside the range is touched). A reader sees the range all
   old or all new. The commit carries ``isb.offsets`` (the range) and
   ``isb.reprocess`` (what was run), and the range is added to the ledger KV:
   every record of the range has been processed into the sink.
4. **windows** (:mod:`isbflow.recovery.reprocess_windows`): per sink without
   ``_isb_id`` ("aggregate", rows keyed by ``window_start`` and group
   columns): the windows the range touches, from its old rows and its new
   ones, are recomputed in batch from the raw sink fed by the same upstream
   step, after its replacement, through the current aggregation code (a
   watermark is a no-op in batch: every record counts), and replace the
   sink's rows of those windows in one commit (a key no record makes any more
   is deleted).
5. **verify**: per raw sink, no duplicate ``_isb_id``, the range holds exactly
   the new rows, the row count outside the range is unchanged; per aggregate
   sink, no key twice.

``dry_run``: plan and read only; reports how many records would be re-read
and, per sink, how many rows (windows) the range covers now; nothing changes.

``shadow``: plan and read, then phase **shadow** instead of 3-5
(:mod:`isbflow.recovery.shadow`): each raw sink's new output goes to a shadow
table beside it (the live table as it is, with the range replaced) with a diff
against the live rows; the live tables are not touched. The run is recorded
under ``<data dir>/shadow/<pipeline>/<run>/`` for review (its suites run on the
shadow tables: :mod:`isbflow.ops.replay`) and for
:func:`isbflow.recovery.reprocess_promote.promote`, which runs phases 3-5 with
the shadow's rows.

Limits: a stateful streaming step still holding an open window in its state
emits that window again from its state when new records reach it; reprocess
a range whose windows have closed. Offsets are JetStream sequences of the
source stream (one partition per JetStream source, ``<source>/0``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from isbflow.isb import ledger
from isbflow.isb import state as st
from isbflow.isb.connect import NatsSettings
from isbflow.isb.errors import LedgerFull
from isbflow.local.delta import load_table
from isbflow.local.delta_arrow import arrow_table
from isbflow.recovery.job import Phase, RecoveryJob, downstream, running_steps
from isbflow.recovery.reprocess_plan import (
    OFFSET_FORMS,
    OffsetArg,
    RangeError,
    ReprocessError,
    Source,
    TimeArg,
    check_asked,
    event_time_column,
    in_ranges,
    parse_offsets,
    parse_time,
    plan_offsets,
    source_partitions,
)
from isbflow.recovery.reprocess_read import RangeRows, check_in_flight, source_of
from isbflow.recovery.reprocess_report import ReprocessReport, SinkReplace
from isbflow.recovery.reprocess_windows import (
    AggPlan,
    agg_plan,
    commit_with_retry,
    old_windows,
    replace_windows,
)
from isbflow.recovery.shadow import write_shadows
from isbflow.sinks.delta import delta_arrow_schema, read_ids, replace_keys, sink_version
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.steps.restart import retry_transient
from isbflow.steps.runner import PipelineRunner

log = logging.getLogger(__name__)

__all__ = ["OFFSET_FORMS", "REPROCESS_KEY", "STATUS_KEY", "OffsetArg", "RangeError", "ReprocessError",
           "ReprocessReport", "ReprocessRun", "SinkReplace", "TimeArg", "in_ranges", "parse_offsets", "parse_time",
           "reprocess", "source_partitions"]

STATUS_KEY = "reprocess"
#: commit metadata key describing the reprocess that made a commit
REPROCESS_KEY = "isb.reprocess"


# ------------------------------------------------------------------ reprocess


def reprocess(spark, specs: Specs, pipeline: Pipeline, settings: NatsSettings, data_dir: Path, *,
              from_offset: OffsetArg = None, to_offset: OffsetArg = None, from_time: TimeArg = None,
              to_time: TimeArg = None, dry_run: bool = False, on_phase: Callable[[Phase], None] | None = None,
              time_column: str | None = None, shadow: bool = False) -> ReprocessReport:
    """Reprocess a source range of ``pipeline`` (module docstring); returns the report.

    The range is by source offsets (``from_offset``/``to_offset``: see
    :func:`parse_offsets`; both included) or by event time
    (``from_time``/``to_time``: datetimes or time expressions; ``[from, to)``,
    on ``time_column`` or each source's first TIMESTAMP column), each side open
    when None, not both kinds. ``spark`` is a SparkSession or a function making
    one. Raises :class:`RangeError` for a range that is malformed or cannot be
    reprocessed, :class:`ReprocessError` when a phase cannot proceed; the report
    so far is in the status bucket (key ``reprocess``) either way. ``shadow``: write shadow
    tables and a run record instead of replacing (module docstring).
    """
    p = pipeline
    by_time = from_time is not None or to_time is not None
    report = ReprocessReport(p.name, mode="event-time" if by_time else "offsets", dry_run=dry_run)
    report.asked = ({"from_time": _text(from_time), "to_time": _text(to_time)} if by_time
                    else {"from": _text(from_offset), "to": _text(to_offset)})
    with RecoveryJob(settings, p, report, verb="reprocess", status_key=STATUS_KEY, on_phase=on_phase) as job:
        lo_map, hi_map, t_lo, t_hi = check_asked(p, from_offset, to_offset, from_time, to_time)
        spark = spark() if callable(spark) else spark
        job.connect()
        r = job.own(ReprocessRun(job, spark, PipelineRunner(spark, specs, p, settings, Path(data_dir).absolute()),
                                 settings))
        r.plan(lo_map, hi_map, by_time, time_column)
        r.read(t_lo, t_hi, by_time)
        if dry_run:
            r.count()
            report.state = "planned"
        elif shadow:
            write_shadows(r, Path(data_dir).absolute())
            report.state = "shadowed"
        else:
            r.replace()
            r.windows()
            r.verify()
            report.state = "reprocessed"
        job.publish()
        return report


def _text(value: Any) -> str | None:
    if value is None:
        return None
    return value.isoformat() if isinstance(value, datetime) else str(value)


class ReprocessRun:
    """The phases of one reprocess (module docstring), sharing the job, the session, the runner and
    what the plan and the read found (the source partitions, the region's sinks, the range's rows).
    A promote (:mod:`isbflow.recovery.reprocess_promote`) runs phases 3-5 with the shadow's rows:
    :meth:`new_rows` and :meth:`new_frame` are what it replaces."""

    def __init__(self, job: RecoveryJob, spark, runner: PipelineRunner, settings: NatsSettings):
        self.job, self.spark, self.runner, self.settings = job, spark, runner, settings
        self.p: Pipeline = job.p
        self.report: ReprocessReport = job.report  # type: ignore[assignment]
        self.sources: dict[str, Source] = {}
        self.region: set[str] = set()
        self.raw_sinks: list[str] = []
        self.plans: dict[str, AggPlan] = {}
        self.results: dict[str, SinkReplace] = {}
        self.rows = RangeRows(spark, runner)
        self.before: dict[str, tuple[int, int]] = {}  # raw sink -> (rows, rows of the range) before
        self.running: list[str] = []

    def plan(self, lo_map: dict[str, int], hi_map: dict[str, int], by_time: bool, given_column: str | None) -> None:
        """1. The range per source partition, checked against its stream and committed offset; the
        region, its raw sinks and how each aggregate sink's windows are recomputed."""
        t, p, job = time.monotonic(), self.p, self.job
        for part in (sorted(set(lo_map) | set(hi_map)) if not by_time else source_partitions(p)):
            s = self.sources[part] = job.run(source_of(job.nc, p, part))
            if by_time:
                schema = self.runner.source_schema(p.vertex(s.vertex))
                s.time_column = self.report.time_column[s.vertex] = event_time_column(schema, s.vertex, given_column)
                s.scan = (s.first, s.committed)
        if not by_time:
            plan_offsets(self.sources, lo_map, hi_map)
            self.report.range = {part: [list(s.scan)] for part, s in self.sources.items()}
        self.region = downstream(p, {s.vertex for s in self.sources.values()})
        self.report.region = [v for v in p.topological_order() if v in self.region]
        sinks = [v for v in self.report.region if p.vertex(v).sink is not None]
        self.raw_sinks = [v for v in sinks if ledger.ID_COLUMN in self.runner.input_schema(v).fieldNames()]
        for a in (v for v in sinks if v not in self.raw_sinks):
            plan = agg_plan(self.runner, a, self.raw_sinks)
            if isinstance(plan, str):
                self.results[a] = SinkReplace(a, "aggregate", self.path(a),
                                              error=f"its windows cannot be recomputed: {plan}")
            else:
                self.plans[a] = plan
        self.running = running_steps(job.run(st.all_status(job.nc, p.name, self.report.region)))
        job.phase("plan", "done", t, range=self.report.range, running=self.running,
                  scan={k: list(s.scan) for k, s in self.sources.items()}, raw_sinks=self.raw_sinks,
                  aggregate_sinks=[v for v in sinks if v not in self.raw_sinks])

    def path(self, sink: str) -> str:
        return self.runner.sink_path(self.p.vertex(sink))

    def read(self, t_lo: datetime | None, t_hi: datetime | None, by_time: bool) -> None:
        """2. One batch read of the range per source partition, parsed; nothing of it still in flight;
        the windows its old rows fall in (before the raw sinks change)."""
        t, r = time.monotonic(), self.report
        for part, s in self.sources.items():
            lo, hi = s.scan
            if lo > hi:
                continue
            got = self.rows.read(s, t_lo, t_hi, by_time)
            r.records_scanned += got.scanned
            if by_time:
                if got.ranges:
                    r.range[part] = got.ranges
            elif got.scanned != hi - lo + 1:
                raise ReprocessError(f"{part}: {hi - lo + 1 - got.scanned} of sequences {lo}..{hi} are missing "
                                     f"from source stream {s.stream} (removed meanwhile?); nothing was changed")
            r.records_reread += got.reread
            if not by_time:
                r.dead_lettered += self.rows.malformed(s)
        if by_time and not r.range:
            raise RangeError(f"no record of the sources has event time in [{t_lo}, {t_hi}): nothing to "
                             f"reprocess ({r.records_scanned:,} records scanned)")
        self.job.run(check_in_flight(self.job.nc, self.p, self.region, r.range))
        for plan in self.plans.values():
            plan.old_windows = old_windows(self.spark, self.runner, plan, r.range)
        self.job.phase("read", "done", t, range=r.range, records_reread=r.records_reread,
                       records_scanned=r.records_scanned, dead_lettered=r.dead_lettered)

    def count(self) -> None:
        """Dry run: what the range covers in each sink now."""
        t = time.monotonic()
        for v in self.raw_sinks:
            ids, version = read_ids(self.path(v))
            self.report.sinks.append(SinkReplace(v, "raw", self.path(v), version_before=version, version=version,
                                                 rows_before=int(in_ranges(ids, self.report.range).sum())))
        for a in self.agg_sinks():
            if a in self.results:
                self.report.sinks.append(self.results[a])
                continue
            n = self.plans[a].old_windows.num_rows if self.plans[a].old_windows is not None else 0
            self.report.sinks.append(SinkReplace(a, "aggregate", self.path(a), rows_before=n, windows_touched=n))
        self.job.phase("count", "done", t, sinks=[asdict(s) for s in self.report.sinks])

    def agg_sinks(self) -> list[str]:
        return [v for v in self.report.region if self.p.vertex(v).sink is not None and v not in self.raw_sinks]

    def metadata(self) -> dict[str, Any]:
        r = self.report
        shadow = {"shadow_run": r.shadow_run} if r.shadow_run else {}
        return {REPROCESS_KEY: json.dumps({"mode": r.mode, "asked": r.asked, "range": r.range, **shadow},
                                          separators=(",", ":"), default=str)}

    def replace(self) -> None:
        """3. Each raw sink's rows of the range replaced by the range's new rows, one commit each."""
        t = time.monotonic()
        for v in self.raw_sinks:
            self.results[v] = res = self._replace_raw(v)
            self.report.sinks.append(res)
            try:
                ledger.record_sync(self.settings, self.p.name, v, self.report.range)
            except LedgerFull:
                raise  # never a ledger that silently stops advancing (isbflow.isb.ledger)
            except Exception as e:  # noqa: BLE001 - the commit's isb.offsets hold the range too
                log.warning("reprocess %s: recording the range in the ledger of %s failed (%s)", self.p.name, v, e)
        self.job.phase("replace", "done", t, sinks={v: asdict(self.results[v]) for v in self.raw_sinks})

    def new_frame(self, v: str):
        """The range's rows as vertex ``v`` receives them now: a Spark DataFrame, None if none."""
        return self.rows.output(v)

    def new_rows(self, v: str) -> pa.Table:
        """The range's new rows of raw sink ``v`` (Arrow, Delta types), each id inside the range."""
        df = self.new_frame(v)
        if df is None:
            df = self.spark.createDataFrame([], self.runner.input_schema(v))
        rows = retry_transient(df.toArrow, f"reprocessing the rows of {v}")
        rows = rows.cast(delta_arrow_schema(rows.schema))
        outside = int((~in_ranges(rows.column(ledger.ID_COLUMN), self.report.range)).sum())
        if outside:
            raise ReprocessError(f"sink {v}: {outside} new row(s) carry an _isb_id outside the range (a transform "
                                 f"must carry _isb_id through unchanged); nothing was changed in {v}")
        return rows

    def _replace_raw(self, v: str) -> SinkReplace:
        path, rng = self.path(v), self.report.range
        res = SinkReplace(v, "raw", path)
        rows = self.new_rows(v)
        meta = {**self.metadata(), ledger.OFFSETS_KEY: ledger.to_metadata(rng)}

        def attempt():
            ids, version = read_ids(path)
            if version is None:
                raise ReprocessError(f"sink {v}: no Delta table at {path} (has the sink committed a batch?)")
            mask = in_ranges(ids, rng)
            res.version_before, res.rows_before = version, int(mask.sum())
            self.before[v] = (len(ids), res.rows_before)
            old = pa.table({ledger.ID_COLUMN: ids.filter(pa.array(mask))})
            return replace_keys(path, rows, old, key=ledger.ID_COLUMN, metadata=meta)

        r = commit_with_retry(f"sink {v}", attempt)
        res.rows_after = rows.num_rows
        _count_commit(res, r)
        return res

    def windows(self) -> None:
        """4. Each aggregate sink's windows the range touches, recomputed and replaced in one commit."""
        t = time.monotonic()
        aggs = self.agg_sinks()
        for a in aggs:
            if a not in self.results:
                self.results[a] = self._replace_windows(self.plans[a])
            self.report.sinks.append(self.results[a])
        self.job.phase("windows", "done" if aggs else "skipped", t,
                       sinks={a: asdict(self.results[a]) for a in aggs})

    def _replace_windows(self, plan: AggPlan) -> SinkReplace:
        path = self.path(plan.sink)
        res = SinkReplace(plan.sink, "aggregate", path, version_before=sink_version(path))
        res.version = res.version_before
        if self.running:
            res.note = (f"steps {', '.join(self.running)} run: a window still open in a streaming step's state "
                        "is emitted again from that state when new records reach it")
        if res.version_before is None:
            res.error = f"no Delta table at {path} (has the sink committed a batch?)"
            return res
        done = replace_windows(self.spark, self.runner, plan, path, self.new_frame(plan.raw), self.sources.values(),
                               self.metadata())
        res.note = " ".join(filter(None, [res.note, done.note])) or None
        res.windows_touched, res.rows_before, res.rows_after = done.windows_touched, done.rows_before, done.rows_after
        if done.commit is not None:
            _count_commit(res, done.commit)
        return res

    def verify(self) -> None:
        """5. Raw sinks: no duplicate id, the range holds exactly the new rows, nothing outside it
        changed; aggregate sinks: no key twice."""
        t = time.monotonic()
        rng = self.report.range
        for v in self.raw_sinks:
            res = self.results[v]
            ids, _ = read_ids(res.path)
            res.duplicates = len(ids) - (pc.count_distinct(ids).as_py() if len(ids) else 0)
            in_now = int(in_ranges(ids, rng).sum())
            res.range_mismatch = in_now - res.rows_after
            total_before, in_before = self.before.get(v, (0, 0))
            res.outside_changed = (len(ids) - in_now) - (total_before - in_before)
        for a, plan in self.plans.items():
            res = self.results[a]
            if res.error is None:
                keys = arrow_table(load_table(res.path), columns=plan.keys)
                res.duplicates = keys.num_rows - keys.group_by(plan.keys, use_threads=False).aggregate([]).num_rows
        self.job.phase("verify", "done" if all(s.ok for s in self.report.sinks) else "failed", t,
                       sinks=[asdict(s) for s in self.report.sinks])

    def close(self) -> None:
        self.rows.close()
        self.runner.close()


def _count_commit(res: SinkReplace, r) -> None:
    res.deleted, res.updated, res.inserted = r.deleted, r.updated, r.inserted
    res.commits = 0 if r.version is None else 1
    res.version = res.version_before if r.version is None else r.version
