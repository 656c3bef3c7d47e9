"""What a step's queries have done, read from Spark's progress: the tracking records of a
step's queries, the input sequences a step has committed, its batch and row counters.

Pure functions of ``StreamingQuery.lastProgress`` (no Spark or NATS calls), so the rules
(a step has committed only what every one of its queries has) are unit-testable.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from isbflow.isb import state as st


@dataclass
class RunningQuery:
    """A step's one Spark query (:meth:`isbflow.spec.models.Pipeline.query_to` names it)."""

    vertex: str
    to: str | None  # names the query: the only out edge's target, None for a sink or a fan-out
    query: Any
    inputs: list[str]  # input stream names (for committed offsets, lag, release)
    seen_batch: int = -1
    #: (target, writer stats dir) of every out edge the query writes, in spec order; [] for a sink
    edges: list[tuple[str, str]] = field(default_factory=list)
    writer: Any = None  # the DataStreamWriter, to start the query again from its checkpoint
    restarts: int = 0


@dataclass
class StepRun:
    vertex: str
    queries: list[RunningQuery] = field(default_factory=list)
    status: st.StepStatus | None = None
    draining: bool = False
    drain_point: dict[str, int] | None = None


def last_progress(queries: list[RunningQuery]) -> list[dict | None]:
    """Each query's ``lastProgress``, asked once: each ask is two Py4J calls and a JSON parse of the
    report, and the continuous loop reads it for offsets and counters alike, every poll, every step."""
    return [rq.query.lastProgress for rq in queries]


def committed_offsets(rq: RunningQuery, progress: dict | None = None) -> dict[str, int] | None:
    """Input stream -> committed seq from the query's last completed batch (None before one);
    ``progress``: its ``lastProgress`` when the caller has it already."""
    progress = progress if progress is not None else rq.query.lastProgress
    if not progress or not progress.get("sources"):
        return None
    out: dict[str, int] = {}
    for src in progress["sources"]:
        end = src.get("endOffset")
        if isinstance(end, str):
            try:
                end = json.loads(end)
            except ValueError:
                continue
        if isinstance(end, dict):
            for stream, o in end.items():
                if isinstance(o, dict) and "seq" in o:
                    out[stream] = int(o["seq"])
    return out


def step_committed(queries: list[RunningQuery], progress: list[dict | None] | None = None) -> dict[str, int]:
    """What the step has committed: only what all of its queries have (a step has one, but a
    runner may hold a restarted one beside it). A stream one query has not reported yet (no batch since it started
    or restarted) is not committed at all, or its release would purge what that query reads."""
    progress = progress if progress is not None else last_progress(queries)
    per_query = [committed_offsets(rq, p) or {} for rq, p in zip(queries, progress, strict=True)]
    return {s: min(c[s] for c in per_query) for s in (per_query[0] if per_query else {})
            if all(s in c for c in per_query)}


def _ran(prog: dict | None) -> bool:
    """A progress report of a micro-batch that ran (an idle trigger reports no ``addBatch``, and the
    batch id of the batch still to come)."""
    return bool(prog) and "addBatch" in (prog.get("durationMs") or {})


def account_batches(status: st.StepStatus, queries: list[RunningQuery],
                    progress: list[dict | None] | None = None) -> None:
    """Fold each query's batches since the last call (once each) into the step's batch id, rates,
    rows and late count. Idle triggers count for nothing: with event-driven steps they are common
    (a trigger that waited for input in vain), and one carries the id of the next batch."""
    rows = 0
    progress = progress if progress is not None else last_progress(queries)
    for rq, prog in zip(queries, progress, strict=True):
        if not _ran(prog) or prog["batchId"] == rq.seen_batch:
            continue
        new = [prog]
        # more than one since the last look, or before the first (a sink written through ran two
        # batches of the demo's start-up backlog before its step's first heartbeat: 1,140 rows uncounted)
        if prog["batchId"] > rq.seen_batch + 1:
            new = [p for p in rq.query.recentProgress or []
                   if _ran(p) and rq.seen_batch < p["batchId"] <= prog["batchId"]] or new
        rq.seen_batch = prog["batchId"]
        status.batch_id = max(status.batch_id, prog["batchId"])
        status.input_rows_per_s = float(prog.get("inputRowsPerSecond") or 0.0)
        status.processed_rows_per_s = float(prog.get("processedRowsPerSecond") or 0.0)
        for p in new:
            rows += int(p.get("numInputRows") or 0)
            for so in p.get("stateOperators") or []:
                status.late_total += int(so.get("numRowsDroppedByWatermark") or 0)
    if rows and queries:
        status.rows_total += rows // len(queries)
