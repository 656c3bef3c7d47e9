"""Delta sinks: Spark writes Parquet, the driver commits once per micro-batch.

This module only re-exports the sink's public names, so that
``from isbflow.sinks.delta import X`` keeps working. The code lives by where it runs:

- :mod:`isbflow.sinks.delta_spark`: what a step's Delta sink runs.
  :class:`DeltaBatchWriter`, a ``foreachBatch`` function: Spark's own Parquet
  writer on the executors, the files adopted into the table and committed
  once per micro-batch by :func:`commit_batch`.
- :mod:`isbflow.sinks.delta_files`: executor side of the Python stream writer
  (``isb-delta``; no step uses it any more). The ``isb-delta`` options,
  a task's rows written as Parquet files in the table folder with their add
  actions (:func:`write_batch_files`, :func:`file_stats`), the commit message,
  the sink's errors.
- :mod:`isbflow.sinks.delta_commit`: driver side. The ``isb-delta`` data source
  and stream writer, and :func:`commit_batch` (shared by both writers): one Delta commit per micro-batch,
  at most once per app id (its docstring states the exactly-once contract and
  the ``append``, ``merge`` and ``upsert`` modes).
- :mod:`isbflow.sinks.delta_merge`: driver side, no Spark. Reading a table
  (:func:`sink_version`, :func:`read_sink`, :func:`read_ids`,
  :func:`count_rows`) and the one-commit rewrites recovery and reprocess use
  (:func:`merge_insert_missing`, :func:`merge_upsert`, :func:`replace_range`,
  :func:`replace_keys`).
"""

from __future__ import annotations

from isbflow.sinks.delta_commit import (
    BatchCommit,
    DeltaSinkDataSource,
    DeltaStreamWriter,
    commit_batch,
    remove_unreferenced_batch_files,
)
from isbflow.sinks.delta_files import (
    DEFAULT_ROW_GROUP_ROWS,
    MODES,
    NULL_PARTITION,
    SHORT_NAME,
    DeltaCommitMessage,
    DeltaSchemaMismatch,
    DeltaSinkError,
    DeltaSinkOptionError,
    DeltaSinkOptions,
    delta_arrow_schema,
    sink_app_id,
    write_batch_files,
)
from isbflow.sinks.delta_merge import (
    REPLACE_OP_COLUMN,
    MergeResult,
    ReplaceResult,
    UpsertResult,
    check_schema,
    count_rows,
    key_predicate,
    latest_per_key,
    merge_insert_missing,
    merge_stats,
    merge_upsert,
    open_table,
    read_ids,
    read_sink,
    replace_keys,
    replace_range,
    sink_version,
)
from isbflow.sinks.delta_spark import DeltaBatchWriter, batch_offsets
from isbflow.sinks.delta_stats import STATS_STRING_PREFIX, file_stats, nan_columns

__all__ = [
    "DEFAULT_ROW_GROUP_ROWS",
    "MODES",
    "NULL_PARTITION",
    "REPLACE_OP_COLUMN",
    "SHORT_NAME",
    "STATS_STRING_PREFIX",
    "BatchCommit",
    "DeltaBatchWriter",
    "DeltaCommitMessage",
    "DeltaSchemaMismatch",
    "DeltaSinkDataSource",
    "DeltaSinkError",
    "DeltaSinkOptionError",
    "DeltaSinkOptions",
    "DeltaStreamWriter",
    "MergeResult",
    "ReplaceResult",
    "UpsertResult",
    "batch_offsets",
    "check_schema",
    "commit_batch",
    "count_rows",
    "delta_arrow_schema",
    "file_stats",
    "nan_columns",
    "key_predicate",
    "latest_per_key",
    "merge_insert_missing",
    "merge_stats",
    "merge_upsert",
    "open_table",
    "read_ids",
    "read_sink",
    "remove_unreferenced_batch_files",
    "replace_keys",
    "replace_range",
    "sink_app_id",
    "sink_version",
    "write_batch_files",
]
