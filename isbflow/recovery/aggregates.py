"""Recompute an aggregate sink's windows exactly, from the raw sink, in one Delta commit.

An aggregate sink is the sink of a step with ``udf.output: update`` (e.g. the
demo's ``minutely`` -> ``agg``): it upserts the step's rows on the step's
``keys``. Its rows carry no ``_isb_id``, so a replay through the stateful step
cannot merge them like raw rows: a replay of part of a window's records would
overwrite the complete window with a partial count. :func:`recompute_windows`
is the exact alternative. It

1. finds the raw sink sharing the aggregate's upstream
   (:func:`isbflow.sinks.tables.find_raw_sink`, or ``raw_sink=``) and the chain
   of steps from the raw sink's upstream vertex to the aggregate step (the demo:
   just ``minutely``);
2. reads the raw sink's current version with Spark and runs that chain's
   transforms in **batch** over it (a watermark does nothing in batch: every
   record counts, late ones too);
3. keeps the windows (``keys``) that the selected source records fall into
   (``windows_filter``) and replaces exactly those rows of the aggregate sink:
   rows with those keys are updated, missing ones inserted, in one Delta merge
   (one commit: a reader sees all old or all new windows, never a mix). With no
   filter, every window is recomputed and the table is overwritten in one
   commit, which also removes windows no raw record makes any more.

It returns the number of windows written. Run it while the aggregate step and
its sink are stopped (recovery and reprocess drain them first): a micro-batch
committing meanwhile could upsert a window again from the stream's state.

``windows_filter`` selects the source records whose windows are recomputed:

- ``None``: every window;
- a mapping ``{"<source>/<partition>": [[first, last], ...]}`` of inclusive
  source sequence ranges (the offset ledger's shape), matched on ``_isb_id``;
- a Spark SQL predicate string, or a ``pyspark.sql.Column``, over the raw
  sink's rows (e.g. ``"ts >= '2025-01-01 00:00:00' AND ts < '2025-01-01 01:00:00'"``).

A window is recomputed from *all* raw records that fall into it, not only the
selected ones (source ranges select with :func:`filter_range`, which reprocess
uses too).

Also here, what recover and reprocess share about aggregates:
:func:`recompute_sinks` (recover's recompute of every aggregate sink after the
replay), :func:`recompute` (the rows alone, reprocess writes them itself) and
:func:`apply_chain` (steps' transforms in batch, as reprocess's window
recompute runs them too).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from deltalake import CommitProperties, write_deltalake
from deltalake.exceptions import TableNotFoundError
from pyspark.sql import Column
from pyspark.sql import functions as F

from isbflow.isb.ledger import ID_COLUMN
from isbflow.local.delta import load_table
from isbflow.sinks.delta import check_schema, delta_arrow_schema, merge_upsert
from isbflow.sinks.tables import (
    SinkTableError,
    find_raw_sink,
    read_version,
    sink_table_path,
    sink_vertex,
)
from isbflow.spec.models import OutputMode, Pipeline
from isbflow.spec.transforms import load_transform
from isbflow.steps import routing
from isbflow.steps.restart import retry_transient
from isbflow.steps.runner import ERROR_COLUMN

log = logging.getLogger(__name__)

#: source partition -> inclusive sequence ranges, e.g. ``{"in/0": [[1, 5000]]}``
SourceRanges = Mapping[str, Sequence[Sequence[int]]]


class AggregateError(Exception):
    """Windows cannot be recomputed; the message names the sink or step and what is missing."""


def update_step_of(pipeline: Pipeline, sink: str) -> tuple[str, list[str]]:
    """(the ``udf.output: update`` step feeding sink ``sink``, its keys); AggregateError if none."""
    try:
        sink_vertex(pipeline, sink)
    except SinkTableError as e:
        raise AggregateError(str(e)) from None
    for e in pipeline.inputs(sink):
        up = pipeline.vertex(e.from_)
        if up.udf is not None and up.udf.output == OutputMode.UPDATE:
            return up.name, list(up.udf.keys)
    raise AggregateError(f"sink {sink!r} of pipeline {pipeline.name!r} is not fed by a step with "
                         "udf.output: update (keys), so it has no windows to recompute")


def _chain(pipeline: Pipeline, start: str, step: str) -> list[str]:
    """The steps after ``start`` up to ``step`` (inclusive), each with one input; AggregateError if none."""
    paths: dict[str, list[str]] = {start: []}
    todo = [start]
    while todo:
        n = todo.pop(0)
        for e in pipeline.outputs(n):
            if e.to not in paths and pipeline.vertex(e.to).udf is not None:
                paths[e.to] = [*paths[n], e.to]
                todo.append(e.to)
    if step not in paths:
        raise AggregateError(f"step {step!r} is not downstream of {start!r} (the raw sink's input) "
                             "through steps only: its windows cannot be recomputed from that raw sink")
    chain = paths[step]
    joined = [s for s in chain if len(pipeline.inputs(s)) != 1]
    if joined:
        raise AggregateError(f"step(s) {joined} have several inputs: recomputing windows from one raw sink "
                             "needs a chain of single-input steps")
    if pipeline.inputs(chain[0])[0].conditions is not None:  # the raw rows carry no _tags to match
        raise AggregateError(f"the edge {start!r} -> {chain[0]!r} has conditions.tags: the raw sink's rows "
                             "carry no tags, so the records it took cannot be told apart")
    return chain


def filter_range(spark, df, rng: SourceRanges):
    """Rows of ``df`` whose ``_isb_id`` (``<source>/<partition>/<seq>``) has its sequence in one of
    ``rng``'s inclusive ranges: a broadcast range join (no list of ids, no predicate per range)."""
    rows = [(part, int(lo), int(hi)) for part, rs in rng.items() for lo, hi in rs]
    if not rows:
        return df.limit(0)
    r = spark.createDataFrame(rows, "__p string, __lo long, __hi long")
    pattern = r"^(.+/[0-9]+)/([0-9]+)$"
    d = (df.withColumn("__part", F.regexp_extract(ID_COLUMN, pattern, 1))
         .withColumn("__seq", F.regexp_extract(ID_COLUMN, pattern, 2)))
    d = d.withColumn("__seq", F.when(F.col("__seq") != "", F.col("__seq").cast("long")))
    cond = (F.col("__part") == F.col("__p")) & F.col("__seq").between(F.col("__lo"), F.col("__hi"))
    return d.join(F.broadcast(r), cond, "left_semi").drop("__part", "__seq")


def _selected(spark, raw, windows_filter: Any):
    """The raw rows ``windows_filter`` selects (module docstring)."""
    if isinstance(windows_filter, Mapping):
        return filter_range(spark, raw, windows_filter)
    if isinstance(windows_filter, Column):
        return raw.filter(windows_filter)
    if isinstance(windows_filter, str):
        return raw.filter(F.expr(windows_filter))
    raise AggregateError(f"windows_filter must be None, source ranges {{'<source>/<partition>': [[first, "
                         f"last]]}}, a SQL predicate string or a Column; got {type(windows_filter).__name__}")


def _runner_and_pipeline(runner_or_pipeline: Any) -> tuple[Any, Pipeline]:
    if isinstance(runner_or_pipeline, Pipeline):
        return None, runner_or_pipeline
    p = getattr(runner_or_pipeline, "p", None)
    if not isinstance(p, Pipeline):
        raise AggregateError("recompute_windows takes a PipelineRunner or a Pipeline, got "
                             f"{type(runner_or_pipeline).__name__}")
    return runner_or_pipeline, p


def apply_chain(runner, p: Pipeline, chain: list[str], df):
    """The chain's transforms in batch; with a runner (a Pipeline alone has none) its reference
    tables are read and each step's output is what it writes (no error or raw-record column)."""
    for i, name in enumerate(chain):
        v = p.vertex(name)
        assert v.udf is not None
        if i:  # the rows as the edge from the previous step carries them (conditions, no _tags)
            df = routing.edge_rows(df, p, p.inputs(name)[0])
        if runner is not None:
            df = runner.apply_transform(name, df).drop(ERROR_COLUMN, "_isb_raw")
            continue
        if v.udf.references:
            raise AggregateError(f"step {name!r} reads reference tables "
                                 f"({', '.join(r.name for r in v.udf.references)}): pass a PipelineRunner, "
                                 "not a Pipeline, so they can be read")
        df = load_transform(v.udf.transform)(df)
    return df.drop(routing.TAGS_COLUMN)  # routing metadata never reaches a sink


def recompute(spark, runner_or_pipeline: Any, sink: str, data_dir: str | Path,
              windows_filter: SourceRanges | str | Any | None = None, *, raw_sink: str | None = None):
    """The recomputed windows as a Spark DataFrame (the columns of the aggregate step's output), with
    the raw sink's name and version it was read from: ``(df, raw_sink, raw_version)``.

    Nothing is written; :func:`recompute_windows` writes. See the module docstring for the filter.
    """
    runner, p = _runner_and_pipeline(runner_or_pipeline)
    step, keys = update_step_of(p, sink)
    raw_name = raw_sink or find_raw_sink(spark, p, sink, data_dir)
    if raw_name is None:
        raise AggregateError(f"sink {sink!r}: no raw sink (with {ID_COLUMN}) shares an upstream step with it "
                             "and holds a table: nothing to recompute its windows from")
    raw_inputs = p.inputs(raw_name)
    if not raw_inputs:
        raise AggregateError(f"raw sink {raw_name!r} has no input edge")
    errors: list[AggregateError] = []
    for e in raw_inputs:
        try:
            if e.conditions is not None:
                raise AggregateError(f"raw sink {raw_name!r} is fed through conditions.tags ({e.from_!r} -> "
                                     f"{raw_name!r}): it holds a subset, not every record to recount from")
            start, chain = e.from_, _chain(p, e.from_, step)
            break
        except AggregateError as err:
            errors.append(err)
    else:
        raise errors[-1]
    try:
        raw, raw_version, _ = read_version(spark, sink_table_path(p, raw_name, data_dir))
    except SinkTableError as e:
        raise AggregateError(f"sink {sink!r}: {e}") from None
    if runner is not None:  # the raw rows as the upstream step wrote them (drop table-only columns)
        raw = raw.select(*runner.output_schema(start).fieldNames())
    full = apply_chain(runner, p, chain, raw)
    missing = [k for k in keys if k not in full.columns]
    if missing:
        raise AggregateError(f"step {step!r}: udf.keys {missing} are not columns of its output {full.columns}")
    if windows_filter is None:
        return full, raw_name, raw_version
    touched = apply_chain(runner, p, chain, _selected(spark, raw, windows_filter))
    touched = touched.select(*[F.col(k).alias(f"_isb_k_{i}") for i, k in enumerate(keys)]).distinct()
    cond = None
    for i, k in enumerate(keys):
        c = full[k].eqNullSafe(touched[f"_isb_k_{i}"])
        cond = c if cond is None else cond & c
    return full.join(touched, cond, "left_semi"), raw_name, raw_version


def recompute_windows(spark, runner_or_pipeline: Any, sink: str, data_dir: str | Path,
                      windows_filter: SourceRanges | str | Any | None = None, *,
                      raw_sink: str | None = None) -> int:
    """Recompute the windows of aggregate sink ``sink`` touched by ``windows_filter``'s source records
    from the raw sink, in batch, and replace exactly those rows in one Delta commit; returns how many
    windows were written.

    ``runner_or_pipeline``: a :class:`isbflow.steps.runner.PipelineRunner` (needed when a transform
    reads reference tables) or a :class:`isbflow.spec.models.Pipeline`. ``data_dir``: where relative
    sink paths live. ``windows_filter``: ``None`` (all windows: the table is overwritten), source
    ranges ``{"<source>/<partition>": [[first, last], ...]}``, or a SQL predicate (string or Column)
    over the raw sink's rows. ``raw_sink``: the raw sink to read (default: found from the graph).
    Raises :class:`AggregateError` when the sink is no aggregate or no raw sink can serve.
    """
    _, p = _runner_and_pipeline(runner_or_pipeline)
    _, keys = update_step_of(p, sink)
    if isinstance(windows_filter, Mapping) and not any(windows_filter.values()):
        return 0  # no source record selected: no window touched
    df, raw_name, raw_version = recompute(spark, runner_or_pipeline, sink, data_dir, windows_filter,
                                          raw_sink=raw_sink)
    rows = retry_transient(df.toArrow, f"recomputing the windows of {sink}")
    rows = rows.cast(delta_arrow_schema(rows.schema))
    path = sink_table_path(p, sink, data_dir)
    metadata = {"isb.raw_sink": raw_name, "isb.raw_version": raw_version,
                "isb.windows_filter": _describe(windows_filter), "isb.rows": rows.num_rows}
    try:
        table = load_table(path)
    except TableNotFoundError:
        table = None
    partition_by = list(table.metadata().partition_columns) if table is not None else []
    if windows_filter is None:
        if table is not None:
            names = [f.name for f in table.schema().fields]
            if sorted(names) == sorted(rows.column_names):
                rows = rows.select(names)
            check_schema(table, rows.schema, f"recompute windows of {path}")
        write_deltalake(path, rows, mode="overwrite", partition_by=partition_by or None,
                        commit_properties=CommitProperties(
                            custom_metadata={**metadata, "isb.operation": "recompute_windows"}))
    elif rows.num_rows:
        merge_upsert(path, rows, keys, metadata=metadata, partition_by=partition_by,
                     operation="recompute_windows")
    log.info("recomputed %d window(s) of sink %s from raw sink %s v%s (%s)", rows.num_rows, sink, raw_name,
             raw_version, metadata["isb.windows_filter"])
    return rows.num_rows


def recompute_sinks(spark, runner, sinks: list[str], data_dir: str | Path) -> tuple[dict[str, int], dict[str, str]]:
    """Every window of each aggregate sink among ``sinks`` (those fed by a ``udf.output: update``
    step; the others are skipped) recomputed from its raw sink, one commit per sink: recover's last
    replay step. Returns ({sink: windows written}, {sink: why it could not be recomputed})."""
    done: dict[str, int] = {}
    failed: dict[str, str] = {}
    for v in sinks:
        try:
            update_step_of(runner.p, v)
        except AggregateError:
            continue  # not an aggregate sink
        try:
            done[v] = recompute_windows(spark, runner, v, data_dir, None)
        except AggregateError as e:
            log.warning("recover %s: aggregate sink %s stays as replayed: %s", runner.p.name, v, e)
            failed[v] = str(e)
    return done, failed


def _describe(windows_filter: Any) -> str:
    if windows_filter is None:
        return "all windows"
    if isinstance(windows_filter, Mapping):
        return "source ranges " + ", ".join(f"{p}: {list(map(list, rs))}" for p, rs in windows_filter.items())
    return f"predicate {windows_filter}"


__all__ = [
    "AggregateError",
    "SourceRanges",
    "apply_chain",
    "filter_range",
    "recompute",
    "recompute_sinks",
    "recompute_windows",
    "update_step_of",
]
