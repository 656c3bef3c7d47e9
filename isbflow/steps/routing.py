"""Conditional forwarding (Numaflow's ``edges[].conditions.tags``): which records each out edge takes.

A udf tags its records by returning a ``_tags`` column (:data:`TAGS_COLUMN`,
``array<string>``; null counts as no tags). An out edge with
``conditions.tags`` takes a record when, as in Numaflow,

* ``or`` (the default): any of ``values`` is among the record's tags;
* ``and``: every one of ``values`` is among them;
* ``not``: none of ``values`` is among them;

an edge without conditions takes every record. The match is a Spark column
expression, evaluated in the JVM (no Python per record).

``_tags`` is routing metadata: a udf's ``_tags`` never leaves the step (it is
dropped before the writer, whatever the edges say), so buffers and sinks
downstream never hold it, and the next step can set its own.

**One pass.** A vertex's one query writes all its out edges
(:mod:`isbflow.connector.writer`, *fan-out*): :func:`routed` gives each row its
partition on every edge that takes it (``_isb_partition_<i>``, null where edge
``i``'s conditions do not match), so the transform runs once however many edges
leave it.

**Unrouted records.** When every out edge of a vertex has conditions, a record
may match none of them. It is marked with the writer's
:data:`~isbflow.connector.write_options.UNROUTED_COLUMN`: the writer publishes
none of them and counts them (``unrouted`` in the first edge's write stats,
deduplicated per batch id like every count there; the step's
``StepStatus.unrouted_total``). With ``onUnrouted: deadLetter`` on the vertex
they also carry ``_isb_error``, so the writer dead-letters them with the reason
``no out edge's conditions match tags [...]`` (counted in ``dlq_total`` too).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, StringType

from isbflow.connector.write_options import (
    ERROR_COLUMN,
    PARTITION_COLUMN,
    UNROUTED_COLUMN,
    read_write_totals,
    target_column,
)
from isbflow.spec.models import Edge, OnUnrouted, Pipeline, TagConditions, TagOperator
from isbflow.steps.restart import StepError

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: the column a udf returns to tag its records (Numaflow's message tags)
TAGS_COLUMN = "_tags"


class RoutingError(StepError):
    """A vertex with conditional out edges returns no usable ``_tags`` column."""


def conditional(pipeline: Pipeline, vertex: str) -> bool:
    """True when some out edge of ``vertex`` has conditions."""
    return any(e.conditions is not None for e in pipeline.outputs(vertex))


def tag_match(cond: TagConditions, tags: Column | None = None) -> Column:
    """The condition on a record's tags (``_tags`` by default), never null."""
    tags = F.col(TAGS_COLUMN) if tags is None else tags
    # null array = no tags; null elements are no tags either (they would make arrays_overlap null)
    have = F.array_compact(F.coalesce(tags, F.array().cast("array<string>")))
    values = F.array(*[F.lit(v) for v in dict.fromkeys(cond.values)])
    if cond.operator == TagOperator.AND:
        return F.size(F.array_except(values, have)) == 0
    anyone = F.arrays_overlap(have, values)
    return ~anyone if cond.operator == TagOperator.NOT else anyone


def check_tags(df: DataFrame, pipeline: Pipeline, vertex: str, transform: str) -> None:
    """Raise :class:`RoutingError` when ``vertex`` has conditional out edges and ``df`` has no
    ``_tags`` column of ``array<string>``."""
    if not conditional(pipeline, vertex):
        return
    edges = ", ".join(e.to for e in pipeline.outputs(vertex) if e.conditions is not None)
    if TAGS_COLUMN not in df.columns:
        raise RoutingError(f"step {vertex!r}: its out edges to {edges} have conditions.tags, but what "
                           f"{transform} returns has no {TAGS_COLUMN} column (array<string>) to match them on "
                           f"(columns: {', '.join(df.columns)})")
    dtype = df.schema[TAGS_COLUMN].dataType
    if not (isinstance(dtype, ArrayType) and isinstance(dtype.elementType, StringType)):
        raise RoutingError(f"step {vertex!r}: {TAGS_COLUMN} returned by {transform} must be array<string>, "
                           f"got {dtype.simpleString()} (e.g. F.array(F.lit('error')))")


def routed(df: DataFrame, pipeline: Pipeline, vertex: str, parts: list[Column]) -> DataFrame:
    """What ``vertex``'s query writes (module docstring): ``parts[i]`` is the partition of a row on
    out edge ``i``; one edge: ``_isb_partition`` on the rows it takes (the unrouted ones marked
    for the writer), several: ``_isb_partition_<i>`` per edge, null where it does not take the
    row. ``_tags`` dropped."""
    outs = pipeline.outputs(vertex)
    v = pipeline.vertex(vertex)
    cond = v.udf is not None and conditional(pipeline, vertex)  # sources cannot tag (validation)
    takes = [tag_match(e.conditions.tags) if cond and e.conditions is not None else None for e in outs]
    if cond and all(t is not None for t in takes):
        unrouted = ~_any(takes)
        df = df.withColumn(UNROUTED_COLUMN, unrouted)
        if v.onUnrouted == OnUnrouted.DEAD_LETTER:
            tags = F.array_join(F.coalesce(F.col(TAGS_COLUMN), F.array().cast("array<string>")), ", ")
            reason = F.concat(F.lit("no out edge's conditions match tags ["), tags, F.lit("]"))
            df = df.withColumn(ERROR_COLUMN, F.when(unrouted, reason))
    if len(outs) == 1:
        if takes[0] is not None:  # the rows the edge takes, and the unrouted ones for the writer to count
            df = df.filter(takes[0] | F.col(UNROUTED_COLUMN))
        df = df.withColumn(PARTITION_COLUMN, parts[0].cast("int"))
    else:
        for i, (take, part) in enumerate(zip(takes, parts, strict=True)):
            part = part.cast("int")
            df = df.withColumn(target_column(i), part if take is None else F.when(take, part))
    return df.drop(TAGS_COLUMN) if v.udf else df


def edge_rows(df: DataFrame, pipeline: Pipeline, edge: Edge) -> DataFrame:
    """In batch (reprocess, window recounts): the rows of ``df``, the output of ``edge``'s from-vertex
    with its ``_tags``, that ``edge`` takes, as its buffer would hold them (no ``_tags``)."""
    if not pipeline.vertex(edge.from_).udf:
        return df
    if edge.conditions is not None:
        df = df.filter(tag_match(edge.conditions.tags))
    return df.drop(TAGS_COLUMN)


def _any(columns: list[Any]) -> Any:
    out = columns[0]
    for c in columns[1:]:
        out = out | c
    return out


def unrouted_total(stats_dirs: list[str | None]) -> int:
    """Records a step's writer left unrouted, from the write stats (only the first edge's count them)."""
    total = 0
    for d in stats_dirs:
        if d and Path(d).exists():
            total += int(read_write_totals(d).get("unrouted") or 0)
    return total
