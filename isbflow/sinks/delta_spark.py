"""Delta sink through Spark's own Parquet writer: a ``foreachBatch`` function, one Delta commit per batch.

What a step's Delta sink runs (:class:`DeltaBatchWriter`, wired by
:mod:`isbflow.steps.delta_sink`): ``df.writeStream.foreachBatch(DeltaBatchWriter(options))``.
Per micro-batch, on the driver:

1. **Write** (executors, JVM only): ``batch_df.write.parquet(<staging>)`` with
   ``partitionBy`` as the sink's, timestamps as ``TIMESTAMP_MICROS`` (Spark's
   default INT96 is not what Delta readers expect). No row passes through
   Python. ``<staging>`` is ``<table>/_isb_pending/<appTag>-<batchId>/spark-<uuid>/``,
   inside the batch's pending folder (:func:`isbflow.sinks.delta_files.pending_dir`).
   Spark's commit protocol (``_temporary``, task attempts, ``_SUCCESS``, ``.crc``
   files) runs entirely in there: a failed or retried task attempt never
   reaches the table.
2. **Adopt** (driver, :func:`adopt_staged_files`): each Parquet file of the
   staging folder (one ``os.walk`` of the batch's own staging folder, never of
   the table) is moved (a rename, same filesystem) to where the Python writer
   puts its files, ``<table>/<col=value/...>/part-<batchId>-<task>-<appTag>-<uuid>.parquet``,
   after a marker naming it in the batch's pending folder
   (:func:`isbflow.sinks.delta_files.note_pending`); its add action takes the
   size, the partition values (from Spark's Hive folder) and the stats from the
   Parquet footer (:func:`isbflow.sinks.delta_files.file_stats`). Files with no
   rows are left in staging.
3. **Offsets** (:func:`batch_offsets`): when the rows carry ``_isb_id``, the
   driver reads that column of the adopted files (local Parquet, not the source
   again) and computes the ranges of source sequences they hold
   (:func:`isbflow.isb.ledger.id_ranges`, pyarrow): measured 7-18x cheaper than
   a Spark job computing the same in the JVM.
4. **Commit** (:func:`isbflow.sinks.delta_commit.commit_batch`, on the table the last batch's
   commit left, read forward: :class:`isbflow.local.delta.TableCache`):
   the app-transaction check (a batch the table already holds commits nothing
   and its files are removed), one Delta transaction with ``isb.offsets``, the
   ledger update, ``merge``/``upsert`` modes, the clean-up of the batch's
   unreferenced files and of its pending folder, staging included.

If step 1 to 3 fail, the batch's files the log does not reference are removed
(the Python writer's ``abort``) and the error propagates: Spark fails the
query, and the re-run of the batch starts clean. A crash anywhere leaves at
most the batch's pending folder and adopted files; the batch's next run (Spark
replays it from the checkpoint) removes them, whether its commit landed or not.

**Why the layout is safe for readers and VACUUM.** Readers see a file only
through the Delta log, and a file enters the log only in step 4, already at its
final place. The data files sit where any Delta writer puts them (Hive folders
under the table), so VACUUM (delta-rs or Delta Spark) finds and removes them
once a later commit (compaction) drops them from the log. Everything else the
write leaves (staging, ``_SUCCESS``, ``.crc``, ``_temporary``, markers) lives
under ``_isb_pending``, which Delta readers and VACUUM skip (a folder starting
with ``_``) and the commit removes per batch.

Partition values are Spark's folder strings (unescaped): exact for string,
integer, boolean and date columns; a timestamp column is rendered in the
session time zone (isbflow's sessions use UTC). ``rowGroupRows`` applies to the
Python writer only (Spark's Parquet writer sizes row groups by bytes).
"""

from __future__ import annotations

import logging
import os
import re
import time
import uuid
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.transaction import AddAction
from pyspark.sql.pandas.types import to_arrow_schema

from isbflow.isb import ledger
from isbflow.local.delta import TableCache
from isbflow.sinks.delta_commit import (
    BatchCommit,
    check_columns,
    commit_batch,
    remove_unreferenced_batch_files,
)
from isbflow.sinks.delta_files import (
    NULL_PARTITION,
    SHORT_NAME,
    DeltaCommitMessage,
    DeltaSinkError,
    DeltaSinkOptions,
    batch_file_name,
    delta_arrow_schema,
    note_pending,
    partition_dir,
    pending_dir,
)
from isbflow.sinks.delta_merge import open_table
from isbflow.sinks.delta_stats import file_stats, nan_columns

_log = logging.getLogger(__name__)

#: prefix of an attempt's staging folder inside the batch's pending folder
STAGING_PREFIX = "spark-"
_SPARK_FILE = re.compile(r"^part-(\d+)-.*\.parquet$")


class DeltaBatchWriter:
    """``foreachBatch`` function of a Delta sink: Spark writes the Parquet, the driver commits once.

    Called on the driver once per micro-batch with ``(batch_df, batch_id)``
    (the module docstring gives the steps). Holds only the validated options;
    any wrapper taking a ``(df, batch_id)`` callable can wrap it.
    """

    def __init__(self, options: DeltaSinkOptions):
        self.options = options
        #: the table as the last batch's commit left it (read forward for the next)
        self.tables = TableCache(options.path)
        #: seconds spent per step (write, adopt, offsets, commit), summed over the batches: what bounds the sink
        self.seconds: dict[str, float] = dict.fromkeys(("write", "adopt", "offsets", "commit"), 0.0)

    def _timed(self, step: str, started: float) -> float:
        now = time.perf_counter()
        self.seconds[step] += now - started
        return now

    def check(self, columns: list[str]) -> None:
        """:class:`~isbflow.sinks.delta_files.DeltaSinkOptionError` unless the sink's columns
        (partitionBy, mergeKey, versionColumn) are among ``columns``."""
        check_columns(self.options, columns)

    def __call__(self, df, batch_id: int) -> BatchCommit:
        opts = self.options
        self.check(df.columns)
        schema = delta_arrow_schema(to_arrow_schema(df.schema, timezone="UTC"))
        staging = os.path.join(pending_dir(opts.path, opts.app_id, batch_id),
                               f"{STAGING_PREFIX}{uuid.uuid4().hex}")
        t = time.perf_counter()
        try:
            write_staged(df, staging, opts.partition_by)
            t = self._timed("write", t)
            actions = adopt_staged_files(opts, staging, batch_id, schema)
            t = self._timed("adopt", t)
            offsets = None
            if actions and ledger.ID_COLUMN in df.columns and ledger.ID_COLUMN not in opts.partition_by:
                offsets = batch_offsets([os.path.join(opts.path, a.path) for a in actions])
            t = self._timed("offsets", t)
        except BaseException:
            remove_unreferenced_batch_files(opts.path, opts.app_id, batch_id)
            raise
        done = self.commit(DeltaCommitMessage(actions, schema.serialize().to_pybytes(), offsets), batch_id)
        self._timed("commit", t)
        return done

    def holds(self, batch_id: int) -> bool:
        """Whether the table holds batch ``batch_id`` of this app id (its transaction is in the log):
        an attempt may have committed and failed after its commit. False when the table cannot be read."""
        try:
            table = open_table(self.options.path)
            done = table.transaction_version(self.options.app_id) if table else None
        except Exception as e:  # noqa: BLE001 - the storage that failed the batch may fail this too
            _log.info("sink %s: cannot tell whether it holds batch %d (%s)", self.options.path, batch_id,
                      str(e).splitlines()[0] if str(e) else repr(e))
            return False
        return done is not None and done >= batch_id

    def commit(self, message: DeltaCommitMessage, batch_id: int) -> BatchCommit:
        """Driver: the batch's one Delta commit (:func:`isbflow.sinks.delta_commit.commit_batch`).
        Not guarded like the write: a failure here may follow a landed commit, and the batch's re-run
        sorts out which files the log holds."""
        return commit_batch(self.options, [message], batch_id, self.tables)


def write_staged(df, staging: str, partition_by: tuple[str, ...]) -> None:
    """Executors: ``df`` as Parquet files (Hive folders for ``partition_by``) under ``staging``."""
    # Spark reads the timestamp type from the session, not from a write option
    df.sparkSession.conf.set("spark.sql.parquet.outputTimestampType", "TIMESTAMP_MICROS")
    writer = df.write.mode("error")
    if partition_by:
        writer = writer.partitionBy(*partition_by)
    writer.parquet(staging)


def _partition_values(rel_dir: str, partition_by: tuple[str, ...], where: str) -> dict[str, str | None]:
    parts = [] if rel_dir in ("", ".") else rel_dir.split(os.sep)
    values: dict[str, str | None] = {}
    for part in parts:
        name, eq, raw = part.partition("=")
        values[unquote(name)] = None if not eq or raw == NULL_PARTITION else unquote(raw)
    if list(values) != list(partition_by):
        raise DeltaSinkError(f"{where}: Spark wrote a file under {rel_dir!r}, not under the partition "
                             f"columns {list(partition_by)}")
    return values


def adopt_staged_files(options: DeltaSinkOptions, staging: str, batch_id: int,
                       schema: pa.Schema) -> list[AddAction]:
    """Driver: move the Parquet files Spark wrote under ``staging`` into the table folder (each
    noted in the batch's pending folder first); return their add actions. Files with no rows stay."""
    where = f"{SHORT_NAME} {options.path} (app {options.app_id}, batch {batch_id})"
    actions = []
    for folder, dirs, files in os.walk(staging):
        dirs[:] = sorted(d for d in dirs if "=" in d)  # partition folders; not _temporary
        found = [(m, n) for n in sorted(files) if (m := _SPARK_FILE.match(n))]
        if not found:
            continue
        values = _partition_values(os.path.relpath(folder, staging), options.partition_by, where)
        target = partition_dir(options.partition_by, values)
        for m, name in found:
            src = os.path.join(folder, name)
            metadata = pq.read_metadata(src)
            if metadata.num_rows == 0:
                continue
            file_name = batch_file_name(options.app_id, batch_id, int(m.group(1)))
            rel = f"{target}/{file_name}" if target else file_name
            note_pending(options.path, options.app_id, batch_id, rel)
            dst = os.path.join(options.path, rel)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.replace(src, dst)
            st = os.stat(dst)
            actions.append(AddAction(path=rel, size=st.st_size, partition_values=values,
                                     modification_time=int(st.st_mtime * 1000), data_change=True,
                                     stats=file_stats(metadata, schema, nan_columns(dst))))
    return actions


def batch_offsets(files: list[str]) -> ledger.PartitionRanges:
    """Per source partition, the ranges of sequences in the ``_isb_id`` column of ``files``.

    The driver reads that one column of the batch's files (local Parquet, never the
    source again) and hands it to :func:`isbflow.isb.ledger.id_ranges` (pyarrow and
    numpy, no Python loop per row). Measured against a Spark job doing the same
    in the JVM (per partition min, max and distinct count, one shuffle): on 1M ids
    in 4 partitions the Spark job took 16.6-18.7 s and this 0.9-2.5 s on the same
    loaded machine (load average 20), a Spark job's fixed cost dominating.
    """
    if not files:
        return {}
    ids = pa.chunked_array([c for f in files for c in pq.read_table(f, columns=[ledger.ID_COLUMN])
                            .column(ledger.ID_COLUMN).chunks], pa.string())
    return ledger.id_ranges(ids)
