"""One quality run of one sink: read its current Delta version, check, report, gate, prune.

:func:`run_quality` reads the sink's current version with Spark (the Parquet
files ``DeltaTable(path).file_uris()`` lists; no Delta jars), runs the GX
expectations (the spec's plus the built-in uniqueness of ``_isb_id`` for raw
sinks) and the Spark built-in checks (:mod:`isbflow.quality.checks`), stores
the report and its Data Docs page, prunes by the sink's retention and returns
the :class:`QualityReport`. ``report.gate_failed`` is true when the run failed
and the sink's gate is ``onFailure: fail`` (a ``warn`` gate never fails).

The caller brings what needs the ISB service: the completeness basis (a
:class:`~isbflow.quality.basis.LedgerBasis`, read by
:func:`~isbflow.quality.basis.read_ledger_basis`: the offset ledger, dead letters
and committed low watermarks; or, without the service, the sink's own ids
minus the dead-lettered ids :func:`dead_letter_ids` reads) and the expected
schema (the upstream step's output, :func:`expected_schema`). Without an
expected schema the schema check is reported as skipped. The built-in
uniqueness counts surplus rows (rows less distinct ids).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from isbflow.isb import ledger
from isbflow.isb.dlq import read_dead_letters
from isbflow.quality import checks, docs, gx, reports
from isbflow.quality.basis import LedgerBasis, ledger_closure, offline_closure
from isbflow.quality.checks import ID_COLUMN, CheckResult, OffsetBasis, SinkOffsetBasis
from isbflow.quality.errors import QualityError
from isbflow.sinks.tables import (
    SinkTableError,
    fallback_offsets,
    find_raw_sink,
    is_postgres,
    read_postgres,
    read_version,
    sink_table_path,
)
from isbflow.spec.models import Pipeline, QualityGate, SinkQuality

log = logging.getLogger(__name__)


def _sink_table(call, *args):
    """``call(*args)`` with a missing sink or table reported as a :class:`QualityError`."""
    try:
        return call(*args)
    except SinkTableError as e:
        raise QualityError(str(e)) from None


@dataclass
class QualityReport:
    """What one run found; :meth:`to_dict` is the stored JSON."""

    run_id: str
    pipeline: str
    sink: str
    kind: str
    table_path: str
    table_version: int
    rows: int
    time: str
    gate: str
    success: bool
    checks: list[CheckResult]
    offsets: dict[str, Any] | None = None
    offsets_from: str | None = None
    last_commit_offsets: dict[str, Any] | None = None  # the current commit's isb.offsets (that batch only)
    docs: str | None = None
    pruned: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    #: a run on a shadow table (a shadow reprocess): {"run": its id, "live_path", "live_version", "diff"}
    shadow: dict[str, Any] | None = None

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if not c.success]

    @property
    def gate_failed(self) -> bool:
        return not self.success and self.gate == QualityGate.FAIL.value

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "pipeline": self.pipeline, "sink": self.sink, "kind": self.kind,
            "table_path": self.table_path, "table_version": self.table_version, "rows": self.rows,
            "time": self.time, "gate": self.gate, "success": self.success, "gate_failed": self.gate_failed,
            "offsets": self.offsets, "offsets_from": self.offsets_from,
            "last_commit_offsets": self.last_commit_offsets,
            "failures": [{"name": c.name, "unexpected_count": c.unexpected_count, "samples": c.samples,
                          "origin": c.origin, "kwargs": c.kwargs} for c in self.failures],
            "checks": [c.to_dict() for c in self.checks],
            "docs": self.docs, "pruned": self.pruned, "timings": self.timings, "shadow": self.shadow,
        }


# ------------------------------------------------------------------ inputs


def dead_letter_ids(settings, pipeline: str) -> set[str]:
    """The ``_isb_id`` of every dead-lettered record of the pipeline (needs the ISB service)."""

    letters = asyncio.run(read_dead_letters(settings, pipeline))
    return {dl["origin"] for dl in letters if dl.get("origin")}


def expected_schema(runner, sink: str):
    """The schema the sink's upstream step writes (a ``PipelineRunner``'s view of the spec)."""
    edges = runner.p.inputs(sink)
    return runner.output_schema(edges[0].from_) if edges else None


def quality_of(pipeline: Pipeline, sink: str) -> SinkQuality:
    """The sink's quality settings (defaults when the spec has none: built-ins, gate ``fail``)."""
    return next((q for q in pipeline.spec.quality if q.sink == sink), SinkQuality(sink=sink))


# ------------------------------------------------------------------ the run


def run_quality(spark, pipeline: Pipeline, sink: str, data_dir: str | Path, *,
                dead_letters: Iterable[str] = (), basis: LedgerBasis | OffsetBasis | None = None,
                schema=None, now: datetime | None = None, raw_sink: str | None = None,
                window_sample: int = 200, table_path: str | None = None,
                shadow: dict[str, Any] | None = None) -> QualityReport:
    """Check sink ``sink`` of ``pipeline`` now; store and return the report.

    ``dead_letters``: dead-lettered ids for the default completeness basis (the
    sink's own ids); ``basis`` replaces it: a :class:`~isbflow.quality.basis.LedgerBasis`
    (:func:`~isbflow.quality.basis.read_ledger_basis`: completeness on the offset
    ledger, windows closed by a committed watermark) or another
    :class:`~isbflow.quality.checks.OffsetBasis`; ``schema``: the
    expected Spark schema (None: skipped); ``now``: the clock for freshness
    and the run id (tests inject it); ``raw_sink``: the raw sink aggregate
    windows are recomputed from (default: found from the graph); ``table_path``: check this
    table instead of the sink's (a shadow table) and tag the report with ``shadow`` (the shadow
    run, the live table and the diff: the Quality page shows it beside the checks).
    """

    now = now or datetime.now(UTC)
    data_dir = Path(data_dir).absolute()
    q = quality_of(pipeline, sink)
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    held = None  # a PostgreSQL sink: the offsets its bookkeeping rows hold, read with its rows
    if table_path is None and _sink_table(is_postgres, pipeline, sink):
        df, version, commit, path, held = _sink_table(read_postgres, spark, pipeline, sink, data_dir)
    else:
        path = table_path or _sink_table(sink_table_path, pipeline, sink, data_dir)
        df, version, commit = _sink_table(read_version, spark, path)
    df = df.cache()
    rows = df.count()
    timings["read_s"] = time.perf_counter() - t0
    kind = checks.sink_kind(df.columns)
    run_id = reports.new_run_id(now)

    expectations: list[gx.ExpectationRun] = []
    if kind == "raw":
        expectations.append(gx.ExpectationRun("uniqueness", "expect_column_values_to_be_unique",
                                              {"column": ID_COLUMN}, origin="builtin"))
    expectations += [gx.ExpectationRun(e.expectation, e.expectation, dict(e.kwargs)) for e in q.expectations]
    t = time.perf_counter()
    outcome = gx.validate(data_dir, pipeline.name, sink, df, expectations, run_id, now)
    timings["gx_s"] = time.perf_counter() - t

    t = time.perf_counter()
    results: list[CheckResult] = []
    offsets: dict[str, Any] | None = None
    offsets_from: str | None = None
    ledger_basis = basis if isinstance(basis, LedgerBasis) else None
    if kind == "raw" and pipeline.filtered(sink):
        results.append(checks.skipped("completeness", "the sink is fed through conditions.tags: it holds the "
                                      "records routed to it, not every source offset"))
        _count_surplus_rows(df, outcome.results)
    elif kind == "raw":
        if ledger_basis is not None:
            # the records the sink's failure policy sent to its fallback are accounted for, like dead letters
            excused, in_fallback = _sink_table(fallback_offsets, pipeline, sink, data_dir)
            verdicts, malformed = _judge(ledger_basis, sink, path, df, version, held, excused)
            result = checks.ledger_completeness(verdicts, malformed, now, ledger_basis.stored_at,
                                                ledger_basis.watermarks.get(sink))
            result.details["in_fallback"] = in_fallback
            offsets = result.details["ranges"]
            offsets_from = "the offset ledger: per source partition, first offset .. committed low watermark"
        else:
            observed = checks.offset_ranges(df)
            result = checks.completeness(df, basis or SinkOffsetBasis(frozenset(dead_letters)), observed)
            offsets, offsets_from = {s: [lo, hi] for s, (lo, hi, _) in sorted(observed.items())}, "sink ids"
        results.append(result)
        _count_surplus_rows(df, outcome.results)
    else:
        results.append(checks.skipped("completeness", f"the sink has no {ID_COLUMN} column"))
    results.insert(0, checks.schema_check(df.schema, schema))
    results.append(checks.freshness(df, q.freshness, now))
    if kind == "aggregate":
        raw_name = raw_sink or find_raw_sink(spark, pipeline, sink, data_dir)
        if raw_name is None:
            results.append(checks.skipped("windows", "no raw sink shares an upstream step with this one"))
        else:
            raw_path = sink_table_path(pipeline, raw_name, data_dir)
            raw_df, raw_version, _ = _sink_table(read_version, spark, raw_path)
            if ledger_basis is not None:
                verdicts, _ = _judge(ledger_basis, raw_name, raw_path, raw_df, raw_version)
                # only records the source step has committed (now, after both tables were read) can be in
                # an aggregate already: those of them the raw sink lacks may make a recount fall short
                upstream = checks.in_flight_upto(verdicts, ledger_basis.source_committed())
                closure = ledger_closure(ledger_basis, pipeline, sink, data_dir, upstream)
                offsets = {v.partition: [v.source[0], v.watermark] for v in verdicts if v.source}
                offsets_from = (f"raw sink {raw_name!r} (what the windows were recomputed from): "
                                "first offset .. committed low watermark")
            else:
                closure = offline_closure(pipeline, sink, data_dir)
                offsets = {s: [lo, hi] for s, (lo, hi, _) in sorted(checks.offset_ranges(raw_df).items())}
                offsets_from = f"raw sink {raw_name!r} ids (what the windows were recomputed from)"
            results.append(checks.window_recompute(df, raw_df, sample=window_sample, closure=closure))
    timings["builtin_s"] = time.perf_counter() - t
    df.unpersist()

    builtin_gx = [r for r in outcome.results if r.origin == "builtin"]
    all_checks = [results[0], *builtin_gx, *results[1:], *[r for r in outcome.results if r.origin != "builtin"]]
    report = QualityReport(
        run_id=run_id, pipeline=pipeline.name, sink=sink, kind=kind, table_path=path, table_version=version,
        rows=rows, time=now.astimezone(UTC).isoformat(), gate=q.onFailure.value,
        success=all(c.success for c in all_checks), checks=all_checks, offsets=offsets,
        offsets_from=offsets_from, last_commit_offsets=_commit_offsets(commit), timings=timings, shadow=shadow)
    t = time.perf_counter()
    root = reports.reports_root(data_dir)
    html = None
    if outcome.docs_html is not None:
        docs.install_static(root)
        html = docs.localize_page(outcome.docs_html, "../../" + docs.STATIC_DIR)
        report.docs = f"{run_id}.html"
    reports.save_report(data_dir, report.to_dict(), html)
    report.pruned = reports.prune(data_dir, pipeline.name, sink, q.retention.runs, q.retention.maxAge, now,
                                  protect=run_id)
    report.timings["report_s"] = time.perf_counter() - t
    reports.save_report(data_dir, report.to_dict(), None)  # again, naming what was pruned
    level = logging.INFO if report.success else logging.WARNING
    log.log(level, "quality %s/%s%s v%s: %s (%d failed check(s)%s)", pipeline.name, sink,
            f" (shadow {shadow.get('run')})" if shadow else "", version,
            "passed" if report.success else f"FAILED, gate {report.gate}", len(report.failures),
            f", pruned {len(report.pruned)} old report(s)" if report.pruned else "")
    return report


def _judge(basis: LedgerBasis, sink: str, path: str, df, version: int, held=None, excused=None):
    """``held``: a PostgreSQL sink's bookkeeping offsets (its table has no Delta history at ``path``);
    ``excused``: offsets not in the sink for a known reason besides dead letters (its fallback's)."""
    sources = {part: (src.first, src.last) for part, src in basis.sources.items()}
    ranges = basis.held(sink, path, version) if held is None else ledger.union(basis.held(sink, None), held)
    dead = ledger.union(basis.dead, excused) if excused else basis.dead
    return checks.judge_sink(df, ranges, dead, sources, basis.watermarks.get(sink))


def _count_surplus_rows(df, gx_results: list[CheckResult]) -> None:
    """The built-in uniqueness counts surplus rows (17 copies: 17), not every row of a repeated id
    as GX does (34); GX's count stays in its details."""
    check = next((r for r in gx_results if r.origin == "builtin" and r.name == "uniqueness"), None)
    if check is None or check.success:
        return
    extra, ids, samples = checks.duplicate_ids(df)
    check.details.update(unexpected_rows=check.unexpected_count, surplus_rows=extra, duplicated_ids=ids)
    check.unexpected_count = extra
    check.samples = check.samples or samples


def _commit_offsets(commit: dict[str, Any]) -> dict[str, Any] | None:
    raw = commit.get("isb.offsets")
    try:
        offsets = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        offsets = None
    return offsets or None
