"""Reprocess's window recompute: an aggregate sink's windows a range touches, recomputed and replaced.

Contract: for an aggregate sink of a reprocessed region (rows without
``_isb_id``, keyed by ``window_start`` and group columns), :func:`agg_plan`
finds how its rows are made again (the raw sink fed by the same upstream step,
and the chain of steps from there: :class:`AggPlan`); :func:`old_windows`
reads, before the raw sinks change, the windows the range's old rows fall in;
:func:`replace_windows`, after the raw sinks are replaced, recomputes in batch
every window the range touches (old and new rows), from all the raw sink's
rows, through the current code, and replaces the sink's rows of those windows
in ONE Delta commit (:func:`isbflow.sinks.delta.replace_keys` on the sink's
keys: a key no record makes any more is deleted). Nothing else of the sink
changes.

A sink fed by a ``udf.output: update`` step is recomputed by
:func:`isbflow.recovery.aggregates.recompute`, the code recover uses too (its
``recompute_windows`` upserts and keeps vanished keys, so the writing stays
here). Any other (append-mode) aggregate keeps the windows its streaming step
has not emitted yet (:func:`emitted_only`): writing them now would double them.

Also here: :func:`commit_with_retry`, the retry of one replacement commit
against concurrent writers that the raw sinks' replacement uses too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import CommitFailedError
from pyspark.sql import functions as F

from isbflow.isb import ledger
from isbflow.local.delta import load_table
from isbflow.local.delta_arrow import arrow_table
from isbflow.recovery.aggregates import apply_chain, filter_range, recompute
from isbflow.recovery.job import dimension_columns
from isbflow.recovery.reprocess_plan import RangeError, ReprocessError, Source, event_time_column
from isbflow.sinks.delta import delta_arrow_schema, replace_keys, sink_version
from isbflow.sinks.tables import read_version
from isbflow.steps.restart import retry_transient

log = logging.getLogger(__name__)

#: commit attempts when a concurrent writer wins the race (delta-rs CommitFailedError)
COMMIT_ATTEMPTS = 3


def commit_with_retry(what: str, attempt: Callable[[], Any]) -> Any:
    """``attempt()`` again when a concurrent writer committed first (it re-reads what it replaces)."""
    for i in range(COMMIT_ATTEMPTS):
        try:
            return attempt()
        except CommitFailedError as e:
            if i == COMMIT_ATTEMPTS - 1:
                raise ReprocessError(f"{what}: the commit lost {COMMIT_ATTEMPTS} races with concurrent "
                                     f"writers ({e}); run reprocess again") from None
            log.warning("%s: concurrent commit (%s); retrying", what, e)
    raise AssertionError("unreachable")


@dataclass
class AggPlan:
    """How an aggregate sink's windows are recomputed: ``steps`` applied to the raw sink's rows."""

    sink: str
    raw: str
    steps: list[str]
    keys: list[str]
    update: bool  # fed by a udf.output: update step (isbflow.recovery.aggregates recomputes it)
    old_windows: pa.Table | None = None  # window_start/window_end the old rows of the range fall in


def agg_plan(runner, sink: str, raw_sinks: list[str]) -> AggPlan | str:
    """The raw sink and chain of steps that recompute aggregate ``sink``, or why there are none: walk
    up single-input steps until one also feeds a raw sink of the region."""
    p = runner.p
    steps: list[str] = []
    v = sink
    while True:
        ins = p.inputs(v)
        if len(ins) != 1:
            return f"{v!r} has {len(ins)} inputs; windows are recomputed along a single chain of steps"
        up = ins[0].from_
        feeds = [e.to for e in p.outputs(up) if e.to in raw_sinks]
        if feeds and steps:
            break
        if p.vertex(up).udf is None:
            return "no raw sink (with _isb_id) of the range is fed by a step upstream of it"
        steps.insert(0, up)
        v = up
    keys = runner.update_keys(steps[-1])
    if keys:
        return AggPlan(sink, feeds[0], steps, list(keys), update=True)
    return AggPlan(sink, feeds[0], steps, dimension_columns(runner.output_schema(steps[-1])), update=False)


def windows_of(runner, plan: AggPlan, rows_df) -> pa.Table:
    """The distinct (window_start[, window_end]) the aggregation gives ``rows_df`` (raw sink rows)."""
    out = apply_chain(runner, runner.p, plan.steps, rows_df)
    if "window_start" not in out.columns:
        raise ReprocessError(f"aggregate sink {plan.sink!r}: {plan.steps[-1]!r} gives no window_start column "
                             f"({', '.join(out.columns)}); its windows cannot be recomputed")
    cols = ["window_start", *(["window_end"] if "window_end" in out.columns else [])]
    return retry_transient(out.select(*cols).distinct().toArrow, f"the windows of {plan.sink}")


def old_windows(spark, runner, plan: AggPlan, rng: ledger.PartitionRanges) -> pa.Table | None:
    """The windows the raw sink's rows of ``rng`` fall in now (None: no raw table yet). Read them
    before the raw sink's rows of the range are replaced."""
    raw_path = runner.sink_path(runner.p.vertex(plan.raw))
    if sink_version(raw_path) is None:
        return None
    return windows_of(runner, plan, filter_range(spark, read_version(spark, raw_path)[0], rng))


def distinct_windows(parts: list[pa.Table]) -> pa.Table:
    names = parts[0].column_names
    merged = pa.concat_tables([t.select(names) for t in parts], promote_options="permissive")
    return merged.group_by(names, use_threads=False).aggregate([])


def emitted_only(plan: AggPlan, path: str, windows: pa.Table) -> tuple[pa.Table, str | None]:
    """Of ``windows``, those an append-mode aggregate sink holds, and a note on those left out: the
    others are still open in the streaming step, which emits them once the watermark passes (writing
    them now would double them)."""
    held = arrow_table(load_table(path), columns=["window_start"]).column("window_start")
    held = pc.unique(held.cast(windows.schema.field("window_start").type).combine_chunks())
    kept = windows.filter(pc.is_in(windows.column("window_start"), value_set=held))
    if kept.num_rows == windows.num_rows:
        return kept, None
    return kept, (f"{windows.num_rows - kept.num_rows} touched window(s) not yet emitted by {plan.steps[-1]} "
                  "(still open in its state) were left to it")


def first_stamp(runner, vertex: str) -> str | None:
    """Source ``vertex``'s first TIMESTAMP column, None without one."""
    try:
        return event_time_column(runner.source_schema(runner.p.vertex(vertex)), vertex, None)
    except RangeError:
        return None


def recomputed(spark, runner, plan: AggPlan, windows: pa.Table, time_columns: Iterable[str]):
    """The aggregate rows of ``windows`` recomputed from the raw sink's current version, in batch.

    A sink fed by a ``udf.output: update`` step goes through
    :func:`isbflow.recovery.aggregates.recompute` (every raw row through the
    chain); any other through the same chain here, reading only the raw rows
    inside ``[min window_start, max window_end)`` when the raw sink has the
    source's event-time column (the windows are taken to be over it).
    """
    touched = spark.createDataFrame(windows.select(["window_start"]))
    if plan.update:
        df, _, _ = recompute(spark, runner, plan.sink, runner.data_dir, None, raw_sink=plan.raw)
    else:
        raw = read_version(spark, runner.sink_path(runner.p.vertex(plan.raw)))[0]
        tcol = next((c for c in time_columns if c in raw.columns), None)
        if tcol is not None and "window_end" in windows.column_names:
            lo, hi = pc.min(windows.column("window_start")).as_py(), pc.max(windows.column("window_end")).as_py()
            raw = raw.filter((F.col(tcol) >= F.lit(lo)) & (F.col(tcol) < F.lit(hi)))
        df = apply_chain(runner, runner.p, plan.steps, raw)
    names = [f.name for f in runner.input_schema(plan.sink).fields if f.name in df.columns]
    return df.join(F.broadcast(touched), "window_start", "left_semi").select(*names)


@dataclass
class WindowsReplaced:
    """What :func:`replace_windows` did in one aggregate sink."""

    windows_touched: int = 0
    rows_before: int = 0  # the sink's rows of the touched windows before
    rows_after: int = 0  # the rows recomputed
    commit: Any = None  # replace_keys' result; None: nothing was written
    note: str | None = None


def replace_windows(spark, runner, plan: AggPlan, path: str, new_rows, sources: Iterable[Source],
                    metadata: dict[str, Any]) -> WindowsReplaced:
    """Recompute the windows of aggregate sink ``plan.sink`` (its table at ``path``) that the range
    touches, its old windows (``plan.old_windows``) and those of ``new_rows`` (the range's rows as they
    reach the raw sink now, or None), and replace them in one commit carrying ``metadata``
    (module docstring). ``sources``: the range's source partitions (their event-time columns)."""
    out = WindowsReplaced()
    parts = [w for w in (plan.old_windows,) if w is not None]
    if new_rows is not None:
        parts.append(windows_of(runner, plan, new_rows))
    windows = distinct_windows(parts) if parts else None
    if windows is not None and not plan.update:
        windows, out.note = emitted_only(plan, path, windows)
    if windows is None or windows.num_rows == 0:
        return out
    out.windows_touched = windows.num_rows
    time_columns = [c for c in (s.time_column or first_stamp(runner, s.vertex) for s in sources) if c]
    rows = retry_transient(recomputed(spark, runner, plan, windows, time_columns).toArrow,
                           f"recomputing the windows of {plan.sink}")
    rows = rows.cast(delta_arrow_schema(rows.schema))
    touched = spark.createDataFrame(windows.select(["window_start"]))

    def attempt():
        old = read_version(spark, path)[0].join(F.broadcast(touched), "window_start", "left_semi")
        old_keys = retry_transient(old.select(*plan.keys).toArrow, f"the old windows of {plan.sink}")
        out.rows_before = old_keys.num_rows
        return replace_keys(path, rows, old_keys, key=plan.keys, metadata=metadata)

    out.commit = commit_with_retry(f"aggregate sink {plan.sink}", attempt)
    out.rows_after = rows.num_rows
    return out
