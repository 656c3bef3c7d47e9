"""An upsert sink's commit made by the sink itself: the batch's keys replaced in one Delta version,
without delta-rs' merge.

A delta-rs merge lists the whole ``_delta_log`` folder twice a commit on a local disk (before it
commits and after: ``strace``; object_store reads every entry of a folder it lists), so an upsert
sink's commit grew with the log it keeps: ``bench/delta_log.py`` measured 19.7 ms of the driver's
CPU with 205 log entries and 325 ms with 140,105 (a week of the demo's ``agg`` sink at a commit every
5 s), with the sink's table kept. An append stopped paying it when the sink wrote its commit file
itself (:class:`isbflow.local.delta.TableCache`); :func:`own_upsert` does the same for an upsert:

1. the files that may hold a key of the batch: every active file (:meth:`TableCache.files`) but
   those whose stats put an orderable key column (integer, date, timestamp) outside the batch's
   range of it, for a key column the batch holds no null in (strings are not pruned on: a writer may
   keep a prefix of a long string as its bound);
2. those files read; their rows whose key is one of the batch's (nulls equal to nulls, as the
   merge's ``IS NOT DISTINCT FROM``) are the rows updated, and each file holding one is removed;
3. the removed files' other rows and the batch's rows written as the batch's new files (in its
   pending folder, :func:`~isbflow.sinks.delta_files.write_batch_files`): in one file while those
   other rows are fewer than :data:`KEEP_APART_ROWS`, else in a file of their own, so the rows no
   batch changes again (a closed window's) are not written again by every batch;
4. one commit (:meth:`TableCache.commit`): the removes, the adds with their stats, the app
   transaction and the metadata, as delta-rs' merge writes them (operation ``MERGE``).

Only for an unpartitioned table that takes plain commits (:meth:`TableCache.plain`) and whose files
it removes have plain names; else, or when another writer took the version, nothing is committed
(the files it wrote stay in the batch's pending folder, which the commit's clean-up empties) and
the caller merges through delta-rs as before. What a reader sees after the commit is what the
merge leaves: every row of the batch, each key once (a key the table held twice is held once: the
merge would have updated both rows to the same values).
"""

from __future__ import annotations

import datetime as dt
import os
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.transaction import AddAction

from isbflow.local.delta import FileStats, TableCache
from isbflow.sinks.delta_files import DeltaSinkOptions, write_batch_files
from isbflow.sinks.delta_merge import UpsertResult, conform, key_predicate, upsert_keys

#: the rows a removed file kept (its rows the batch does not change) from which they go to a file of
#: their own instead of the batch's file (module docstring, 3)
KEEP_APART_ROWS = 10_000
#: the task partition in the names of the files an upsert writes (a batch's read tasks number theirs
#: from 0): :func:`~isbflow.sinks.delta_files.batch_file_name`
UPSERT_TASK = 1_000_000
#: a file an upsert removes: a path it writes into the log as delta-rs listed it
_PLAIN_PATH = re.compile(r"^[A-Za-z0-9._=/-]+$")
#: stats of a timestamp are kept to the millisecond (min rounded down, max up; a writer may truncate)
_SLACK = dt.timedelta(milliseconds=1)


def own_upsert(options: DeltaSinkOptions, tables: TableCache, delta: DeltaTable, batch: pa.Table, batch_id: int,
               metadata: Mapping[str, Any], note: Callable[[list[AddAction]], None]) -> UpsertResult | None:
    """Upsert ``batch`` (each key once) into ``delta``, the sink's kept table at its latest version,
    as one version the sink writes (module docstring); ``note(adds)`` just before the commit (the
    files it names must survive a crash after it). ``None`` when the table does not take such a
    commit or another writer took the version: nothing committed."""
    where = f"upsert into {options.path}"
    if options.partition_by or delta.metadata().partition_columns or not tables.removes_plainly():
        return None
    keys = upsert_keys(options.path, batch, options.merge_key)
    batch = conform(delta, batch, where)
    files = tables.files()
    ranges = _ranges(batch, keys)
    candidates = [p for p, f in files.items() if _may_hold(f, ranges)]
    target = _read(options.path, candidates, batch.schema)
    if target is None:
        return None
    parts, file_of = target
    try:
        hit, inserted = _matches(parts, batch, keys)
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return None  # a key type pyarrow cannot compare or join on: delta-rs merges it
    updated = len(hit)
    matched = np.zeros(parts.num_rows, dtype=bool)
    matched[hit] = True
    touched = np.unique(file_of[hit])
    if any(not _PLAIN_PATH.match(candidates[i]) for i in touched):
        return None
    kept = parts.filter(pa.array(np.isin(file_of, touched) & ~matched))
    groups = [kept, batch] if kept.num_rows >= KEEP_APART_ROWS else [pa.concat_tables([kept, batch])]
    adds: list[AddAction] = []
    stats: dict[str, FileStats] = {}
    for i, rows in enumerate(g for g in groups if g.num_rows):
        actions = write_batch_files(options, rows.to_batches(), batch_id, UPSERT_TASK + i).actions
        adds += actions
        stats.update({a.path: _stats_of(rows, keys, a.size) for a in actions})  # unpartitioned: one file
    removes = [(candidates[i], files[candidates[i]].size) for i in touched]
    metrics = {"num_source_rows": batch.num_rows, "num_target_rows_inserted": inserted,
               "num_target_rows_updated": updated, "num_target_rows_deleted": 0,
               "num_target_rows_copied": kept.num_rows, "num_output_rows": kept.num_rows + batch.num_rows,
               "num_target_files_scanned": len(candidates),
               "num_target_files_skipped_during_scan": len(files) - len(candidates),
               "num_target_files_added": len(adds), "num_target_files_removed": len(removes)}
    note(adds)
    version = tables.commit(adds, removes, {**metadata, "isb.operation": "merge_upsert", "isb.key": ",".join(keys),
                                            "operationMetrics": metrics},
                            options.app_id, batch_id, _parameters(keys), operation="MERGE", stats=stats)
    return None if version is None else UpsertResult(version, updated, inserted)


def _matches(parts: pa.Table, batch: pa.Table, keys: list[str]) -> tuple[np.ndarray, int]:
    """The rows of ``parts`` whose key ``batch`` holds (their indices), and the batch's rows whose key
    ``parts`` does not hold (the inserted)."""
    fills = {k: _fill(batch.column(k), parts.column(k)) for k in keys}
    tk = _match_table(parts, keys, fills).append_column("__i", pa.array(np.arange(parts.num_rows)))
    bk = _match_table(batch, keys, fills)
    on = bk.column_names
    hit = tk.join(bk, keys=on, join_type="left semi").column("__i").to_numpy()
    return hit, batch.num_rows - bk.join(tk.select(on), keys=on, join_type="left semi").num_rows


def _parameters(keys: list[str]) -> dict[str, str]:
    """The merge's ``operationParameters`` as delta-rs' ``when_matched_update_all``/``when_not_matched_insert_all``
    write them."""
    return {"mergePredicate": key_predicate(keys).replace("(", "").replace(")", ""),
            "matchedPredicates": '[{"actionType":"update"}]', "notMatchedPredicates": '[{"actionType":"insert"}]',
            "notMatchedBySourcePredicates": "[]"}


def _ranges(batch: pa.Table, keys: list[str]) -> dict[str, tuple[Any, Any, Any]]:
    """Per orderable key column without nulls in ``batch``: its least and greatest value, and the slack
    a file's stats of it are compared with."""
    out = {}
    for k in keys:
        col = batch.column(k)
        typ = col.type
        if col.null_count or not len(col) or not (pa.types.is_integer(typ) or pa.types.is_timestamp(typ)
                                                   or pa.types.is_date(typ)):
            continue
        mm = pc.min_max(col)
        out[k] = (mm["min"].as_py(), mm["max"].as_py(), 0 if pa.types.is_integer(typ) else _SLACK)
    return out


def _may_hold(f: FileStats, ranges: Mapping[str, tuple[Any, Any, Any]]) -> bool:
    """Whether a file with stats ``f`` may hold a key of the batch whose ranges are ``ranges``."""
    if f.rows == 0:
        return False
    for k, (lo, hi, slack) in ranges.items():
        least, greatest = f.mins.get(k), f.maxs.get(k)
        if least is None or greatest is None:
            continue
        try:
            if greatest + slack < lo or least - slack > hi:
                return False
        except TypeError:  # a bound of another kind (an aware and a naive time): not pruned on
            continue
    return True


def _read(root: str, paths: list[str], schema: pa.Schema) -> tuple[pa.Table, np.ndarray] | None:
    """The rows of ``paths`` in ``schema``, and for each row the index of its file in ``paths``;
    ``None`` when a file does not hold the table's columns in types they cast from."""
    tables, of = [], []
    for i, path in enumerate(paths):
        try:
            t = pq.read_table(os.path.join(root, unquote(path))).select(schema.names).cast(schema)
        except (KeyError, pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return None
        tables.append(t)
        of.append(np.full(t.num_rows, i, dtype=np.int64))
    if not tables:
        return schema.empty_table(), np.zeros(0, dtype=np.int64)
    return pa.concat_tables(tables).combine_chunks(), np.concatenate(of)


def _fill(*columns: pa.ChunkedArray) -> pa.Scalar | None:
    """A value of the key columns' type to stand for their nulls (a flag column tells them apart),
    ``None`` when every value is null."""
    for col in columns:
        if col.null_count < len(col):
            return pc.min_max(col)["min"]
    return None


def _match_table(t: pa.Table, keys: list[str], fills: Mapping[str, pa.Scalar | None]) -> pa.Table:
    """The columns a hash join compares keys on with nulls equal to nulls: per key a null flag and
    the values with nulls filled (a join's nulls match nothing)."""
    cols, names = [], []
    for n, k in enumerate(keys):
        col = t.column(k)
        cols.append(pc.cast(pc.is_null(col), pa.int8()))
        names.append(f"__n{n}")
        if fills[k] is not None:
            cols.append(pc.fill_null(col, fills[k]))
            names.append(f"__v{n}")
    return pa.table(cols, names=names)


def _stats_of(rows: pa.Table, keys: list[str], size: int) -> FileStats:
    """The stats of a file holding ``rows`` (its key columns: what :func:`_may_hold` reads)."""
    mins, maxs, nulls = {}, {}, {}
    for k in keys:
        col = rows.column(k)
        nulls[k] = col.null_count
        if col.null_count < len(col):
            mm = pc.min_max(col)
            mins[k], maxs[k] = mm["min"].as_py(), mm["max"].as_py()
    return FileStats(size, rows.num_rows, mins, maxs, nulls)
