"""Delta sink, driver side: reading a committed table, and the one-commit rewrites of it.

Runs on the driver only (or any plain Python process: recovery, reprocess,
tests); nothing here is pickled, runs in a Spark task or calls Spark (the
errors and :func:`delta_arrow_schema` come from
:mod:`isbflow.sinks.delta_files`, which imports pyspark). Every function opens the table at ``path`` with delta-rs,
reads or commits, and returns plain values.

- reads: :func:`open_table`, :func:`sink_version`, :func:`read_sink`,
  :func:`read_ids` (a column, by default ``_isb_id``, and the version it was
  read at), :func:`count_rows`, :func:`check_schema`, :func:`merge_stats` (what the merge commits
  after a version offered and inserted);
- rewrites, each ONE Delta commit: :func:`merge_insert_missing` (insert rows
  whose key is absent: recovery replays and the sink's ``mode=merge``),
  :func:`merge_upsert` (replace or insert on a key: the sink's ``mode=upsert``
  and window recompute), :func:`replace_range` (predicate overwrite) and
  :func:`replace_keys` (reprocess). ``merge_insert_missing`` and
  ``merge_upsert`` may record an app transaction, never lowering the one the
  table holds (the stream writer's replay check relies on it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import TableNotFoundError
from deltalake.transaction import AddAction

from isbflow.isb.ledger import ID_COLUMN
from isbflow.local.delta import load_table, table_history
from isbflow.local.delta_arrow import arrow_dataset, arrow_table
from isbflow.sinks.delta_files import (
    IDENTIFIER,
    DeltaSchemaMismatch,
    DeltaSinkError,
    delta_arrow_schema,
)
from isbflow.sinks.delta_log import TABLE_CONFIGURATION

#: The merge source column of :func:`replace_keys` saying what a row is for (never written).
REPLACE_OP_COLUMN = "__isb_replace_op"


# --------------------------------------------------------------------------- reads


def open_table(path: str) -> DeltaTable | None:
    """The Delta table at ``path``, or ``None`` when there is none (yet)."""
    try:
        return load_table(path)
    except TableNotFoundError:
        return None


def sink_version(path: str) -> int | None:
    """The table's current version, or ``None`` when no table exists at ``path``."""
    table = open_table(path)
    return table.version() if table else None


def read_sink(path: str) -> pa.Table:
    """The table's current version as a pyarrow Table (driver memory: for checks and tests)."""
    table = open_table(path)
    if table is None:
        raise DeltaSinkError(f"no Delta table at {path}; has the sink committed a batch yet?")
    return arrow_table(table)


def read_ids(path: str, column: str = ID_COLUMN) -> tuple[pa.Array, int | None]:
    """(every value of ``column``, default ``_isb_id``, as one array; the version read).

    Without a table: an empty string array and ``None``.
    """
    table = open_table(path)
    if table is None:
        return pa.array([], pa.string()), None
    return arrow_table(table, columns=[column]).column(column).combine_chunks(), table.version()


def count_rows(path: str) -> int:
    """The rows of the table's current version (0 without a table); reads no data, only metadata."""
    table = open_table(path)
    return arrow_dataset(table).count_rows() if table else 0


def check_schema(table: DeltaTable, schema: pa.Schema, where: str) -> None:
    """:class:`DeltaSchemaMismatch` unless ``schema`` has the table's columns and types, in order."""
    have = [(f.name, str(f.type)) for f in table.schema().fields]
    want = [(f.name, str(f.type)) for f in DeltaSchema.from_arrow(schema).fields]
    if have != want:
        raise DeltaSchemaMismatch(
            f"{where}: the rows' columns {want} differ from the table's {have}; write to a new "
            "table path, or migrate the table before restarting the step"
        )


def check_not_null(table: DeltaTable | None, actions: Iterable[AddAction], root: str, where: str) -> None:
    """:class:`DeltaSinkError` when a file of ``actions`` (relative to the table folder ``root``) holds
    a null in a column ``table`` declares NOT NULL (a Delta writer must enforce it). The files'
    ``nullCount`` stats answer; a file without them has that column read back."""
    required = [f.name for f in table.schema().fields if not f.nullable] if table is not None else []
    for a in actions if required else ():
        stats = json.loads(a.stats or "{}")
        counts = stats.get("nullCount") or {}
        for col in required:
            if col in a.partition_values:
                nulls = stats.get("numRecords", 1) if a.partition_values[col] is None else 0
            elif isinstance(counts.get(col), int):
                nulls = counts[col]
            else:
                nulls = pq.read_table(os.path.join(root, a.path), columns=[col]).column(col).null_count
            if nulls:
                raise DeltaSinkError(f"{where}: column {col!r} is NOT NULL in the table, and the batch holds "
                                     f"{nulls} null(s) in it (file {a.path}); give it a value in the step's "
                                     "transform, or make the column nullable")


def check_append(table: DeltaTable, schema: pa.Schema, partition_by: Iterable[str], where: str) -> None:
    """:class:`DeltaSchemaMismatch` unless rows of ``schema`` partitioned by ``partition_by`` can be
    appended to ``table`` as they are (:func:`check_schema`, and the same partition columns)."""
    check_schema(table, schema, where)
    if list(table.metadata().partition_columns) != list(partition_by):
        raise DeltaSchemaMismatch(
            f"{where}: partitionBy {list(partition_by)} differs from the table's "
            f"partition columns {table.metadata().partition_columns}; use the table's"
        )


# --------------------------------------------------------------------------- keys


def _keys(path: str, table: pa.Table, key: str | Iterable[str], what: str) -> list[str]:
    keys = [key] if isinstance(key, str) else list(key)
    if not keys or any(not IDENTIFIER.match(k) or k not in table.column_names for k in keys):
        raise DeltaSinkError(
            f"{what} {path}: key {key!r} must be plain column name(s) present in the rows "
            f"({table.column_names})"
        )
    return keys


def _distinct_keys(table: pa.Table, keys: list[str]) -> pa.Table:
    return table.select(keys).group_by(keys, use_threads=False).aggregate([])


def key_predicate(keys: Iterable[str], target: str = "t", source: str = "s",
                  null_safe: bool = True) -> str:
    """A merge predicate matching rows with equal keys, nulls equal to nulls (a null service is a key
    like any other): ``(t.a IS NOT DISTINCT FROM s.a) AND ...``; ``null_safe=False``: ``t.a = s.a AND ...``
    (nulls match nothing; cheaper when no key is null)."""
    if not null_safe:
        return " AND ".join(f"{target}.{k} = {source}.{k}" for k in keys)
    return " AND ".join(f"({target}.{k} IS NOT DISTINCT FROM {source}.{k})" for k in keys)


def latest_per_key(table: pa.Table, key: str | Iterable[str], version_column: str,
                   where: str = "upsert") -> tuple[pa.Table, int]:
    """(the rows with the highest ``version_column`` per key, without that column; rows dropped).

    Several upstream micro-batches can change one key before the sink commits
    them, so one sink batch can hold several versions of a key: the latest is
    the one with the highest version (the upstream writer's batch number). Two
    rows of one key with the same version must be equal (a republished frame);
    if they differ, "latest" is undefined and :class:`DeltaSinkError` says so.
    Rows keep their first-seen order.
    """
    keys = _keys(where, table, key, "latest rows of")
    if version_column not in table.column_names:
        raise DeltaSinkError(f"{where}: version column {version_column!r} is not in the rows "
                             f"({table.column_names})")
    versions = table.column(version_column)
    if versions.null_count:
        raise DeltaSinkError(f"{where}: {versions.null_count} row(s) have a null {version_column}")
    out = table.drop_columns([version_column])
    best: dict[tuple, int] = {}
    vs = versions.to_pylist()
    for i, k in enumerate(zip(*(table.column(c).to_pylist() for c in keys), strict=True)):
        j = best.get(k)
        if j is None or vs[i] > vs[j]:
            best[k] = i
        elif vs[i] == vs[j] and out.slice(i, 1).to_pylist() != out.slice(j, 1).to_pylist():
            raise DeltaSinkError(
                f"{where}: two different rows of key {dict(zip(keys, k, strict=True))} carry the same "
                f"{version_column} {vs[i]}: which one is the latest is undefined (does the upstream "
                "step emit a key twice per micro-batch?)")
    keep = sorted(best.values())
    return out.take(pa.array(keep, pa.int64())), table.num_rows - len(keep)


# --------------------------------------------------------------------------- merges


def _merge_props(delta: DeltaTable | None, metadata: Mapping[str, Any] | None, operation: str,
                 keys: list[str], app_id: str | None, version: int | None) -> CommitProperties:
    """Commit properties of a merge: ``metadata`` plus the operation and key, and the app
    transaction ``(app_id, version)``: none without both, nor when the table already records a
    version at least as high (never lowered: the stream writer's replay check relies on it)."""
    txns = []
    if app_id is not None and version is not None:
        current = delta.transaction_version(app_id) if delta else None
        if current is None or version > current:
            txns = [Transaction(app_id=app_id, version=version)]
    return CommitProperties(
        custom_metadata={**(metadata or {}), "isb.operation": operation, "isb.key": ",".join(keys)},
        app_transactions=txns or None,
    )


@dataclass(frozen=True)
class MergeResult:
    version: int
    inserted: int


def merge_insert_missing(
    path: str,
    table: pa.Table,
    key: str | Iterable[str] = "_isb_id",
    app_id: str | None = None,
    version: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    partition_by: Iterable[str] = (),
) -> MergeResult:
    """Insert the rows of ``table`` whose ``key`` the sink does not hold yet, in one commit.

    Idempotent: running it again inserts nothing. ``key`` is a column or
    several (a composite key). With ``app_id`` and
    ``version`` the commit also records that app transaction, unless the table
    already records a version at least as high (never lowered: the stream
    writer's replay check relies on it). Creates the table if absent
    (partitioned by ``partition_by``). ``metadata`` is added to the commit's
    custom metadata.
    """
    keys = _keys(path, table, key, "merge into")
    delta = open_table(path)
    props = _merge_props(delta, metadata, "merge_insert_missing", keys, app_id, version)
    if delta is None:
        write_deltalake(path, table, mode="append", commit_properties=props,
                        partition_by=list(partition_by) or None, configuration=TABLE_CONFIGURATION)
        return MergeResult(load_table(path).version(), table.num_rows)
    check_schema(delta, table.schema, f"merge into {path}")
    metrics = (
        delta.merge(table, predicate=key_predicate(keys, null_safe=False), source_alias="s",
                    target_alias="t", commit_properties=props)
        .when_not_matched_insert_all()
        .execute()
    )
    return MergeResult(load_table(path).version(), int(metrics.get("num_target_rows_inserted", 0)))


@dataclass(frozen=True)
class UpsertResult:
    version: int
    updated: int
    inserted: int


def upsert_keys(path: str, table: pa.Table, key: str | Iterable[str]) -> list[str]:
    """The key columns of an upsert of ``table`` into ``path``, once each of its keys is held by one row."""
    keys = _keys(path, table, key, "upsert into")
    if table.num_rows:
        distinct = _distinct_keys(table, keys).num_rows
        if distinct != table.num_rows:
            raise DeltaSinkError(
                f"upsert into {path}: {table.num_rows - distinct} row(s) repeat a key {keys} of an "
                "earlier row; give the sink a versionColumn so the latest version wins")
    return keys


def conform(delta: DeltaTable, table: pa.Table, where: str) -> pa.Table:
    """``table`` in the Delta types and, when it has the same columns, in ``delta``'s column order;
    :class:`DeltaSchemaMismatch` unless its columns and types are then the table's."""
    table = table.cast(delta_arrow_schema(table.schema))
    names = [f.name for f in delta.schema().fields]
    if sorted(names) == sorted(table.column_names):
        table = table.select(names)  # the table's column order; types are checked next
    check_schema(delta, table.schema, where)
    return table


def merge_upsert(
    path: str,
    table: pa.Table,
    key: str | Iterable[str],
    app_id: str | None = None,
    version: int | None = None,
    metadata: Mapping[str, Any] | None = None,
    partition_by: Iterable[str] = (),
    operation: str = "merge_upsert",
    delta: DeltaTable | None = None,
) -> UpsertResult:
    """Replace the rows whose ``key`` matches a row of ``table`` and insert the others, in one commit.

    ``table`` must hold each key once (:func:`latest_per_key` makes it so);
    keys compare null-safe. App transaction, metadata and table creation as in
    :func:`merge_insert_missing`. Idempotent: the same rows again change nothing
    a reader can see (the values are equal). ``delta``: the table at ``path`` at its latest
    version, kept by the caller (a sink's :class:`~isbflow.local.delta.TableCache`); the merge
    moves it to the version it commits. Without it the table is loaded before the merge and
    again after it, each load listing the whole log (``bench/delta_log.py``: an upsert into a
    table of 10,000 log entries 57 ms of CPU with the loads, 38 with a kept table).
    """
    keys = upsert_keys(path, table, key)
    kept = delta is not None
    delta = delta if kept else open_table(path)
    props = _merge_props(delta, metadata, operation, keys, app_id, version)
    if delta is None:
        table = table.cast(delta_arrow_schema(table.schema))
        write_deltalake(path, table, mode="append", commit_properties=props,
                        partition_by=list(partition_by) or None, configuration=TABLE_CONFIGURATION)
        return UpsertResult(load_table(path).version(), 0, table.num_rows)
    table = conform(delta, table, f"upsert into {path}")
    metrics = (
        delta.merge(table, predicate=key_predicate(keys), source_alias="s", target_alias="t",
                    commit_properties=props)
        .when_matched_update_all()
        .when_not_matched_insert_all()
        .execute()
    )
    return UpsertResult(delta.version() if kept else load_table(path).version(),
                        int(metrics.get("num_target_rows_updated", 0)),
                        int(metrics.get("num_target_rows_inserted", 0)))


def replace_range(path: str, table: pa.Table, predicate: str) -> int:
    """Replace the rows matching ``predicate`` (SQL) by ``table`` in one commit; return the version.

    Readers see either the old range or the new one, never a mix. Every row of
    ``table`` must match ``predicate`` (delta-rs rejects the write otherwise).
    """
    delta = open_table(path)
    if delta is None:
        raise DeltaSinkError(f"replace range in {path}: no Delta table there to replace rows in")
    check_schema(delta, table.schema, f"replace range in {path}")
    write_deltalake(
        delta,
        table,
        mode="overwrite",
        predicate=predicate,
        commit_properties=CommitProperties(
            custom_metadata={"isb.operation": "replace_range", "isb.predicate": predicate}
        ),
    )
    return load_table(path).version()


@dataclass(frozen=True)
class ReplaceResult:
    """What :func:`replace_keys` committed; ``version`` is None when there was nothing to change."""

    version: int | None
    deleted: int
    updated: int
    inserted: int


def replace_keys(
    path: str,
    rows: pa.Table,
    old_keys: pa.Table,
    key: str | Iterable[str] = "_isb_id",
    metadata: Mapping[str, Any] | None = None,
) -> ReplaceResult:
    """Replace, in ONE Delta commit, the rows whose key is in ``old_keys`` by ``rows`` (reprocess).

    After the commit the table holds for those keys exactly ``rows``: a key of
    ``old_keys`` missing from ``rows`` is deleted, a key of ``rows`` the table
    holds is updated, any other row of ``rows`` inserted; rows of other keys are
    untouched. It is one merge whose source is ``rows`` plus a delete marker per
    vanished key (column :data:`REPLACE_OP_COLUMN`, not written), so a reader
    sees the table before or after the replacement, never half of it.

    ``rows`` must hold each key once and have the table's columns; every key of
    ``rows`` should be in the replaced range (the caller's contract: the same
    range reads ``old_keys``). Keys compare null-safe when a key column holds a
    null. Between reading ``old_keys`` and this commit no writer may add rows of
    those keys (reprocess only replaces ranges the pipeline has passed).

    Why not :func:`replace_range` (a predicate overwrite): a source range is a
    set of sequences parsed out of ``_isb_id`` strings, and an event-time range
    is hundreds of short sequence runs (out-of-order events). Measured with
    delta-rs 1.6.6 on 100K rows: 2,000 ``BETWEEN`` terms took ~180 s (the
    parse is evaluated per term), a 30,000-value ``IN`` list crashed the
    process (segfault), and ``TRY_CAST`` cannot be written to the log. The merge
    joins on the key instead: 0.24 s for 50K changed rows of a 200K-row table.
    """
    keys = _keys(path, rows, key, "replace keys in")
    missing = [k for k in keys if k not in old_keys.column_names]
    if missing:
        raise DeltaSinkError(f"replace keys in {path}: old_keys lacks key column(s) {missing}")
    delta = open_table(path)
    if delta is None:
        raise DeltaSinkError(f"replace keys in {path}: no Delta table there to replace rows in")
    if rows.num_rows and _distinct_keys(rows, keys).num_rows != rows.num_rows:
        raise DeltaSinkError(f"replace keys in {path}: the new rows repeat a key {keys}; each key must "
                             "appear once")
    names = [f.name for f in delta.schema().fields]
    if sorted(names) != sorted(rows.column_names):
        raise DeltaSchemaMismatch(f"replace keys in {path}: the new rows' columns {rows.column_names} "
                                  f"are not the table's {names}")
    rows = rows.select(names)
    rows = rows.cast(delta_arrow_schema(rows.schema))
    check_schema(delta, rows.schema, f"replace keys in {path}")
    target = arrow_dataset(delta).schema
    nullable = pa.schema([f.with_nullable(True) for f in target])
    old = _distinct_keys(old_keys.select(keys).cast(pa.schema([nullable.field(k) for k in keys])), keys)
    if len(keys) == 1:
        gone_mask = pc.invert(pc.is_in(old.column(keys[0]), value_set=rows.column(keys[0]).combine_chunks()))
        gone = old.filter(gone_mask)
    else:
        have = set(zip(*(rows.column(k).to_pylist() for k in keys), strict=True))
        old_rows = list(zip(*(old.column(k).to_pylist() for k in keys), strict=True))
        gone = old.take(pa.array([i for i, k in enumerate(old_rows) if k not in have], pa.int64()))
    if rows.num_rows == 0 and gone.num_rows == 0:
        return ReplaceResult(None, 0, 0, 0)
    new = rows.cast(nullable).append_column(REPLACE_OP_COLUMN, pa.repeat(pa.scalar("u"), rows.num_rows))
    markers = pa.table(
        {f.name: gone.column(f.name) if f.name in keys else pa.nulls(gone.num_rows, f.type) for f in nullable},
        schema=nullable,
    ).append_column(REPLACE_OP_COLUMN, pa.repeat(pa.scalar("d"), gone.num_rows))
    source = pa.concat_tables([new, markers])
    nulls = any(source.column(k).null_count for k in keys)
    props = CommitProperties(
        custom_metadata={**(metadata or {}), "isb.operation": "replace_keys", "isb.key": ",".join(keys),
                         "isb.rows": rows.num_rows, "isb.deleted": gone.num_rows}
    )
    op = f"s.{REPLACE_OP_COLUMN}"
    metrics = (
        delta.merge(source, predicate=key_predicate(keys, null_safe=nulls), source_alias="s",
                    target_alias="t", commit_properties=props)
        .when_matched_delete(predicate=f"{op} = 'd'")
        .when_matched_update_all(predicate=f"{op} = 'u'", except_cols=[REPLACE_OP_COLUMN])
        .when_not_matched_insert_all(predicate=f"{op} = 'u'", except_cols=[REPLACE_OP_COLUMN])
        .execute()
    )
    return ReplaceResult(load_table(path).version(), int(metrics.get("num_target_rows_deleted", 0)),
                         int(metrics.get("num_target_rows_updated", 0)),
                         int(metrics.get("num_target_rows_inserted", 0)))


def merge_stats(path: str, after_version: int | None) -> tuple[int, int]:
    """(rows offered, rows inserted) by the merge-mode commits (a recovery's replay) after ``after_version``."""
    table = open_table(path)
    if table is None:
        return 0, 0
    history = table_history(table)
    offered = inserted = 0
    for h in history:
        if after_version is not None and h["version"] <= after_version:
            continue
        if h.get("isb.operation") != "merge_insert_missing":
            continue
        metrics = h.get("operationMetrics") or {}
        rows = int(h.get("isb.rows", metrics.get("num_source_rows", 0)))
        offered += rows
        # a merge into a new table is a plain write of every row
        inserted += int(metrics.get("num_target_rows_inserted", metrics.get("num_added_rows", rows)))
    return offered, inserted
