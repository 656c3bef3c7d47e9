"""Where a sink's table is, and reading its current version with Spark.

One home for what the quality checks, recovery and window recompute all need:
the sink vertex of a name (:func:`sink_vertex`), its Delta table folder
(:func:`sink_table_path`: relative paths live under the data dir), the
table's current version as a Spark DataFrame (:func:`read_version`, the
Parquet files ``DeltaTable(path).file_uris()`` lists; no Delta jars), and the
raw sink an aggregate sink is recomputed from (:func:`find_raw_sink`).
"""

from __future__ import annotations

from pathlib import Path

from isbflow.isb import ledger
from isbflow.isb.ledger import ID_COLUMN
from isbflow.local.delta_arrow import arrow_dataset
from isbflow.sinks.pg_read import read_snapshot
from isbflow.sinks.pg_write import PostgresTableMissing
from isbflow.sinks.postgres import PostgresSinkError, PostgresTarget
from isbflow.spec.models import Pipeline, Vertex


class SinkTableError(Exception):
    """No such sink vertex, or no table yet; the message says what to do."""


def sink_vertex(pipeline: Pipeline, sink: str) -> Vertex:
    """The sink vertex named ``sink``; :class:`SinkTableError` naming the sinks there are otherwise."""
    try:
        v = pipeline.vertex(sink)
    except KeyError:
        v = None
    if v is None or v.sink is None:
        sinks = [x.name for x in pipeline.spec.vertices if x.sink is not None]
        raise SinkTableError(f"pipeline {pipeline.name!r} has no sink vertex {sink!r} (sinks: {', '.join(sinks)})")
    return v


def sink_table_path(pipeline: Pipeline, sink: str, data_dir: str | Path) -> str:
    """The Delta table folder of sink vertex ``sink`` (relative paths live under the data dir)."""
    v = sink_vertex(pipeline, sink)
    if v.sink.delta is None:
        raise SinkTableError(f"sink {sink!r} of pipeline {pipeline.name!r} is a PostgreSQL table "
                             f"({v.sink.postgres.table}), not a Delta table")
    path = Path(v.sink.delta.path)
    return str(path if path.is_absolute() else Path(data_dir).absolute() / path)


def fallback_offsets(pipeline: Pipeline, sink: str, data_dir: str | Path) -> tuple[ledger.PartitionRanges, int]:
    """The source offsets of the records sink ``sink``'s fallback table holds (``sink.fallback``: the
    batches and rows its failure policy sent there), and how many records that is; ``({}, 0)`` without
    a fallback, before its first commit, or for a table without ``_isb_id``."""
    v = sink_vertex(pipeline, sink)
    fb = v.sink.fallback
    if fb is None:
        return {}, 0
    if fb.postgres is not None:
        target = PostgresTarget(sink=sink, spec=fb.postgres, app_id=f"{pipeline.name}/{sink}:read-fallback",
                                data_dir=str(Path(data_dir).absolute()), pipeline=pipeline.name)
        try:
            rows = read_snapshot(target).rows
        except PostgresTableMissing:
            return {}, 0
        except PostgresSinkError as e:
            raise SinkTableError(f"the fallback of sink {sink!r}: {e}") from None
    else:
        from deltalake.exceptions import TableNotFoundError  # lazy: delta-rs loads a native library

        from isbflow.local.delta import load_table

        path = Path(fb.delta.path)
        try:
            table = load_table(str(path if path.is_absolute() else Path(data_dir).absolute() / path))
        except TableNotFoundError:
            return {}, 0
        dataset = arrow_dataset(table)
        if ID_COLUMN not in dataset.schema.names:
            return {}, 0
        rows = dataset.to_table(columns=[ID_COLUMN])
    if ID_COLUMN not in rows.schema.names:
        return {}, 0
    ids = rows.column(ID_COLUMN)
    return ledger.id_ranges(ids), len(ids)


def is_postgres(pipeline: Pipeline, sink: str) -> bool:
    """Whether sink vertex ``sink`` writes a PostgreSQL table (not a Delta table)."""
    return sink_vertex(pipeline, sink).sink.postgres is not None


def read_postgres(spark, pipeline: Pipeline, sink: str, data_dir: str | Path):
    """A PostgreSQL sink as :func:`read_version` gives a Delta one, read in one snapshot
    (:func:`isbflow.sinks.pg_read.read_snapshot`): (DataFrame, number of commits, the newest
    commit's ``isb.offsets``, a label naming the table, the offsets its commits hold)."""
    v = sink_vertex(pipeline, sink)
    target = PostgresTarget(sink=sink, spec=v.sink.postgres, app_id=f"{pipeline.name}/{sink}:read",
                            data_dir=str(Path(data_dir).absolute()), pipeline=pipeline.name)
    try:
        snap = read_snapshot(target)
    except PostgresSinkError as e:
        raise SinkTableError(str(e)) from None
    df = spark.createDataFrame(snap.rows)
    return df, snap.batches, {ledger.OFFSETS_KEY: snap.last_offsets}, f"postgres:{v.sink.postgres.table}", snap.held


def read_version(spark, path: str):
    """(DataFrame of the table's current version, version, that commit's metadata)."""
    from deltalake.exceptions import TableNotFoundError  # lazy: delta-rs loads a native library

    from isbflow.local.delta import load_table, table_history

    try:
        table = load_table(path)
    except TableNotFoundError:
        raise SinkTableError(f"no Delta table at {path}: the sink has not committed a batch yet; "
                             "run the pipeline first") from None
    version = table.version()
    history = table_history(table, 1)  # the commit of `version` (delta-rs may list a newer one)
    uris = table.file_uris()
    if uris:
        df = spark.read.option("basePath", path).parquet(*uris)
    else:
        df = spark.createDataFrame(table.schema().to_arrow().empty_table())
    return df, version, (history[0] if history else {})


def find_raw_sink(spark, pipeline: Pipeline, sink: str, data_dir: str | Path) -> str | None:
    """The raw sink (has ``_isb_id``) sharing the most upstream steps with ``sink``; a sink fed
    through ``conditions.tags`` holds a subset of the records and is never chosen."""
    mine = pipeline.ancestors(sink)
    best: tuple[int, str] | None = None
    for v in pipeline.spec.vertices:
        if v.sink is None or v.name == sink or pipeline.filtered(v.name):  # a subset: not a basis
            continue
        shared = len(mine & pipeline.ancestors(v.name))
        if shared == 0 or (best and best[0] >= shared):
            continue
        try:
            df, _, _ = read_version(spark, sink_table_path(pipeline, v.name, data_dir))
        except SinkTableError:
            continue
        if ID_COLUMN in df.columns:
            best = (shared, v.name)
    return best[1] if best else None
