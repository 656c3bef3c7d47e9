"""What a step's queries have done, read from Spark's progress: the tracking records of a
step's queries, the input sequences a step has committed, its batch and row counters.

Pure functions of ``StreamingQuery.lastProgress`` (no Spark or NATS calls), so the rules
(a step has committed only what every one of its queries has) are unit-testable.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from isbflow.isb import state as st
from isbflow.steps.checkpoints import newest_commit


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
    writer: Any = None  # what starts the query again from its checkpoint (a QueryStarter)
    restarts: int = 0
    checkpoint: str | None = None  # its checkpoint directory (a local path), for :func:`has_new_batch`
    commits_mtime: int = -1  # of the checkpoint's commits/ directory when it was last listed
    newest_commit: int = -1  # the newest batch id in it then


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


#: how old a directory's mtime must be before a listing of it is trusted until the mtime changes
MTIME_SETTLED_NS = 100_000_000


def has_new_batch(rq: RunningQuery) -> bool:
    """Whether ``rq`` may have finished a batch its step has not accounted for: its checkpoint's
    ``commits/`` holds a batch id past the last one seen. Spark writes a batch's commit file before it
    reports the batch's progress, so a look in between finds the commit and asks again at the next.

    One ``stat`` of the directory per look (it is listed only when it changed), where asking Spark is
    a ``lastProgress`` (two Py4J calls, the report serialized to JSON in the JVM and parsed here):
    the continuous loop looks at every query twice a second, and most looks find nothing new (a
    query of the demo runs a batch every 5 s). True when there is no checkpoint to look at."""
    if rq.checkpoint is None:
        return True
    try:
        mtime = os.stat(os.path.join(rq.checkpoint, "commits")).st_mtime_ns
        if mtime != rq.commits_mtime:
            newest = newest_commit(rq.checkpoint)
            rq.newest_commit = -1 if newest is None else newest
            # the kernel stamps times from a clock that ticks every few ms: a file added in the same
            # tick as the listing leaves the mtime as it was, so a fresh mtime is listed again
            rq.commits_mtime = mtime if time.time_ns() - mtime > MTIME_SETTLED_NS else -1
    except (OSError, ValueError):
        return True
    return rq.newest_commit > rq.seen_batch


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
    last batch's wall time, rows and late count. Idle triggers count for nothing: with event-driven steps they are common
    (a trigger that waited for input in vain), and one carries the id of the next batch."""
    rows = 0
    progress = progress if progress is not None else last_progress(queries)
    for rq, prog in zip(queries, progress, strict=True):
        if not prog:
            continue
        # an idle trigger after a batch carries the next batch's id: the batch before it ran, and a
        # look that came after the idle trigger's report (not between the two) still counts it
        last_ran = prog["batchId"] if _ran(prog) else prog["batchId"] - 1
        if last_ran <= rq.seen_batch:
            continue
        new = [prog] if _ran(prog) else []
        # more than one since the last look, or before the first (a sink written through ran two
        # batches of the demo's start-up backlog before its step's first heartbeat: 1,140 rows uncounted)
        if last_ran > rq.seen_batch + 1 or not new:
            new = [p for p in rq.query.recentProgress or []
                   if _ran(p) and rq.seen_batch < p["batchId"] <= last_ran] or new
        rq.seen_batch = last_ran
        status.batch_id = max(status.batch_id, last_ran)
        if new:  # (a report Spark no longer keeps is not counted)
            status.input_rows_per_s = float(new[-1].get("inputRowsPerSecond") or 0.0)
            status.processed_rows_per_s = float(new[-1].get("processedRowsPerSecond") or 0.0)
            status.batch_seconds = float((new[-1].get("durationMs") or {}).get("triggerExecution") or 0) / 1e3
        for p in new:
            rows += int(p.get("numInputRows") or 0)
            for so in p.get("stateOperators") or []:
                status.late_total += int(so.get("numRowsDroppedByWatermark") or 0)
    if rows and queries:
        status.rows_total += rows // len(queries)
