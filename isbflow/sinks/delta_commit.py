"""Delta sink, driver side: one Delta commit per micro-batch, and the Python stream writer ``isb-delta``.

:func:`commit_batch` is the commit of both writers: the one a step runs,
:class:`isbflow.sinks.delta_spark.DeltaBatchWriter` (Spark's own Parquet writer;
its files are adopted into the table folder under the same names and markers
before it calls :func:`commit_batch`), and the ``isb-delta`` data source below,
whose Python tasks write the Parquet with pyarrow (kept for direct use; no step
uses it: it copies every row from the JVM into Python).

Contract (exactly once per micro-batch and app id), told for ``isb-delta``:

- ``write`` runs in executor tasks (:func:`isbflow.sinks.delta_files.write_batch_files`).
  It writes the task's rows as Parquet files straight into the table folder
  (Hive-style ``col=value/`` folders for ``partitionBy``), named
  ``part-<batchId>-<taskPartition>-<appTag>-<uuid>.parquet``, and returns their
  Delta add actions. Nothing is visible to readers yet.
- ``commit`` runs on the driver once per micro-batch (:func:`commit_batch`). If
  the table already records the batch for this app id
  (``transaction_version(appId) >= batchId``: Spark replays a batch whose Delta
  commit landed but whose checkpoint commit did not), it commits nothing and
  removes the batch's new files. Otherwise it commits every add action of the
  batch in one Delta transaction carrying the app transaction
  ``(appId, batchId)``, creating the table on the first non-empty batch. Empty
  batches commit nothing. Either way, files of this app and batch that the log
  does not reference (failed task attempts, an earlier crashed run of the
  batch) are removed (:func:`remove_unreferenced_batch_files`). The commit finds
  the batch's files by the markers its tasks left in the batch's own pending
  folder and names the files it commits there first (``COMMITTING``): it never
  walks the table folder or lists its files, nor, for an append, its log (a step's
  sink keeps its table, :class:`isbflow.local.delta.TableCache`, and writes an
  append's commit file itself while it alone commits; delta-rs' merge still lists it).
- ``abort`` runs on the driver when a task failed: it removes the batch's
  unreferenced files.

Pickled: :class:`DeltaStreamWriter` holds only the validated, picklable
:class:`~isbflow.sinks.delta_files.DeltaSinkOptions` and the Spark schema.

Offsets: when the rows carry ``_isb_id``, each task also returns, per source
partition, the ranges of source sequences it wrote
(:func:`isbflow.isb.ledger.id_ranges`); the commit records their union in
the commit's custom metadata ``isb.offsets`` and, with the options
``pipeline``, ``sink`` and ``settings``, in the pipeline's offset ledger (KV),
after the Delta commit (see :mod:`isbflow.isb.ledger`).

``mode=merge`` (recovery runs): the batch's rows are inserted only where the
table lacks their ``mergeKey`` (default ``_isb_id``; a comma list for a
composite key), in one Delta merge on the driver that also records the app
transaction (:func:`isbflow.sinks.delta_merge.merge_insert_missing`); the
batch's Parquet files are then removed. It funnels the batch through the
driver: meant for replays, not for the steady stream; a batch of more than
:data:`MERGE_CHUNK_ROWS` rows is merged in chunks of that many, each its own
commit (:func:`_commit_merge_chunks`), so a replay's larger batch merges as
batches of the default size did. **Ledger fast path**:
with the key ``_isb_id``, when every row's id names a distinct source offset
and none of those offsets is in the ranges the table's commits record
(``isb.offsets``, :func:`isbflow.isb.ledger.from_delta_history`), no row of
the batch can be in the table (a committed row's offset is always in its
commit's ranges): the batch's files are committed as they are, like ``append``
(no read-back, no join with the table). A recovery's replay above what the sink
held takes this path; batches overlapping it merge. Measured in
``bench/recovery.py``.

``mode=upsert`` (the sink of a step with ``udf.output: update``, e.g. windowed
aggregates): in one Delta merge per micro-batch on the driver, rows whose
``mergeKey`` the table holds replace those rows, the others are inserted
(written by the sink itself into its kept table, :mod:`isbflow.sinks.delta_upsert`, else
:func:`isbflow.sinks.delta_merge.merge_upsert`); the same app-transaction
check makes a replayed batch commit nothing. With ``versionColumn`` (an
integer column the upstream writer stamps, see :mod:`isbflow.steps.update`),
when a key appears several times in one micro-batch (several upstream batches
changed it) the row with the highest version wins
(:func:`isbflow.sinks.delta_merge.latest_per_key`) and the column is not
written; without it a key twice in one batch is an error. ``versionColumn``
works in ``merge`` mode too (recovery of such a sink: the latest version of a
missing key is inserted). Like ``merge``, it funnels the batch through the
driver: fine for aggregates, whose rows are few.

delta-rs records app transactions but does not enforce them, hence
the check in ``commit``. The check-then-commit is not atomic: one app id must
have one running query (Spark's checkpoint already demands that). The table
folder must be a local or shared filesystem path reachable by the driver and
every executor.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake import Schema as DeltaSchema
from deltalake.exceptions import CommitFailedError, DeltaError
from deltalake.transaction import AddAction, create_table_with_add_actions
from pyspark import TaskContext
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter
from pyspark.sql.types import StructType

from isbflow.isb import ledger
from isbflow.isb.connect import settings_from_json
from isbflow.isb.errors import LedgerFull
from isbflow.local.delta import TableCache, log_file_vanished, table_history
from isbflow.sinks.batch_files import batch_chunks, read_batch_files
from isbflow.sinks.batch_files import committing as _committing
from isbflow.sinks.batch_files import note_committing as _note_committing
from isbflow.sinks.delta_files import (
    SHORT_NAME,
    DeltaCommitMessage,
    DeltaSinkError,
    DeltaSinkOptionError,
    DeltaSinkOptions,
    pending_dir,
    pending_files,
    remove_file,
    write_batch_files,
)
from isbflow.sinks.delta_log import TABLE_CONFIGURATION
from isbflow.sinks.delta_merge import (
    check_append,
    check_not_null,
    latest_per_key,
    merge_insert_missing,
    merge_upsert,
    open_table,
)
from isbflow.sinks.delta_upsert import own_upsert

_log = logging.getLogger(__name__)
#: times a batch's commit is tried again after sink maintenance changed the table under it
METADATA_RETRIES = 3
#: The most rows of a merge-mode batch the driver reads back and merges at once (a live batch's
#: ``readBatchSize`` by default). A recovery's replay reads a written-through sink in batches of 10x
#: that (:data:`isbflow.steps.write_through.REPLAY_BATCHES`); a batch the ledger cannot prove new is
#: merged in chunks of this many rows (:func:`_commit_merge_chunks`), as batches of the default size
#: were. Measured (one merge-mode commit of 1M rows, a quarter of them held by a 500K-row table, a
#: process each): peak RSS 825 MiB in one merge, 677 MiB in chunks of 100K, at 1.76x the time (3.84
#: against 2.18 s): a merge's memory is mostly the table it scans, and every chunk scans it again.
MERGE_CHUNK_ROWS = 100_000


def remove_unreferenced_batch_files(path: str, app_id: str, batch_id: int,
                                   committed: Iterable[str] | None = None) -> int:
    """Remove this app's files of ``batch_id`` that the table's log does not reference; clear the
    batch's pending folder.

    Only the batch's own files are looked at: the markers its tasks left
    (:func:`isbflow.sinks.delta_files.pending_files`), never a walk of the table.
    ``committed``: the table-relative paths this attempt has just committed (the
    driver knows them); ``None`` (a skipped replay, an abort) keeps the files the
    ``COMMITTING`` list names when the table holds the batch: the attempt that
    wrote it last is the one whose commit landed (an attempt writes it only when
    the table does not hold the batch yet, and one app id has one driver).
    Returns how many files were removed. Files of other batches or apps are untouched.
    """
    folder = pending_dir(path, app_id, batch_id)
    if not os.path.isdir(folder):
        return 0
    if committed is None:
        table = open_table(path)
        done = table.transaction_version(app_id) if table else None
        committed = _committing(folder) if done is not None and done >= batch_id else ()
    keep = {os.path.normpath(c) for c in committed}
    removed = 0
    for rel in pending_files(path, app_id, batch_id):
        if os.path.normpath(rel) not in keep:
            remove_file(os.path.join(path, rel))
            removed += 1
    shutil.rmtree(folder, ignore_errors=True)
    return removed


@dataclass(frozen=True)
class BatchCommit:
    """Outcome of committing one micro-batch: the new table version, or ``None`` if skipped."""

    batch_id: int
    version: int | None
    files: int
    rows: int
    skipped_reason: str | None = None
    #: merge mode: rows of the batch the table already held (not inserted again);
    #: upsert mode: rows superseded by a later version of their key in the same batch
    dropped: int = 0


def commit_batch(
    options: DeltaSinkOptions,
    messages: Iterable[DeltaCommitMessage | None],
    batch_id: int,
    tables: TableCache | None = None,
) -> BatchCommit:
    """Commit one micro-batch's files in one Delta transaction, at most once per app id; again from
    reading the table when sink maintenance changed it meanwhile (:func:`_again_after_maintenance`:
    each attempt starts with the app-transaction check, so a commit that landed is never repeated).
    ``tables``: the sink's table kept from its last batch (read forward, not loaded again)."""
    msgs = [m for m in messages if m is not None]
    where = f"{SHORT_NAME} {options.path} (app {options.app_id}, batch {batch_id})"
    tables = tables or TableCache(options.path)

    def attempt() -> BatchCommit:
        try:
            return _commit_batch_once(options, msgs, batch_id, where, tables)
        except BaseException:
            tables.forget()  # the next attempt or batch loads the table anew
            raise

    return _again_after_maintenance(attempt, where)


def _commit_batch_once(options: DeltaSinkOptions, msgs: list[DeltaCommitMessage], batch_id: int,
                       where: str, tables: TableCache, own: bool = True) -> BatchCommit:
    """One attempt of :func:`commit_batch`, on the table as it is now; ``own``: an append may write its
    commit file itself (:meth:`TableCache.append`), else it goes through delta-rs."""
    actions = [a for m in msgs for a in m.actions]
    offsets = ledger.union(*(m.offsets or {} for m in msgs))
    rows = sum(json.loads(a.stats)["numRecords"] for a in actions)
    # from the kept table without listing the log when it can (TableCache.kept: an append then writes
    # its commit itself, an upsert's merge moves the kept table), else the table read forward
    append = options.mode == "append" and own
    kept = tables.kept(options.app_id, appending=append) if append or options.mode == "upsert" else None
    if kept is None:
        table = tables.get()
        kept = tables.kept(options.app_id, appending=append) if append and table is not None else None
    if kept is not None:
        table, read, done = kept
    else:
        done = table.transaction_version(options.app_id) if table else None
        read = table.version() if table is not None else None
    if done is not None and done >= batch_id:
        if done > batch_id:
            _log.warning(
                "%s: the table already holds batch %d of this app id, so batch %d is skipped; "
                "if the step's checkpoint was reset, give the sink a new appId or restore the "
                "checkpoint, or its rows are never written",
                where,
                done,
                batch_id,
            )
        _clean_up(options, batch_id, offsets, where,
                  committed=_committing(pending_dir(options.path, options.app_id, batch_id)))
        return BatchCommit(batch_id, None, 0, 0, f"table already holds batch {done}")
    if not actions:
        remove_unreferenced_batch_files(options.path, options.app_id, batch_id, committed=())
        return BatchCommit(batch_id, None, 0, 0, "empty batch")
    schema = next(m.arrow_schema() for m in msgs if m.schema)
    check_not_null(table, actions, options.path, where)
    metadata = {ledger.OFFSETS_KEY: ledger.to_metadata(offsets) if offsets else "{}",
                **options.commit_metadata}
    metadata.update({"isb.appId": options.app_id, "isb.batchId": batch_id, "isb.rows": rows})
    fast = options.mode == "merge" and _ledger_says_all_new(options, table, offsets, rows)
    if fast:  # no row can be in the table: commit the files as they are (module docstring)
        metadata.update({"isb.operation": "merge_insert_missing", "isb.key": ledger.ID_COLUMN,
                         "isb.mergePath": "ledger-append"})
    elif options.mode in ("merge", "upsert"):  # the merge writes its own files: none of the batch's is kept
        commit, written = _commit_merge(options, actions, schema, metadata, rows, batch_id, where, table,
                                        tables if own else None)
        _clean_up(options, batch_id, offsets, where, committed=written)
        return commit
    _note_committing(options, batch_id, actions)
    if kept is not None and append:
        check_append(kept[0], schema, options.partition_by, where)
        version = tables.append(actions, metadata, options.app_id, batch_id, options.partition_by)
        if version is None:  # another writer (maintenance) took the version: again, through delta-rs
            tables.forget()
            return _commit_batch_once(options, msgs, batch_id, where, tables, own=False)
    else:
        _commit_files(options, table, actions, schema, metadata, batch_id, where)
        # the version: the commit file after the one the commit read, when it holds this batch's app
        # transaction; else the table read forward, or loaded when the batch created it
        version = tables.committed_version(read, options.app_id, batch_id)
    # Attempts that failed before this batch succeeded may have left files behind.
    _clean_up(options, batch_id, offsets, where, committed=[a.path for a in actions])
    return BatchCommit(batch_id, version, len(actions), rows)


def _commit_files(options: DeltaSinkOptions, table: DeltaTable | None, actions: list[AddAction],
                  schema: pa.Schema, metadata: dict, batch_id: int, where: str) -> None:
    """Commit the tasks' files as they are, with the app transaction; create the table if absent."""
    props = CommitProperties(
        custom_metadata=metadata,
        app_transactions=[Transaction(app_id=options.app_id, version=batch_id)],
    )
    if table is None:
        create_table_with_add_actions(
            options.path,
            DeltaSchema.from_arrow(schema),
            actions,
            mode="append",
            partition_by=list(options.partition_by) or None,
            configuration=TABLE_CONFIGURATION,  # only sink maintenance removes log files: it folds first
            commit_properties=props,
        )
        return
    check_append(table, schema, options.partition_by, where)
    table.create_write_transaction(
        actions,
        mode="append",
        schema=schema,
        partition_by=list(options.partition_by) or None,
        commit_properties=props,
    )



def _again_after_maintenance(commit, where: str):
    """``commit()``, called again (up to :data:`METADATA_RETRIES` times) when sink maintenance
    changed the table under it: a property change (setting the log retention: a metadata commit
    fails every concurrent commit with "Metadata changed"), or a trimmed log (the commits after the
    attempt's snapshot that the conflict check reads were folded and removed: "Invalid table
    version: N"; :mod:`isbflow.local.delta`). Neither failure wrote anything. A
    batch's append or merge does not depend on what maintenance changes; each attempt reads the
    table again, schema checks included."""
    for attempt in range(METADATA_RETRIES + 1):
        try:
            return commit()
        except DeltaError as e:
            changed = isinstance(e, CommitFailedError) and "Metadata changed" in str(e)
            if not (changed or log_file_vanished(e)) or attempt == METADATA_RETRIES:
                raise
            _log.info("%s: sink maintenance changed the table during the commit (%s); committing again",
                      where, e)
    raise AssertionError("unreachable")


def _commit_merge(options: DeltaSinkOptions, actions: list[AddAction], schema: pa.Schema, metadata: dict, rows: int,
                  batch_id: int, where: str, table: DeltaTable | None,
                  tables: TableCache | None) -> tuple[BatchCommit, list[str]]:
    """Merge or upsert mode: the batch's rows, read back on the driver, in one Delta merge (an upsert's into
    the kept ``table``, committed by the sink itself when ``tables`` and the table allow it,
    :mod:`isbflow.sinks.delta_upsert`); a merge-mode batch of more than :data:`MERGE_CHUNK_ROWS` rows in
    chunks. With the paths of the batch's files the commit holds (a merge through delta-rs: none)."""
    if options.mode == "merge" and not options.version_column and rows > MERGE_CHUNK_ROWS:
        return _commit_merge_chunks(options, actions, schema, metadata, rows, batch_id), []
    batch = read_batch_files(options, actions, schema)
    superseded, paths = 0, []
    if options.version_column:
        batch, superseded = latest_per_key(batch, options.merge_key, options.version_column,
                                           where=where)
    if options.mode == "upsert":
        def note(adds: list[AddAction]) -> None:
            paths[:] = [a.path for a in adds]
            _note_committing(options, batch_id, adds)

        own = tables is not None and table is not None
        up = own_upsert(options, tables, table, batch, batch_id, metadata, note) if own else None
        if up is None:  # through delta-rs, on the table read forward when another writer took the version
            if own and (paths or tables.ahead()):  # (the sink's noted files are not the table's) or the
                paths.clear()                      # sink's own commits are ahead of the kept table
                table = tables.get()
            up = merge_upsert(options.path, batch, key=options.merge_key, app_id=options.app_id, version=batch_id,
                              metadata=metadata, partition_by=options.partition_by, delta=table)
        written, version = up.updated + up.inserted, up.version
    else:
        merged = merge_insert_missing(options.path, batch, key=options.merge_key, app_id=options.app_id,
                                      version=batch_id, metadata=metadata, partition_by=options.partition_by)
        written, version = merged.inserted, merged.version
    dropped = superseded if options.mode == "upsert" else rows - written
    return BatchCommit(batch_id, version, 0, written, dropped=dropped), paths


def _ledger_says_all_new(options: DeltaSinkOptions, table: DeltaTable | None, offsets: dict, rows: int) -> bool:
    """Merge mode, key ``_isb_id``: the batch's rows name ``rows`` distinct source offsets, none of
    which the table's commits record: none of them can be in the table."""
    if options.merge_key != (ledger.ID_COLUMN,) or options.version_column or table is None or not rows:
        return False
    if sum(ledger.count(r) for r in offsets.values()) != rows:  # ids that are no offsets, or repeated
        return False
    held = ledger.history_offsets(table_history(table))
    return not any(ledger.overlaps(ranges, held.get(part) or []) for part, ranges in offsets.items())


def _commit_merge_chunks(options: DeltaSinkOptions, actions: list[AddAction], schema: pa.Schema,
                         metadata: dict, rows: int, batch_id: int) -> BatchCommit:
    """Merge mode, a batch of more than :data:`MERGE_CHUNK_ROWS` rows: its files read back in chunks of
    that many rows, each merged in a commit of its own that records the offsets of its rows
    (``isb.offsets``: a committed row's offset stays in its commit's ranges, which the ledger fast path
    relies on); the last chunk's commit records the app transaction and the whole batch's offsets. A
    merge inserts only keys the table lacks, so a batch run again after a crash between two chunks
    inserts nothing the first attempt committed. ``isb.rows`` of each commit is its chunk's rows."""
    inserted, version, chunks = 0, None, batch_chunks(options, actions, schema, MERGE_CHUNK_ROWS)
    chunk = next(chunks)
    for n, following in enumerate(_and_next(chunks)):
        last = following is None
        meta = {**metadata, "isb.rows": chunk.num_rows, "isb.chunk": n}
        if not last and ledger.ID_COLUMN in chunk.column_names:
            meta[ledger.OFFSETS_KEY] = ledger.to_metadata(ledger.id_ranges(chunk.column(ledger.ID_COLUMN)))
        merged = merge_insert_missing(options.path, chunk, key=options.merge_key,
                                      app_id=options.app_id if last else None, version=batch_id if last else None,
                                      metadata=meta, partition_by=options.partition_by)
        inserted, version = inserted + merged.inserted, merged.version
        chunk = following
    return BatchCommit(batch_id, version, 0, inserted, dropped=rows - inserted)


def _and_next(it: Iterator[pa.Table]) -> Iterator[pa.Table | None]:
    """The items of ``it`` after the first one taken already, then ``None``: each step of a loop
    knows whether the item it holds is the last."""
    yield from it
    yield None


def _clean_up(options: DeltaSinkOptions, batch_id: int, offsets: dict, where: str,
              committed: Iterable[str] | None = None) -> None:
    """After the batch is in the table: remove its unreferenced files, record its offsets."""
    remove_unreferenced_batch_files(options.path, options.app_id, batch_id, committed)
    _record_offsets(options, offsets, where)


def _record_offsets(options: DeltaSinkOptions, offsets: dict, where: str) -> None:
    """Add the batch's source offsets to the ledger KV (after the Delta commit; see module doc).

    A transient failure (the ISB service unreachable) is logged, not raised: the
    table's ``isb.offsets`` still hold the offsets, and a ledger behind the table
    only makes recovery replay more. An entry that can no longer fit
    (:class:`~isbflow.isb.errors.LedgerFull`) fails the step: retrying cannot help,
    and the ledger would silently stop advancing for good.
    """
    if not offsets or not options.ledger_settings:
        return
    try:
        ledger.record_sync(settings_from_json(options.ledger_settings), options.ledger_pipeline,
                           options.ledger_sink, offsets)
    except LedgerFull:
        raise
    except Exception as e:  # noqa: BLE001 - see docstring
        _log.warning("%s: recording offsets in the ledger failed (%s); the commit's isb.offsets "
                     "still hold them", where, e)


class DeltaStreamWriter(DataSourceStreamArrowWriter):
    """The ``isb-delta`` stream writer; see the module docstring for the protocol.

    Created and pickled on the driver; holds only the validated options.
    """

    def __init__(self, options: DeltaSinkOptions, schema: StructType):
        self.options = options
        self.schema = schema

    def write(self, iterator: Iterator[pa.RecordBatch]) -> DeltaCommitMessage:
        """Executor task: write this task's rows as Parquet files, return their add actions."""
        ctx = TaskContext.get()
        batch_id = ctx.getLocalProperty("streaming.sql.batchId") if ctx else None
        if batch_id is None:
            raise DeltaSinkError(
                f"{SHORT_NAME} {self.options.path}: no streaming batch id in the task; "
                "isb-delta is a streaming sink (writeStream.format('isb-delta'))"
            )
        return write_batch_files(self.options, iterator, int(batch_id), ctx.partitionId())

    def commit(self, messages: list[DeltaCommitMessage | None], batchId: int) -> None:
        """Driver, once per micro-batch after all tasks succeeded: one Delta commit."""
        commit_batch(self.options, messages, batchId)

    def abort(self, messages: list[DeltaCommitMessage | None], batchId: int) -> None:
        """Driver, when a task failed: remove this batch's files the log does not reference."""
        remove_unreferenced_batch_files(self.options.path, self.options.app_id, batchId)


class DeltaSinkDataSource(DataSource):
    """``df.writeStream.format("isb-delta").option("appId", ...).start("/abs/table")``.

    Register once per session: ``spark.dataSource.register(DeltaSinkDataSource)``.
    """

    @classmethod
    def name(cls) -> str:
        return SHORT_NAME

    def streamWriter(self, schema: StructType, overwrite: bool) -> DeltaStreamWriter:
        if overwrite:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME}: output mode complete/overwrite is not supported; use append"
            )
        options = DeltaSinkOptions.from_options(self.options)
        if schema is not None:  # None: a writer driven directly (tests), with no stream to check
            check_columns(options, schema.fieldNames())
        return DeltaStreamWriter(options, schema)


def check_columns(options: DeltaSinkOptions, columns: list[str]) -> None:
    """:class:`DeltaSinkOptionError` unless the columns the options name (partitionBy, and
    mergeKey and versionColumn in merge/upsert mode) are among the stream's ``columns``."""
    checked = [("partitionBy", list(options.partition_by))]
    if options.mode != "append":
        checked.append(("mergeKey", list(options.merge_key)))
    if options.version_column:
        checked.append(("versionColumn", [options.version_column]))
    for option, names in checked:
        missing = [c for c in names if c not in columns]
        if missing:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {options.path}: {option} columns {missing} are not in the "
                f"stream's columns {list(columns)}"
            )
