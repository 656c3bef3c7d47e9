"""Carrying a step over from one query per out edge to one query per vertex.

Until the fan-out writer, a vertex with several out edges ran one Spark query per
edge, each with a checkpoint ``<vertex>-to-<to>``; it now runs one query, with
the checkpoint ``<vertex>`` (:meth:`isbflow.spec.models.Pipeline.query_to`). A
vertex with one out edge keeps its checkpoint's name, so only a vertex with
several edges meets this.

A Spark checkpoint cannot be merged into another, but a stateless step's
position is only its input offsets: when every per-edge checkpoint of the
vertex has committed the same input offsets (a drained pipeline, or one stopped
between batches), the new query starts right after them (the reader's
``startingOffsets``) and the old checkpoints are moved aside: nothing is read
twice, nothing skipped (an out edge added since has no checkpoint: it gets what
the step reads from there on, as any edge added to a running step). When they
differ, or the step keeps state (an
aggregation's state lives in its checkpoint), starting would drop or double
records on some edge, so the step refuses to start and names the way out: a
recovery (``isbflow replay --mode recover``) moves every checkpoint aside and
replays from the sinks' offset ledger, merging on ``_isb_id``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from isbflow.spec.models import OutputMode, Pipeline
from isbflow.spec.paths import DataDir
from isbflow.steps.restart import StepError

log = logging.getLogger(__name__)


def newest_commit(checkpoint: str | Path) -> int | None:
    """The newest batch id in a query's commit log (``commits/<id>``, beside Spark's ``.<id>.crc``);
    None when it holds none or does not exist."""
    try:
        names = os.listdir(Path(checkpoint) / "commits")
    except FileNotFoundError:
        return None
    return max((int(n) for n in names if n.isdigit()), default=None)


def committed_end(checkpoint: Path) -> dict[str, dict] | None:
    """The input offsets of the newest batch a query's checkpoint committed (the reader's offset
    JSON, stream -> ``{"inc", "seq"}``); None when it committed none."""
    newest = newest_commit(checkpoint)
    if newest is None:
        return None
    lines = (checkpoint / "offsets" / str(newest)).read_text().splitlines()
    out: dict[str, dict] = {}
    for line in lines[2:]:  # "v1", the batch metadata, then one line per source
        if line.strip() and line.strip() != "-":
            out.update(json.loads(line))
    return out


def fan_out_start(data_dir: str | Path, p: Pipeline, vertex: str) -> dict[str, dict] | None:
    """Where the one query of ``vertex`` starts when the vertex still has per-edge checkpoints
    from before the fan-out writer (module docstring): their common committed offsets, with
    those checkpoints moved aside; None when there is nothing to carry over. Raises
    :class:`StepError` when they cannot be carried over exactly."""
    dirs = DataDir(data_dir)
    if p.query_to(vertex) is not None or dirs.checkpoint(p.name, vertex).exists():
        return None
    old = [c for e in p.outputs(vertex) if (c := dirs.checkpoint(p.name, vertex, e.to)).exists()]
    if not old:
        return None
    ends = {c.name: committed_end(c) for c in old}
    v = p.vertex(vertex)
    stateful = v.udf is not None and v.udf.output == OutputMode.UPDATE
    agreed = len({json.dumps(e, sort_keys=True) for e in ends.values()}) == 1
    if stateful or not agreed:
        why = ("its state (an aggregation) lives in those checkpoints" if stateful else
               "they stand at different input offsets: " + "; ".join(f"{n} {json.dumps(e)}" for n, e in ends.items()))
        raise StepError(f"step {vertex!r} has one checkpoint per out edge ({', '.join(ends)}), from before one query "
                        f"per vertex, and cannot carry them over exactly: {why}. Run 'isbflow replay --mode recover' "
                        "(moves them aside and replays from the sinks' ledger, merging on _isb_id: nothing "
                        "doubled)")
    start = next(iter(ends.values()))
    aside = dirs.checkpoints(p.name) / f"_per-edge-{time.strftime('%Y%m%dT%H%M%S')}"
    aside.mkdir(parents=True, exist_ok=True)
    for c in old:
        c.rename(aside / c.name)
    fresh = [e.to for e in p.outputs(vertex) if dirs.checkpoint(p.name, vertex, e.to).name not in ends]
    log.warning("step %s: its per-edge checkpoints agree at %s; its one query starts there (old checkpoints in "
                "%s)%s", vertex, json.dumps(start), aside,
                f"; edges new since then ({', '.join(fresh)}) get what it reads from there on" if fresh else "")
    return start or None
