"""Gather what the pages show: pipeline specs, step status from NATS, DAG runs, quality reports.

Each source can fail on its own (a spec that does not load, the ISB service
unreachable, the metadata DB, an unreadable report): the failure becomes a
message on the page for that part, and the rest still shows.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from isbflow.airflow.ui.models import (
    EdgeView,
    FailedCheck,
    HotPartitionView,
    PartitionView,
    PipelineView,
    QualityRun,
    RatePoint,
    ShadowDiff,
    SinkRuns,
    StepAdviceView,
    StepView,
)
from isbflow.ops import quality as reports
from isbflow.ops import status
from isbflow.ops.advise import advise
from isbflow.ops.status import LIVE_STATES, StepStatus, naming, replicas_line
from isbflow.spec import SpecError, load_specs
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir

log = logging.getLogger(__name__)

HOUR_S = 3600.0
NATS_TIMEOUT_S = 10.0  # for everything read from NATS for one pipeline


@dataclass
class LoadedSpec:
    """One spec file: its pipelines, or the error that kept it from loading."""

    file: str
    pipelines: list[Pipeline] = field(default_factory=list)
    specs: Any = None
    error: str | None = None


def load_all(directory: Path, files: list[str]) -> list[LoadedSpec]:
    """Load every spec file under ``directory``; a bad one carries its error instead."""
    out = []
    for f in files:
        try:
            specs = load_specs([directory / f])
        except SpecError as e:
            out.append(LoadedSpec(f, error=str(e)))
            continue
        except OSError as e:
            out.append(LoadedSpec(f, error=f"{f}: cannot read: {e}"))
            continue
        out.append(LoadedSpec(f, list(specs.pipelines.values()), specs))
    return out


def step_view(p: Pipeline, vertex: str, status: StepStatus | None, desired: str | None,
              rates: list[dict[str, float]], now: float, stale_after: float) -> StepView:
    """One step as the page shows it (``state`` ``unknown`` when it never reported)."""
    v = p.vertex(vertex)
    view = StepView(vertex=vertex, role=v.role, partitions=v.partitions, desired=desired, state="unknown",
                    rates=[RatePoint(t=float(r["t"]), input_rows_per_s=float(r.get("in", 0.0)),
                                     processed_rows_per_s=float(r.get("out", 0.0)))
                           for r in rates if float(r.get("t", 0)) >= now - HOUR_S])
    if status is None:
        return view
    age = status.age(now)
    view.state = str(status.state)
    view.stale = view.state in LIVE_STATES and age > stale_after
    view.heartbeat_age_s = round(age, 1)
    view.batch_id = status.batch_id
    view.input_rows_per_s = status.input_rows_per_s
    view.processed_rows_per_s = status.processed_rows_per_s
    view.rows_total = status.rows_total
    view.dlq_total = status.dlq_total
    view.unrouted_total = status.unrouted_total
    view.restarts = status.restarts
    view.sink_retries, view.fallback_total = status.sink_retries, status.fallback_total
    view.dropped_total, view.refused_total, view.sink_error = status.dropped_total, status.refused_total, status.sink_error
    view.lag = dict(status.lag)
    view.lag_total = sum(status.lag.values())
    view.error = status.error
    if status.replicas:
        view.current_replicas, view.desired_replicas = status.replicas.get("target"), status.replicas.get("desired")
        view.replicas_line = replicas_line(vertex, status)
    return view


def edge_views(p: Pipeline, statuses: dict[str, StepStatus | None]) -> list[EdgeView]:
    """Every edge with its partition streams and the lag the consuming step reports for each."""
    edges: dict[tuple[str, str], EdgeView] = {}
    keys = {(e.from_, e.to): e.partitionKey for e in p.spec.edges}
    conditions = {(e.from_, e.to): f"tags {e.conditions.tags.operator.value} [{', '.join(e.conditions.tags.values)}]"
                  for e in p.spec.edges if e.conditions is not None}
    for ep in naming.edge_partitions(p):
        edge = edges.setdefault((ep.from_vertex, ep.to_vertex), EdgeView(
            from_vertex=ep.from_vertex, to_vertex=ep.to_vertex,
            partition_key=keys.get((ep.from_vertex, ep.to_vertex)),
            conditions=conditions.get((ep.from_vertex, ep.to_vertex)), partitions=[]))
        consumer = statuses.get(ep.to_vertex)
        lag = consumer.lag.get(ep.stream) if consumer is not None else None
        edge.partitions.append(PartitionView(partition=ep.partition, stream=ep.stream, lag=lag))
    return list(edges.values())


def static_view(file: str, p: Pipeline) -> PipelineView:
    """The pipeline from its spec alone (steps ``unknown``): what shows when NATS cannot be read."""
    order = p.topological_order()
    return PipelineView(file=file, name=p.name, dlq_stream=naming.dlq_stream(p.name),
                        steps=[step_view(p, v, None, None, [], time.time(), 0.0) for v in order],
                        edges=edge_views(p, {}))


async def read_status(nc: Any, view: PipelineView, p: Pipeline, stale_after: float) -> None:
    """Fill ``view`` with what the pipeline's status and control buckets and DLQ stream hold."""
    try:
        state = await status.read(nc, p)
    except status.NotProvisioned as e:
        view.nats_error = str(e)
        return
    now = time.time()
    order = p.topological_order()
    view.steps = [step_view(p, v, state.statuses[v], state.desired[v], state.rates[v], now, stale_after)
                  for v in order]
    view.edges = edge_views(p, state.statuses)
    view.dlq_messages = state.dlq_messages
    view.recovery, view.recovery_state = state.recovery, state.recovery_state
    try:
        report = await advise(nc, p)
    except Exception as e:  # the report is an extra: the status above still shows
        log.warning("isbflow UI: the tuning report of pipeline %s failed: %s", p.name, e)
        view.advice_error = f"the tuning report could not be made: {one_line(e)}"
        return
    view.advice = [StepAdviceView(vertex=v.vertex, rate=v.rate, pending=v.pending, pending_unit=v.pending_unit,
                                  utilization=v.utilization, desired_replicas=v.desired_replicas, advice=v.advice)
                   for v in report.vertices]
    view.hot_partitions = [HotPartitionView(from_vertex=e.from_vertex, to_vertex=e.to_vertex, partition=q.partition,
                                            why=q.why) for e in report.edges for q in e.partitions if q.hot]


async def pipeline_views(loaded: list[LoadedSpec], connect: Any, stale_after: float) -> list[PipelineView]:
    """Views of every pipeline; ``connect(specs, pipeline)`` returns a connected client or raises.

    The ISB service being unreachable (or any NATS failure) leaves the spec-only
    view with ``nats_error`` saying why.
    """
    views: list[PipelineView] = []
    for spec in loaded:
        if spec.error is not None:
            views.append(PipelineView(file=spec.file, error=spec.error))
            continue
        for p in spec.pipelines:
            view = static_view(spec.file, p)
            views.append(view)
            try:
                nc = await connect(spec.specs, p)
            except Exception as e:
                view.nats_error = one_line(e)
                continue
            try:
                await asyncio.wait_for(read_status(nc, view, p, stale_after), NATS_TIMEOUT_S)
            except Exception as e:  # a timeout, a server restart mid-read: say so, keep the spec view
                log.warning("isbflow UI: reading status of pipeline %s failed: %s", p.name, e)
                view.nats_error = f"reading status from the ISB service failed: {one_line(e)}"
            finally:
                await nc.close()
    return views


def one_line(e: BaseException) -> str:
    """The first line of an error, for a message on the page."""
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0][:500]


# ------------------------------------------------------------------ quality


def report_pipelines(data_dir: Path, names: list[str]) -> list[str]:
    """Pipelines to list reports for: those of the specs plus any with a reports folder."""
    root = DataDir(data_dir).quality_reports
    found = {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")} if root.is_dir() else set()
    return sorted(set(names) | found)


def _segments_url(base: str, *parts: str) -> str:
    return base.rstrip("/") + "/reports/" + "/".join(quote(p, safe="") for p in parts)


def quality_runs(data_dir: Path, pipelines: list[str], base: str, sink: str | None = None,
                 limit: int = 20) -> list[SinkRuns]:
    """Per pipeline and sink, its newest ``limit`` quality runs, newest first."""
    out: list[SinkRuns] = []
    for name in pipelines:
        try:
            found = reports.list_reports(data_dir, name, sink)
        except reports.UnsafeReportPath:
            continue
        groups: dict[str, list[QualityRun]] = {}
        for r in found:
            s = str(r.get("sink", ""))
            runs = groups.setdefault(s, [])
            if len(runs) < limit:
                runs.append(quality_run(r, name, s, base))
        out.extend(SinkRuns(pipeline=name, sink=s, runs=runs) for s, runs in sorted(groups.items()))
    return out


def shadow_diff(tag: Any) -> ShadowDiff | None:
    """A stored report's ``shadow`` tag (run, live table, diff) as the page shows it; None for a
    run on a live sink or a tag that cannot be read."""
    if not isinstance(tag, dict) or not isinstance(tag.get("run"), str):
        return None
    diff = tag.get("diff") if isinstance(tag.get("diff"), dict) else {}
    try:
        return ShadowDiff(run=tag["run"], live_path=tag.get("live_path"), live_version=tag.get("live_version"),
                          range=tag.get("range") or {}, **{k: diff[k] for k in (
                              "rows_before", "rows_after", "added", "removed", "changed", "unchanged", "columns",
                              "samples") if k in diff})
    except ValueError as e:  # pydantic's ValidationError: show the run, not a broken page
        log.warning("isbflow UI: unreadable shadow diff of run %s: %s", tag.get("run"), e)
        return ShadowDiff(run=tag["run"])


def quality_run(r: dict[str, Any], pipeline: str, sink: str, base: str) -> QualityRun:
    """One stored report as a row: pass/fail, failed checks with their unexpected counts, links."""
    run_id = str(r.get("run_id"))
    json_url = _segments_url(base, *str(r.get("report_file", f"{pipeline}/{sink}/{run_id}.json")).split("/"))
    docs = r.get("docs")
    report_url = _segments_url(base, pipeline, sink, docs) if isinstance(docs, str) and docs else json_url
    failures = [FailedCheck(name=str(f.get("name")), unexpected_count=int(f.get("unexpected_count") or 0),
                            origin=f.get("origin"), kwargs=f.get("kwargs") or {})
                for f in r.get("failures") or [] if isinstance(f, dict)]
    success = r.get("success")
    return QualityRun(shadow=shadow_diff(r.get("shadow")), pipeline=pipeline, sink=sink, run_id=run_id, time=r.get("time"),
                      success=success if isinstance(success, bool) else None, gate=r.get("gate"),
                      table_version=r.get("table_version"), rows=r.get("rows"),
                      checks=len(r.get("checks") or []), failures=failures, error=r.get("error"),
                      report_url=report_url, json_url=json_url)
