"""The quality verb: check sinks' current Delta versions with the pipeline's suites; one report per sink.

Called by ``isbflow quality run`` and the ``pipeline_quality`` DAG's operator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings
from isbflow.quality.errors import QualityError
from isbflow.quality.reports import UnsafeReportPath, list_reports, report_path
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

__all__ = ["QualityError", "QualityRun", "Unreachable", "UnsafeReportPath", "check_sinks", "list_reports",
           "report_path", "sink_names"]


@dataclass
class QualityRun:
    reports: list[Any] = field(default_factory=list)  # isbflow.quality.run.QualityReport
    #: (sink, reason) of sinks that could not be checked (``skip_unchecked``)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def sink_names(p: Pipeline) -> list[str]:
    return [v.name for v in p.spec.vertices if v.sink is not None]


def check_sinks(spark: Any, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
                sinks: Sequence[str], *, skip_unchecked: bool = False,
                on_schema_unknown: Callable[[str, str], None] | None = None) -> QualityRun:
    """Run the quality suite of each sink and store its report.

    Dead letters (for completeness) are read once from the ISB service; each sink's
    expected schema comes from its input step (when it cannot be built, the schema
    check is skipped and ``on_schema_unknown(sink, why)`` is told). A sink that cannot
    be checked (no table yet ...) raises :class:`QualityError`, or with
    ``skip_unchecked`` is listed in ``skipped``.
    """
    # Spark, Delta and GX: imported when a check runs, never by the CLI's or the DAGs' module loads

    # Spark, Delta and GX: imported when a check runs, never by the CLI's or the DAGs' module loads
    from isbflow.quality.run import dead_letter_ids, expected_schema, run_quality
    from isbflow.steps.runner import PipelineRunner, StepError

    letters = dead_letter_ids(settings, p.name)
    runner = PipelineRunner(spark, specs, p, settings, data_dir)
    out = QualityRun()
    try:
        for name in sinks:
            try:
                schema = expected_schema(runner, name)
            except StepError as e:
                if on_schema_unknown is not None:
                    on_schema_unknown(name, str(e))
                schema = None
            try:
                out.reports.append(run_quality(spark, p, name, data_dir, dead_letters=letters, schema=schema))
            except QualityError as e:
                if not skip_unchecked:
                    raise
                out.skipped.append((name, str(e)))
    finally:
        runner.close()
    return out
