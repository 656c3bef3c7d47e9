"""Shadow reprocess: a range's new output written beside the sinks, diffed, recorded for review and promote.

Contract. :func:`write_shadows` is phase **shadow** of a reprocess
(:func:`isbflow.recovery.reprocess.reprocess` with ``shadow=True``, after its
plan and read phases): per raw sink it writes a **shadow table** under
``<data dir>/shadow/<pipeline>/<run>/<sink>``: the live table's current
version with the range's rows replaced by the rows the current code makes
(one Delta table, version 0, whose commit carries the live table's
``isb.offsets`` up to that version plus the range, so quality's completeness
and ``quality verify`` judge it as they would the live sink after a promote).
It diffs the live rows of the range against the new ones
(:func:`isbflow.recovery.shadow_diff.diff_rows`) and writes the **run record**
``run.json`` (:class:`ShadowRun`): pipeline, range, per sink the live and shadow
paths, the live table version the shadow was made from and the diff. **The
live tables are never written.** Aggregate sinks get no shadow table: their
windows touched by the range are counted and recomputed from the raw sink when
the shadow is promoted, as a reprocess does.

Run ids are ``reprocess-<UTC yyyymmddThhmmssZ>`` (``-2``, ``-3``... within one
second); :func:`load_run` accepts nothing else, so a run id typed in a form
never names a path outside the shadow folder. The sinks' suites run on the
shadow tables in :mod:`isbflow.ops.replay` (quality is a sibling layer), which
stores each verdict in the record (:func:`record_quality`); the promote
(:mod:`isbflow.recovery.reprocess_promote`) reads them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, write_deltalake

from isbflow.isb import ledger
from isbflow.local.delta_arrow import arrow_table
from isbflow.recovery.reprocess_plan import ReprocessError, in_ranges
from isbflow.recovery.reprocess_report import SinkReplace
from isbflow.recovery.reprocess_windows import distinct_windows, windows_of
from isbflow.recovery.shadow_diff import diff_rows
from isbflow.sinks.delta import open_table, read_ids
from isbflow.spec.paths import DataDir, private_dir

RUN_PREFIX = "reprocess-"
_RUN_ID = re.compile(r"^reprocess-\d{8}T\d{6}Z(-\d+)?$")
RECORD = "run.json"
#: shadow runs kept per pipeline (tables and records); a new run removes the oldest beyond these
RUNS_KEPT = 10
#: commit metadata of a shadow table: the run, and the live table (path, version) it was made from
SHADOW_KEY = "isb.shadow"


class ShadowError(ReprocessError):
    """No such shadow run, or a record that cannot be read."""


@dataclass
class ShadowSink:
    """One sink of a shadow run, as recorded."""

    sink: str
    kind: str  # raw | aggregate
    live_path: str
    shadow_path: str | None = None  # raw only
    live_version: int | None = None  # the live table's version the shadow was made from
    rows_before: int = 0  # raw: live rows of the range; aggregate: windows touched
    rows_after: int = 0  # raw: new rows of the range
    diff: dict[str, Any] | None = None
    #: the suite's verdict on the shadow table: {run_id, success, gate, gate_failed, failures: [{name,
    #: unexpected_count}]}; None until it ran (aggregate sinks: never, they are recomputed at promote)
    quality: dict[str, Any] | None = None
    note: str | None = None


@dataclass
class ShadowRun:
    """The run record, ``<data dir>/shadow/<pipeline>/<run>/run.json``."""

    run: str
    pipeline: str
    created: str
    mode: str
    asked: dict[str, Any]
    range: dict[str, list[list[int]]]
    region: list[str]
    time_column: dict[str, str] = field(default_factory=dict)
    sinks: list[ShadowSink] = field(default_factory=list)
    state: str = "shadowed"  # shadowed | promoted
    promoted: dict[str, Any] | None = None  # when, and per raw sink the live version it made

    def sink(self, name: str) -> ShadowSink:
        return next(s for s in self.sinks if s.sink == name)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ShadowRun:
        sinks = [ShadowSink(**s) for s in d.get("sinks", [])]
        return cls(**{**d, "sinks": sinks})


# ------------------------------------------------------------------ the record


def new_run_id(data_dir: str | Path, pipeline: str, now: datetime | None = None) -> str:
    """A fresh run id, its folder created (so two runs in one second get different ids); the
    pipeline's shadow runs beyond the :data:`RUNS_KEPT` newest are removed."""
    base = RUN_PREFIX + (now or datetime.now(UTC)).astimezone(UTC).strftime("%Y%m%dT%H%M%SZ")
    dd = DataDir(data_dir)
    folder = dd.make(dd.shadows(pipeline))
    run, n = base, 1
    while True:
        try:
            os.mkdir(dd.shadow(pipeline, run), 0o700)
            break
        except FileExistsError:
            n += 1
            run = f"{base}-{n}"
    # by run id (its UTC time), never the new one: a long-running review keeps its place by age
    older = sorted((p for p in folder.iterdir() if _RUN_ID.match(p.name) and p.name != run),
                   key=lambda p: _run_order(p.name), reverse=True)
    for p in older[RUNS_KEPT - 1:]:
        shutil.rmtree(p, ignore_errors=True)
    return run


def _run_order(run: str) -> tuple[str, int]:
    stamp, _, n = run[len(RUN_PREFIX):].partition("-")
    return stamp, int(n or 1)


def run_dir(data_dir: str | Path, pipeline: str, run: str) -> Path:
    """The folder of shadow run ``run``; ShadowError for anything that is not a run id."""
    if not isinstance(run, str) or not _RUN_ID.match(run):
        raise ShadowError(f"{run!r} is not a shadow run id (reprocess-<yyyymmddThhmmssZ>, as "
                          "'isbflow replay --shadow' printed it)")
    return DataDir(data_dir).shadow(pipeline, run)


def save_run(data_dir: str | Path, rec: ShadowRun) -> Path:
    target = run_dir(data_dir, rec.pipeline, rec.run) / RECORD
    private_dir(target.parent)
    tmp = target.with_name(f".{RECORD}.tmp")
    tmp.write_text(json.dumps(rec.to_json(), indent=2, default=str), encoding="utf-8")
    os.replace(tmp, target)
    return target


def list_runs(data_dir: str | Path, pipeline: str) -> list[str]:
    """Recorded shadow runs of ``pipeline``, newest first."""
    folder = DataDir(data_dir).shadows(pipeline)
    if not folder.is_dir():
        return []
    return sorted((p.name for p in folder.iterdir() if _RUN_ID.match(p.name) and (p / RECORD).is_file()),
                  reverse=True)


def load_run(data_dir: str | Path, pipeline: str, run: str) -> ShadowRun:
    f = run_dir(data_dir, pipeline, run) / RECORD
    if not f.is_file():
        runs = list_runs(data_dir, pipeline)
        raise ShadowError(f"no shadow run {run} of pipeline {pipeline} under {f.parent.parent} (runs there: "
                          f"{', '.join(runs[:5]) or 'none'})")
    try:
        return ShadowRun.from_json(json.loads(f.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise ShadowError(f"shadow run record {f} cannot be read: {e}") from None


def record_quality(data_dir: str | Path, pipeline: str, run: str, sink: str, verdict: dict[str, Any]) -> ShadowRun:
    """Store the suite's verdict on ``sink``'s shadow table in the run record."""
    rec = load_run(data_dir, pipeline, run)
    rec.sink(sink).quality = verdict
    save_run(data_dir, rec)
    return rec


# ------------------------------------------------------------------ phase: shadow


def write_shadows(r: Any, data_dir: Path) -> ShadowRun:
    """Phase shadow of reprocess run ``r`` (a :class:`~isbflow.recovery.reprocess.ReprocessRun` after
    its read): shadow tables, diffs, the run record (module docstring). Sets ``r.report.shadow_run``
    and the report's sinks."""
    t, report = time.monotonic(), r.report
    run = report.shadow_run = new_run_id(data_dir, r.p.name)
    rec = ShadowRun(run, r.p.name, datetime.now(UTC).isoformat(), report.mode, report.asked, report.range,
                    report.region, dict(report.time_column))
    folder = run_dir(data_dir, r.p.name, run)
    for v in r.raw_sinks:
        res, sh = _shadow_raw(r, v, str(folder / v))
        report.sinks.append(res)
        rec.sinks.append(sh)
    for a in r.agg_sinks():
        res = r.results.get(a) or _touched_windows(r, a)
        report.sinks.append(res)
        rec.sinks.append(ShadowSink(a, "aggregate", res.path, live_version=res.version_before,
                                    rows_before=res.windows_touched, note=res.error or res.note))
    save_run(data_dir, rec)
    r.job.phase("shadow", "done" if all(s.ok for s in report.sinks) else "failed", t, run=run,
                record=str(folder / RECORD), sinks={s.sink: s.shadow_path for s in report.sinks})
    return rec


def _shadow_raw(r: Any, v: str, target: str) -> tuple[SinkReplace, ShadowSink]:
    rng, live = r.report.range, r.path(v)
    rows = r.new_rows(v)
    dt = open_table(live)
    if dt is None:
        raise ReprocessError(f"sink {v}: no Delta table at {live} (has the sink committed a batch?)")
    version = dt.version()
    table = arrow_table(dt)
    mask = pa.array(in_ranges(table.column(ledger.ID_COLUMN), rng))
    old, kept = table.filter(mask), table.filter(pc.invert(mask))
    names = table.column_names
    if sorted(names) != sorted(rows.column_names):
        raise ReprocessError(f"sink {v}: the new rows' columns {rows.column_names} are not the live table's "
                             f"{names}; nothing was written")
    data = pa.concat_tables([kept, rows.select(names)], promote_options="permissive")
    offsets = ledger.union(ledger.delta_history_until(live, version), rng)
    meta = {**r.metadata(), ledger.OFFSETS_KEY: ledger.to_metadata(offsets),
            SHADOW_KEY: json.dumps({"run": r.report.shadow_run, "of": live, "version": version})}
    write_deltalake(target, data, mode="error", partition_by=list(dt.metadata().partition_columns) or None,
                    commit_properties=CommitProperties(custom_metadata=meta))
    diff = diff_rows(old, rows, [ledger.ID_COLUMN])
    res = SinkReplace(v, "raw", live, rows_before=old.num_rows, rows_after=rows.num_rows, version_before=version,
                      version=version, shadow_path=target,
                      diff={k: diff[k] for k in ("added", "removed", "changed", "unchanged", "columns")})
    ids, _ = read_ids(target)
    res.duplicates = len(ids) - (pc.count_distinct(ids).as_py() if len(ids) else 0)
    in_now = int(in_ranges(ids, rng).sum())
    res.range_mismatch, res.outside_changed = in_now - rows.num_rows, (len(ids) - in_now) - kept.num_rows
    return res, ShadowSink(v, "raw", live, target, version, old.num_rows, rows.num_rows, diff)


def _touched_windows(r: Any, a: str) -> SinkReplace:
    """An aggregate sink in a shadow run: the windows the range touches (old rows and new), left to
    the promote, which recomputes them from the live raw sink after replacing its range."""
    plan = r.plans[a]
    parts = [w for w in (plan.old_windows,) if w is not None]
    new = r.new_frame(plan.raw)
    if new is not None:
        parts.append(windows_of(r.runner, plan, new))
    n = distinct_windows(parts).num_rows if parts else 0
    dt = open_table(r.path(a))
    return SinkReplace(a, "aggregate", r.path(a), windows_touched=n, rows_before=n,
                       version_before=dt.version() if dt else None, version=dt.version() if dt else None,
                       note=f"{n} window(s) touched: recomputed from raw sink {plan.raw} when the shadow is "
                            "promoted (no shadow table)")
