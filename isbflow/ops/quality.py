"""The quality verb: check sinks' current Delta versions with the pipeline's suites; one report per sink.

Called by ``isbflow quality run`` and the ``pipeline_quality`` DAG's operator.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings
from isbflow.quality.basis import DEFAULT_WAIT_S, read_ledger_basis
from isbflow.quality.checks import SinkOffsetBasis
from isbflow.quality.errors import QualityError
from isbflow.quality.reports import UnsafeReportPath, list_reports, report_path
from isbflow.quality.verify import VerifyError, verify_table
from isbflow.sinks.tables import sink_table_path
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

__all__ = ["DEFAULT_WAIT_S", "QualityError", "QualityRun", "SinkVerification", "Unreachable", "UnsafeReportPath",
           "check_sinks", "list_reports", "report_path", "sink_names", "verify_sinks"]

log = logging.getLogger(__name__)


@dataclass
class QualityRun:
    reports: list[Any] = field(default_factory=list)  # isbflow.quality.run.QualityReport
    #: (sink, reason) of sinks that could not be checked (``skip_unchecked``)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: "ledger" (completeness on the offset ledger) or "sink" (the fallback: the sink's own ids)
    basis: str = "ledger"
    #: what the user should know about how the sinks were judged (e.g. the fallback and why)
    notes: list[str] = field(default_factory=list)


def sink_names(p: Pipeline) -> list[str]:
    return [v.name for v in p.spec.vertices if v.sink is not None]


def check_sinks(spark: Any, specs: Specs, p: Pipeline, settings: NatsSettings | None, data_dir: Path,
                sinks: Sequence[str], *, skip_unchecked: bool = False,
                on_schema_unknown: Callable[[str, str], None] | None = None,
                on_note: Callable[[str], None] | None = None, wait_s: float = DEFAULT_WAIT_S,
                shadow: dict[str, dict[str, Any]] | None = None) -> QualityRun:
    """Run the quality suite of each sink and store its report.

    Completeness is judged on the offset ledger (:func:`isbflow.quality.basis.read_ledger_basis`:
    the ledger, dead letters and every sink's committed low watermark, read once; a running
    step gets ``wait_s`` seconds to commit what its input buffers hold). When the ISB service
    cannot be reached (or ``settings`` is None) it falls back to the sink's own ids and the
    aggregating steps' checkpoint watermarks, and says so: in ``notes``, to ``on_note`` and in
    each completeness result. Each sink's expected schema comes from its input step (when it
    cannot be built, the schema check is skipped and ``on_schema_unknown(sink, why)`` is told).
    A sink that cannot be checked (no table yet ...) raises :class:`QualityError`, or with
    ``skip_unchecked`` is listed in ``skipped``. ``shadow``: per sink, a shadow table to check
    instead (``{"table_path": ..., "run": ..., ...}``; the report is tagged with it).
    """
    # lazy: quality.run and steps.runner load pyspark and deltalake (~0.7 s on top of this module);
    # the UI app and the CLI's quality commands import this module without running a check
    from isbflow.quality.run import expected_schema, run_quality
    from isbflow.steps.runner import PipelineRunner, StepError

    out = QualityRun()
    basis: Any
    try:
        if settings is None:
            raise Unreachable("no ISB service settings")
        basis = read_ledger_basis(settings, p, data_dir, wait_s=wait_s)
    except Unreachable as e:
        note = (f"the ISB service is unreachable ({e}): completeness FALLS BACK to the sink basis (each "
                "sink's own min..max of _isb_id: holes are found, a lost tail is not, records in flight "
                "below the newest id count as missing, dead letters are unknown); windows are closed by "
                "the aggregating step's checkpoint watermark; the schema check is skipped")
        basis, out.basis = SinkOffsetBasis(note=note), "sink"
        out.notes.append(note)
        log.warning("quality %s: %s", p.name, note)
        if on_note is not None:
            on_note(note)
    runner = PipelineRunner(spark, specs, p, settings, data_dir) if out.basis == "ledger" else None
    try:
        for name in sinks:
            schema = None
            try:
                if runner is None:
                    raise StepError("the ISB service is unreachable (reference tables)")
                schema = expected_schema(runner, name)
            except StepError as e:
                if on_schema_unknown is not None:
                    on_schema_unknown(name, str(e))
            try:
                tag = (shadow or {}).get(name)
                out.reports.append(run_quality(spark, p, name, data_dir, basis=basis, schema=schema,
                                               table_path=tag["table_path"] if tag else None,
                                               shadow={k: v for k, v in tag.items() if k != "table_path"}
                                               if tag else None))
            except QualityError as e:
                if not skip_unchecked:
                    raise
                out.skipped.append((name, str(e)))
    finally:
        if runner is not None:
            runner.close()
    return out


@dataclass
class SinkVerification:
    """One sink's offline proof (``verification``: :class:`isbflow.quality.verify.Verification`), or why
    there is none (``skipped``: no table yet, no ``_isb_id``)."""

    sink: str
    verification: Any = None
    skipped: str | None = None

    @property
    def ok(self) -> bool:
        return self.verification is None or self.verification.ok

    def to_json(self) -> dict[str, Any]:
        return {"sink": self.sink, "ok": self.ok, "skipped": self.skipped,
                **(self.verification.to_json() if self.verification is not None else {})}


def verify_sinks(p: Pipeline, data_dir: Path, sinks: Sequence[str]) -> list[SinkVerification]:
    """Prove from each sink's Delta table alone (commit metadata and data, no ISB service) which source
    ranges it holds completely and exactly once (:func:`isbflow.quality.verify.verify_table`)."""
    out = []
    for name in sinks:
        try:
            out.append(SinkVerification(name, verify_table(sink_table_path(p, name, data_dir))))
        except VerifyError as e:
            out.append(SinkVerification(name, skipped=str(e)))
    return out
