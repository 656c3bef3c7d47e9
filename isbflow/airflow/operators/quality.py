"""``PipelineQualityOperator``: check a pipeline's sinks and gate the DAG run on the result.

For each sink it runs :func:`isbflow.quality.run.run_quality` over the sink's
current Delta version: the spec's expectations for sinks with a ``quality``
entry, and the built-in checks (schema, completeness and uniqueness of
``_isb_id``, freshness, window recount) for every sink. Each run stores its
report and Data Docs page under ``<data dir>/quality/reports``.

Which sinks: when the DAG run was triggered by sink asset events
(:mod:`isbflow.airflow.assets`: drain, batch and replay tasks emit them), the
sinks those events name, for whichever pipelines they belong to (found by name
under ``pipelines_dir``); otherwise ``sinks`` (default: all) of the
``pipeline_file`` pipeline. A sink without a Delta table yet is skipped with
a warning; nothing to check at all fails the task.

Gates: a failed sink whose gate is ``onFailure: fail`` fails the task, naming
the sinks and their failed checks; a ``warn`` gate logs ``WARN`` with the
failures and the task succeeds. Every sink is checked before the verdict.
XCom ``return_value`` (also written when the task fails): per sink the run id,
the report's path (relative to the reports folder and absolute), its Data Docs
page, the table version, row count, gate and failures, so the UI can link them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk.exceptions import AirflowFailException

from isbflow.airflow.assets import sinks_from_events
from isbflow.airflow.catalog import load_catalog
from isbflow.airflow.operators.pipeline import PipelineOperatorBase, PipelineTarget, resolve_target
from isbflow.ops.spark import SparkOnDemand
from isbflow.spec.paths import DataDir


def sink_list(value: Any) -> list[str] | None:
    """A templated sink list: a list, or a comma-separated string; empty means 'all'."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().strip("[]")
        items = [x.strip().strip("'\"") for x in text.split(",")]
    else:
        items = [str(x).strip() for x in value]
    items = [x for x in items if x and x.lower() != "none"]
    return items or None


def sink_summary(report: Any, data_dir: Path) -> dict[str, Any]:
    """The XCom view of one :class:`~isbflow.quality.run.QualityReport`: verdict and where to read more."""
    rel = f"{report.pipeline}/{report.sink}/{report.run_id}.json"
    root = DataDir(data_dir).quality_reports
    return {
        "pipeline": report.pipeline, "sink": report.sink, "run_id": report.run_id, "success": report.success,
        "gate": report.gate, "gate_failed": report.gate_failed, "table_version": report.table_version,
        "rows": report.rows, "report": rel, "report_path": str(root / rel),
        "docs": f"{report.pipeline}/{report.sink}/{report.docs}" if report.docs else None,
        "failures": [{"name": c.name, "unexpected_count": c.unexpected_count} for c in report.failures],
    }


class PipelineQualityOperator(PipelineOperatorBase):
    """Run the quality checks of a pipeline's sinks and gate on them (module docstring).

    :param sinks: sink vertices to check (list or comma string; default all). Ignored when the run
        was triggered by sink asset events and ``follow_assets`` is on.
    :param follow_assets: check the sinks named by the run's triggering asset events.
    :param master: Spark master of the checks' session.
    """

    template_fields: Sequence[str] = (*PipelineOperatorBase.template_fields, "sinks", "master")
    ui_color = "#e8f0c7"

    def __init__(self, *, sinks: list[str] | str | None = None, follow_assets: bool = True,
                 master: str = "local[2]", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sinks = sinks
        self.follow_assets = follow_assets
        self.master = master

    def targets(self, context: Any) -> list[tuple[PipelineTarget, list[str]]]:
        """The pipelines and sinks to check in this run (module docstring)."""
        named = sinks_from_events(context.get("triggering_asset_events")) if self.follow_assets else {}
        if named:
            self.log.info("triggered by sink asset events: %s", named)
            catalog = load_catalog(self.pipelines_dir or Path.cwd())
            out = []
            for pipeline, sinks in named.items():
                try:
                    entry = catalog.find(pipeline)
                except KeyError as e:
                    raise AirflowFailException(str(e)) from None
                out.append((resolve_target(entry.file, self.pipelines_dir, pipeline, self.nats_conn_id,
                                           self.data_dir or None), sinks))
            return out
        t = self.target()
        all_sinks = [v.name for v in t.pipeline.spec.vertices if v.sink is not None]
        wanted = sink_list(self.sinks) or all_sinks
        unknown = [s for s in wanted if s not in all_sinks]
        if unknown:
            raise AirflowFailException(f"pipeline {t.pipeline.name!r} ({t.path}) has no sink "
                                       f"{', '.join(unknown)} (sinks: {', '.join(all_sinks)})")
        return [(t, wanted)]

    def execute(self, context: Any) -> dict:
        targets = self.targets(context)
        results: list[dict[str, Any]] = []
        skipped: list[dict[str, str]] = []
        with SparkOnDemand(self.master, "isbflow-quality") as spark_for:
            for t, sinks in targets:
                r, s = self._check(spark_for(), t, sinks)
                results += r
                skipped += s
        out = {"sinks": results, "skipped": skipped,
               "failed": [f"{r['pipeline']}/{r['sink']}" for r in results if r["gate_failed"]],
               "warned": [f"{r['pipeline']}/{r['sink']}" for r in results if not r["success"] and not r["gate_failed"]]}
        out["ok"] = not out["failed"] and bool(results)
        for r in results:
            if r["success"]:
                self.log.info("quality %s/%s v%s: passed (%d rows, run %s, report %s)", r["pipeline"], r["sink"],
                              r["table_version"], r["rows"], r["run_id"], r["report_path"])
            else:
                level = "FAILED" if r["gate_failed"] else "WARN"
                self.log.warning("quality %s/%s v%s: %s (gate %s): %s; report %s", r["pipeline"], r["sink"],
                                 r["table_version"], level, r["gate"], _failures(r), r["report_path"])
        if not results:
            context["ti"].xcom_push(key="return_value", value=out)
            raise AirflowFailException("nothing to check: " + "; ".join(f"{s['pipeline']}/{s['sink']}: {s['reason']}"
                                                                          for s in skipped))
        if out["failed"]:
            context["ti"].xcom_push(key="return_value", value=out)
            raise AirflowFailException(
                "quality gate failed for " + "; ".join(f"{r['pipeline']}/{r['sink']} v{r['table_version']} "
                                                       f"({_failures(r)}; report {r['report_path']})"
                                                       for r in results if r["gate_failed"]))
        return out

    def _check(self, spark: Any, t: PipelineTarget, sinks: list[str]) -> tuple[list[dict], list[dict]]:
        # lazy: ops.quality loads pyarrow and deltalake (~0.35 CPU-s); DAG parsing must not (it reruns every 30 s)
        from isbflow.ops import quality as ops_quality

        p = t.pipeline
        try:
            run = ops_quality.check_sinks(
                spark, t.specs, p, t.settings, t.data_dir, sinks, skip_unchecked=True,
                on_schema_unknown=lambda sink, why: self.log.warning(
                    "sink %s/%s: expected schema unknown (%s); schema check skipped", p.name, sink, why))
        except ops_quality.Unreachable as e:
            raise RuntimeError(str(e)) from None
        for sink, why in run.skipped:
            self.log.warning("sink %s/%s skipped: %s", p.name, sink, why)
        skipped = [{"pipeline": p.name, "sink": sink, "reason": why} for sink, why in run.skipped]
        return [sink_summary(report, t.data_dir) for report in run.reports], skipped


def _failures(r: dict[str, Any]) -> str:
    return ", ".join(f"{f['name']}: {f['unexpected_count']} unexpected" for f in r["failures"]) or "no check failed"
