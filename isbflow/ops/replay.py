"""The replay verb: recover after buffer loss, or reprocess a source range; dry runs plan only.

Called by ``isbflow replay`` and the ``pipeline_replay`` DAG's operators. Spark
starts only when a phase needs it (``spark_for``: a
:class:`~isbflow.ops.spark.SparkOnDemand`).

A **shadow** reprocess (``shadow=True``) writes the range's new output into
shadow tables (:mod:`isbflow.recovery.shadow`), runs each raw sink's quality
suite on its shadow table (a normal quality report, tagged ``shadow`` with the
run id, the live table and the diff: the Quality page shows it), records the
verdicts in the run record and returns a :class:`ShadowReview`.
:func:`promote` then replaces the range in the live sinks, one Delta commit per
raw sink, once every suite passed (:mod:`isbflow.recovery.reprocess_promote`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

__all__ = ["MODES", "ReplayError", "ShadowReview", "Unreachable", "promote", "replay", "summary"]

MODES = ("recover", "reprocess")


class ReplayError(Exception):
    """A replay that cannot run or did not finish; ``usage`` when the request itself is wrong
    (a range that cannot be reprocessed, a range given to recover)."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def replay(spark_for: Callable[[], Any], specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path, *,
           mode: str, dry_run: bool = False, lost: list[str] | None = None, from_offset: Any = None,
           to_offset: Any = None, from_time: Any = None, to_time: Any = None, time_column: str | None = None,
           drain_timeout: float | None = None, on_phase: Callable[[Any], None] | None = None,
           shadow: bool = False) -> Any:
    """Run (or with ``dry_run`` plan) a replay; the report (``.ok``, ``.to_json()``). ``shadow``
    (reprocess only): a :class:`ShadowReview` of shadow tables instead (module docstring)."""
    # lazy: recovery/ loads pyspark and deltalake (seconds) when a replay runs; the CLI and the
    # replay DAG import this module at start-up / parse time
    from isbflow.recovery.plan import plan_recover
    from isbflow.recovery.recover import RecoveryError, recover
    from isbflow.recovery.reprocess import RangeError, ReprocessError, reprocess

    ranged = any(v is not None and v != "" for v in (from_offset, to_offset, from_time, to_time))
    if mode == "recover":
        if ranged:
            raise ReplayError("recover takes no range: it replays from the offset ledger's low offsets "
                              "(reprocess runs a range again)", usage=True)
        if dry_run:
            return plan_recover(spark_for, specs, p, settings, data_dir, lost=lost)
        kw = {} if drain_timeout is None else {"drain_timeout": drain_timeout}
        try:
            return recover(spark_for, specs, p, settings, data_dir, lost=lost, on_phase=on_phase, **kw)
        except RecoveryError as e:
            raise ReplayError(str(e)) from None
    if mode != "reprocess":
        raise ReplayError(f"mode {mode!r} is not one of {', '.join(MODES)}", usage=True)
    if lost:
        raise ReplayError("lost buffers are named only for recover", usage=True)
    if shadow and dry_run:
        raise ReplayError("a shadow reprocess already changes no live table; give --shadow or --dry-run, "
                          "not both", usage=True)
    if not ranged:
        raise ReplayError("reprocess: give the range to reprocess: source offsets (from/to) or event "
                          "times (from-time/to-time)", usage=True)
    try:
        report = reprocess(spark_for, specs, p, settings, data_dir, from_offset=from_offset, to_offset=to_offset,
                           from_time=from_time, to_time=to_time, dry_run=dry_run, on_phase=on_phase,
                           time_column=time_column, shadow=shadow)
    except RangeError as e:
        raise ReplayError(f"reprocess {p.name}: {e}", usage=True) from None
    except ReprocessError as e:
        raise ReplayError(f"reprocess {p.name}: {e}") from None
    return _review(spark_for, specs, p, settings, data_dir, report) if shadow else report


def verdict(q: Any) -> dict[str, Any]:
    """What the run record keeps of a quality report on a shadow table."""
    return {"run_id": q.run_id, "success": q.success, "gate": q.gate, "gate_failed": q.gate_failed,
            "table_version": q.table_version, "rows": q.rows,
            "report_file": f"{q.pipeline}/{q.sink}/{q.run_id}.json",
            "failures": [{"name": c.name, "unexpected_count": c.unexpected_count} for c in q.failures]}


@dataclass
class ShadowReview:
    """A shadow reprocess with its suites' verdicts: what a reviewer reads before ``promote``."""

    report: Any  # isbflow.recovery.reprocess.ReprocessReport (state shadowed)
    record: Any  # isbflow.recovery.shadow.ShadowRun, the verdicts in it
    refusals: list[str] = field(default_factory=list)  # why a promote would be refused now

    @property
    def run(self) -> str:
        return self.record.run

    @property
    def promotable(self) -> bool:
        return self.report.ok and not self.refusals

    @property
    def ok(self) -> bool:
        """The shadow was written and its suites pass (the CLI's exit 0)."""
        return self.promotable

    def to_json(self) -> dict[str, Any]:
        out = self.report.to_json()
        out.update(ok=self.ok, promotable=self.promotable, refusals=self.refusals,
                   suites={s.sink: s.quality for s in self.record.sinks if s.kind == "raw"},
                   diffs={s.sink: s.diff for s in self.record.sinks if s.diff is not None})
        return out

    def summary(self) -> str:
        lines = str(self.report.summary()).splitlines()
        for s in (s for s in self.record.sinks if s.kind == "raw" and s.quality):
            q = s.quality
            failed = ", ".join(f"{f['name']} ({f['unexpected_count']} unexpected)" for f in q["failures"])
            lines.append(f"  suite on shadow {s.sink}: " + ("passed" if q["success"] else f"FAILED: {failed}")
                         + f" (quality run {q['run_id']})")
        if self.promotable:
            lines.append(f"  review the diff (samples with --json, or on the Quality page), then promote: "
                         f"isbflow replay -f SPEC --promote {self.run}")
        else:
            lines += [f"  promote refused: {why}" for why in self.refusals]
        return "\n".join(lines)


def _review(spark_for: Callable[[], Any], specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
            report: Any) -> ShadowReview:
    """Each raw sink's suite on its shadow table, the verdicts stored in the run record."""
    # lazy: recovery/ loads pyspark and deltalake, ops.quality adds ~35 ms: not at `isbflow` start-up
    from isbflow.ops.quality import QualityError, check_sinks
    from isbflow.recovery.reprocess_promote import suite_refusals
    from isbflow.recovery.shadow import load_run, record_quality

    rec = load_run(data_dir, p.name, report.shadow_run)
    tags = {s.sink: {"table_path": s.shadow_path, "run": rec.run, "live_path": s.live_path,
                     "live_version": s.live_version, "range": rec.range, "diff": s.diff}
            for s in rec.sinks if s.kind == "raw"}
    if tags:
        try:
            run = check_sinks(spark_for(), specs, p, settings, data_dir, list(tags), shadow=tags)
        except QualityError as e:
            raise ReplayError(f"shadow reprocess {rec.run} of {p.name}: the shadow tables are written, but their "
                              f"suites could not run ({e}); a promote is refused until they have: run the "
                              "shadow again") from None
        for q in run.reports:
            rec = record_quality(data_dir, p.name, rec.run, q.sink, verdict(q))
    return ShadowReview(report, rec, suite_refusals(rec))


def promote(spark_for: Callable[[], Any], specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
            run: str, *, on_phase: Callable[[Any], None] | None = None) -> Any:
    """Promote shadow run ``run`` into the live sinks (one Delta commit per raw sink, then the
    aggregate windows); the report. ReplayError naming why when it is refused (an unknown run:
    ``usage``)."""
    # lazy: recovery/ loads pyspark and deltalake (seconds); not at `isbflow` start-up or DAG parse
    from isbflow.recovery.reprocess import ReprocessError
    from isbflow.recovery.reprocess_promote import PromoteRefused
    from isbflow.recovery.reprocess_promote import promote as promote_run
    from isbflow.recovery.shadow import ShadowError

    try:
        return promote_run(spark_for, specs, p, settings, data_dir, run, on_phase=on_phase)
    except ShadowError as e:
        raise ReplayError(f"promote {p.name}: {e}", usage=True) from None
    except PromoteRefused as e:
        raise ReplayError(f"promote {p.name}: refused: {e}") from None
    except ReprocessError as e:
        raise ReplayError(f"promote {p.name}: {e}") from None


def summary(report: Any) -> list[str]:
    """The report in a few lines: a recovery's own account, else the report's ``summary()``."""
    if not hasattr(report, "replayed_records"):  # a plan or a reprocess report
        return str(report.summary()).splitlines()
    if report.state == "nothing-lost":
        return [f"pipeline {report.pipeline}: no buffer lost, nothing to recover ({report.seconds:.1f}s)"]
    lines = []
    for b in report.lost:
        rng = "" if b.first is None else f" from sequence {b.first}" + (f" to {b.last}" if b.last else "")
        lines.append(f"lost {b.stream}{rng}: {b.reason}")
    lines += [f"replayed source {part} from sequence {lo['low']}" for part, lo in report.low_offsets.items()]
    lines += [f"LOST AT THE SOURCE {part}: sequences {r} (no longer in the source stream)"
              for part, r in report.source_lost.items()]
    lines.append(f"{report.replayed_records:,} records replayed through {', '.join(report.region)}")
    for s in report.sinks:
        if s.verified:
            lines.append(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} inserted, {s.dropped:,} duplicates "
                         f"dropped, {s.duplicates} duplicate ids, {s.missing} missing -> "
                         f"{'ok' if s.ok else 'FAILED'}")
        else:
            lines.append(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} windows inserted, {s.dropped:,} kept "
                         "as they were (no _isb_id: unverified; reprocess recomputes it exactly)")
    lines.append(f"{report.state} in {report.seconds:.1f}s")
    return lines
