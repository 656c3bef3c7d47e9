"""Promote a reviewed shadow reprocess into the live sinks: one Delta commit per raw sink, then the windows.

Contract: :func:`promote` reads the run record of a shadow reprocess
(:mod:`isbflow.recovery.shadow`) and refuses, changing nothing
(:class:`PromoteRefused`, naming what):

- a run already promoted;
- a raw sink whose suite has not run on its shadow table, or failed there with
  an ``onFailure: fail`` gate (the failed checks are named; a ``warn`` gate's
  failures are reported and do not block, as in ``quality run``);
- a shadow table that is gone;
- a live raw sink whose rows *of the range* differ from those at the version
  the shadow was made from (a reprocess or a recovery ran meanwhile; a sink that
  only gained rows outside the range is fine: the promote touches the range only).
  The shadow is stale: make a new one. When the live table cannot be read at
  that version any more (vacuumed) it refuses too.

Then it runs reprocess's phases with the shadow's rows
(:class:`~isbflow.recovery.reprocess.ReprocessRun`): **replace** (each raw
sink's rows of the range replaced by the shadow table's rows of the range in
ONE Delta merge commit, :func:`isbflow.sinks.delta.replace_keys`; the range
added to the ledger), **windows** (aggregate sinks' touched windows recomputed
from the live raw sink, as reprocess does) and **verify**; the record is marked
promoted. The report is a :class:`~isbflow.recovery.reprocess.ReprocessReport`
with state ``promoted`` and ``shadow_run`` set; it is also published under the
status bucket's ``reprocess`` key.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa

from isbflow.isb import ledger
from isbflow.isb import state as st
from isbflow.isb.connect import NatsSettings
from isbflow.local.delta import load_table
from isbflow.local.delta_arrow import arrow_table
from isbflow.recovery.job import Phase, RecoveryJob, running_steps
from isbflow.recovery.reprocess import STATUS_KEY, ReprocessReport, ReprocessRun, SinkReplace
from isbflow.recovery.reprocess_plan import ReprocessError, Source, in_ranges
from isbflow.recovery.reprocess_windows import agg_plan, old_windows
from isbflow.recovery.shadow import ShadowRun, load_run, save_run
from isbflow.recovery.shadow_diff import diff_rows
from isbflow.sinks.delta import open_table
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.steps.runner import PipelineRunner


class PromoteRefused(ReprocessError):
    """The shadow may not be promoted (module docstring); nothing was changed."""


def suite_refusals(rec: ShadowRun) -> list[str]:
    """Why the shadow's suites forbid the promote (empty: they allow it)."""
    out = []
    for s in (s for s in rec.sinks if s.kind == "raw"):
        q = s.quality
        if q is None:
            out.append(f"sink {s.sink}: its suite has not run on the shadow table {s.shadow_path} (run the "
                       "shadow reprocess again)")
        elif q.get("gate_failed"):
            checks = ", ".join(f"{f['name']} ({f.get('unexpected_count', 0)} unexpected)"
                               for f in q.get("failures", [])) or "unknown"
            out.append(f"sink {s.sink}: the suite failed on the shadow table (quality run {q.get('run_id')}, "
                       f"gate {q.get('gate')}): failed check(s) {checks}")
    return out


def _range_rows(path: str, rng: dict, version: int | None = None) -> pa.Table:
    t = arrow_table(load_table(path, version=version))
    return t.filter(pa.array(in_ranges(t.column(ledger.ID_COLUMN), rng)))


class PromoteRun(ReprocessRun):
    """Reprocess's replace, windows and verify phases fed by a shadow run's tables (module docstring)."""

    def __init__(self, job: RecoveryJob, spark, runner: PipelineRunner, settings: NatsSettings, rec: ShadowRun):
        super().__init__(job, spark, runner, settings)
        self.rec = rec
        self.region = set(rec.region)
        self.raw_sinks = [s.sink for s in rec.sinks if s.kind == "raw"]
        self.sources = {part: Source(part.rpartition("/")[0], part, "", 0, 0,
                                     time_column=rec.time_column.get(part.rpartition("/")[0]))
                        for part in rec.range}
        self.new: dict[str, pa.Table] = {}
        self.frames: dict[str, Any] = {}

    def new_rows(self, v: str) -> pa.Table:
        """The shadow table's rows of the range (what the review saw)."""
        if v not in self.new:
            self.new[v] = _range_rows(str(self.rec.sink(v).shadow_path), self.report.range)
        return self.new[v]

    def new_frame(self, v: str):
        if v not in self.raw_sinks:
            return None
        if v not in self.frames:
            self.frames[v] = self.spark.createDataFrame(self.new_rows(v))
        return self.frames[v]

    def check(self) -> None:
        """The shadow tables are there and no live raw sink changed its range since the shadow; the
        aggregate sinks' plans and the windows their old rows fall in (before anything changes)."""
        t, rng = time.monotonic(), self.report.range
        moved: dict[str, list[int]] = {}
        for s in (s for s in self.rec.sinks if s.kind == "raw"):
            if open_table(str(s.shadow_path)) is None:
                raise PromoteRefused(f"sink {s.sink}: the shadow table {s.shadow_path} is gone; nothing was "
                                     "promoted: run the shadow reprocess again")
            live = open_table(s.live_path)
            now = live.version() if live is not None else None
            if now == s.live_version:
                continue
            try:
                d = diff_rows(_range_rows(s.live_path, rng, s.live_version), _range_rows(s.live_path, rng),
                              [ledger.ID_COLUMN], sample=0)
            except Exception as e:  # noqa: BLE001 - vacuumed, or no table: cannot prove it did not move
                raise PromoteRefused(f"sink {s.sink}: the live table moved from version {s.live_version} (the "
                                     f"shadow's) to {now} and cannot be compared at {s.live_version} ({e}); "
                                     "nothing was promoted: run the shadow reprocess again") from None
            if d["added"] or d["removed"] or d["changed"]:
                raise PromoteRefused(
                    f"sink {s.sink}: the live table's rows of the range changed since the shadow was made "
                    f"(version {s.live_version} -> {now}: {d['added']} added, {d['removed']} removed, "
                    f"{d['changed']} changed); the shadow is stale, nothing was promoted: run the shadow "
                    "reprocess again")
            moved[s.sink] = [int(s.live_version or 0), int(now or 0)]
        for a in (s.sink for s in self.rec.sinks if s.kind == "aggregate"):
            plan = agg_plan(self.runner, a, self.raw_sinks)
            if isinstance(plan, str):
                self.results[a] = SinkReplace(a, "aggregate", self.path(a),
                                              error=f"its windows cannot be recomputed: {plan}")
            else:
                plan.old_windows = old_windows(self.spark, self.runner, plan, rng)
                self.plans[a] = plan
        self.running = running_steps(self.job.run(st.all_status(self.job.nc, self.p.name, self.report.region)))
        self.job.phase("check", "done", t, moved_outside_the_range=moved, running=self.running)


def promote(spark, specs: Specs, pipeline: Pipeline, settings: NatsSettings, data_dir: Path, run: str, *,
            on_phase: Callable[[Phase], None] | None = None) -> ReprocessReport:
    """Promote shadow run ``run`` of ``pipeline`` (module docstring); the report.

    ``spark``: a SparkSession or a function making one (started only once the record allows the
    promote). Raises :class:`~isbflow.recovery.shadow.ShadowError` for an unknown run,
    :class:`PromoteRefused` when it may not be promoted, :class:`ReprocessError` when a phase fails.
    """
    p = pipeline
    rec = load_run(data_dir, p.name, run)
    report = ReprocessReport(p.name, mode=rec.mode, asked=dict(rec.asked), time_column=dict(rec.time_column),
                             range=rec.range, region=list(rec.region), shadow_run=run)
    if rec.state == "promoted":
        raise PromoteRefused(f"shadow run {run} was promoted already ({(rec.promoted or {}).get('at')}); "
                             "nothing was changed")
    refusals = suite_refusals(rec)
    if refusals:
        raise PromoteRefused(f"shadow run {run} is not promoted: " + "; ".join(refusals))
    with RecoveryJob(settings, p, report, verb="promote", status_key=STATUS_KEY, on_phase=on_phase) as job:
        spark = spark() if callable(spark) else spark
        job.connect()
        r = job.own(PromoteRun(job, spark, PipelineRunner(spark, specs, p, settings, Path(data_dir).absolute()),
                               settings, rec))
        r.check()
        r.replace()
        r.windows()
        r.verify()
        report.state = "promoted"
        rec.state = "promoted"
        rec.promoted = {"at": datetime.now(UTC).isoformat(), "ok": report.ok,
                        "versions": {s.sink: s.version for s in report.sinks}}
        save_run(data_dir, rec)
        job.publish()
        return report
