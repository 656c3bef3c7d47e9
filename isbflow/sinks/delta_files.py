"""Delta sink, executor side: the options, and a task's rows written as Parquet files.

Runs in Spark executor tasks (the options are also validated once on the
driver). :func:`write_batch_files` writes one task's rows straight into the
table folder, one file per partition value (Hive-style ``col=value/``
folders), named by :func:`batch_file_name`, and returns a
:class:`DeltaCommitMessage`: the files' Delta add actions (stats from the
Parquet footers, :func:`file_stats`), the rows' Arrow schema and, when the
rows carry ``_isb_id``, the source offsets they hold. Nothing is visible to
readers until the driver commits (:mod:`isbflow.sinks.delta_commit`).

**The batch's own files, found without walking the table.** Before a task
creates a file it leaves a marker naming it in the batch's pending folder,
``<table>/_isb_pending/<appTag>-<batchId>/`` (:func:`note_pending`; Delta
readers and VACUUM skip folders starting with ``_``). The driver's commit and
clean-up read only that folder (:func:`pending_files`), so the work per
commit is bounded by the batch's files, not the table's; a failed task
attempt's files are found the same way, even though its commit message never
reached the driver.

Picklable: :class:`DeltaSinkOptions` travels from the driver to the tasks
inside the stream writer; :class:`DeltaCommitMessage` travels back. Both hold
plain data only (add actions, bytes, dicts). No Delta log is read or written
here, and nothing here talks to NATS.

Also the sink's errors and naming, which every layer of the sink shares.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from typing import Any
from urllib.parse import quote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake.transaction import AddAction
from pyspark.sql.datasource import WriterCommitMessage

from isbflow.isb import ledger
from isbflow.sinks.delta_stats import file_stats, nan_columns

SHORT_NAME = "isb-delta"
NULL_PARTITION = "__HIVE_DEFAULT_PARTITION__"
DEFAULT_ROW_GROUP_ROWS = 512 * 1024
#: ``mode`` option values: plain commit of the tasks' files, insert-if-absent, replace-or-insert
MODES = ("append", "merge", "upsert")
#: A plain column name (what ``mergeKey``, ``versionColumn`` and merge keys accept).
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: the folder of the pending markers (module docstring), under the table folder
PENDING_DIR = "_isb_pending"
#: in a batch's pending folder: the files the driver is about to commit (written before the commit)
COMMITTING_FILE = "COMMITTING"
_MARKER_SUFFIX = ".pending"
_FILE_RE = re.compile(r"^part-(\d+)-(\d+)-([0-9a-f]{8})-([0-9a-f]{32})\.parquet$")


class DeltaSinkError(Exception):
    """A Delta sink cannot write or commit; the message says where and what to do."""


class DeltaSinkOptionError(DeltaSinkError):
    """An ``isb-delta`` option is missing or invalid."""


class DeltaSchemaMismatch(DeltaSinkError):
    """The rows written do not have the existing table's columns and types."""


def sink_app_id(pipeline: str, step: str, sink: str) -> str:
    """The app id a step's sink commits under: ``<pipeline>/<step>/<sink>``."""
    return f"{pipeline}/{step}/{sink}"


def _app_tag(app_id: str) -> str:
    return hashlib.sha1(app_id.encode()).hexdigest()[:8]


def batch_file_name(app_id: str, batch_id: int, task_partition: int) -> str:
    """A new file's name: ``part-<batchId>-<taskPartition>-<appTag>-<uuid>.parquet``."""
    return f"part-{batch_id}-{task_partition}-{_app_tag(app_id)}-{uuid.uuid4().hex}.parquet"


def is_batch_file(name: str, app_id: str, batch_id: int) -> bool:
    """Whether ``name`` is a file :func:`batch_file_name` made for this app id and batch."""
    m = _FILE_RE.match(name)
    return bool(m) and int(m.group(1)) == batch_id and m.group(3) == _app_tag(app_id)


def pending_dir(root: str, app_id: str, batch_id: int) -> str:
    """The pending folder of one app id's batch: ``<root>/_isb_pending/<appTag>-<batchId>``."""
    return os.path.join(root, PENDING_DIR, f"{_app_tag(app_id)}-{batch_id}")


def note_pending(root: str, app_id: str, batch_id: int, rel_path: str) -> None:
    """Executor, before creating ``rel_path``: leave a marker naming it in the batch's pending folder."""
    folder = pending_dir(root, app_id, batch_id)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, os.path.basename(rel_path) + _MARKER_SUFFIX), "w") as f:
        f.write(rel_path)


def pending_files(root: str, app_id: str, batch_id: int) -> list[str]:
    """The table-relative paths of every file a task of this app's batch created (any attempt),
    from the markers of :func:`note_pending`: one folder listing, whatever the table's size."""
    folder = pending_dir(root, app_id, batch_id)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    out = []
    for name in sorted(names):
        if not name.endswith(_MARKER_SUFFIX) or not is_batch_file(name[: -len(_MARKER_SUFFIX)], app_id, batch_id):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                rel = f.read().strip()
        except FileNotFoundError:
            continue
        if rel and os.path.basename(rel) == name[: -len(_MARKER_SUFFIX)] and not os.path.isabs(rel) \
                and ".." not in rel.split("/"):
            out.append(rel)
    return out


def remove_file(path: str) -> None:
    """Remove ``path``; a file already gone is fine."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class DeltaSinkOptions:
    """The ``isb-delta`` options, validated once on the driver.

    ``path`` (absolute table folder; ``.start(path)`` sets it), ``appId``
    (``<pipeline>/<step>/<sink>``, see :func:`sink_app_id`), ``partitionBy``
    (comma list), ``commitMetadata`` (JSON object merged into each commit's
    custom metadata; its ``isb.offsets`` is kept as given, default ``"{}"``),
    ``rowGroupRows`` (Parquet row group size, default 524288), ``mode``
    (``append`` default; ``merge``: insert if ``mergeKey`` is absent; ``upsert``:
    replace or insert on ``mergeKey``), ``mergeKey`` (default ``_isb_id``),
    ``versionColumn`` (merge/upsert: latest version of a key wins within a batch;
    not written), and for the offset ledger ``pipeline``, ``sink`` and
    ``settings`` (NatsSettings JSON; all three or none).
    """

    path: str
    app_id: str
    partition_by: tuple[str, ...] = ()
    commit_metadata: Mapping[str, Any] = field(default_factory=dict)
    row_group_rows: int = DEFAULT_ROW_GROUP_ROWS
    mode: str = "append"
    merge_key: tuple[str, ...] = ("_isb_id",)
    ledger_pipeline: str | None = None
    ledger_sink: str | None = None
    ledger_settings: str | None = None
    version_column: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> DeltaSinkOptions:
        path = (options.get("path") or "").strip()
        if path.startswith("file://"):
            path = path[len("file://") :]
        if not path or not os.path.isabs(path):
            raise DeltaSinkOptionError(
                f"{SHORT_NAME}: option path must be an absolute table folder that the driver "
                f"and all executors can reach, got {path!r}; pass .option('path', '/abs/table') "
                "or .start('/abs/table')"
            )
        app_id = (options.get("appId") or "").strip()
        if not app_id:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option appId is required (use "
                "'<pipeline>/<step>/<sink>'); it makes replayed micro-batches commit only once"
            )
        partition_by = tuple(
            c.strip() for c in (options.get("partitionBy") or "").split(",") if c.strip()
        )
        raw_meta = options.get("commitMetadata") or "{}"
        try:
            meta = json.loads(raw_meta, parse_constant=_refuse_constant)
        except (json.JSONDecodeError, ValueError) as e:
            meta = e
        if not isinstance(meta, dict):
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option commitMetadata must be a JSON object of finite "
                f"numbers, strings and the like (strict JSON: no NaN or Infinity), got {raw_meta!r}"
            )
        try:
            row_group_rows = int(options.get("rowGroupRows") or DEFAULT_ROW_GROUP_ROWS)
        except ValueError:
            row_group_rows = 0
        if row_group_rows <= 0:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option rowGroupRows must be a positive integer, "
                f"got {options.get('rowGroupRows')!r}"
            )
        mode = (options.get("mode") or "append").strip().lower()
        if mode not in MODES:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option mode must be one of {', '.join(MODES)}, got {mode!r}"
            )
        merge_key = tuple(
            c.strip() for c in (options.get("mergeKey") or "_isb_id").split(",") if c.strip()
        )
        bad = [c for c in merge_key if not IDENTIFIER.match(c)]
        if bad or not merge_key:
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option mergeKey must be plain column names, got "
                f"{options.get('mergeKey')!r}"
            )
        ledger_options = [(options.get(k) or "").strip() or None for k in ("pipeline", "sink", "settings")]
        if any(ledger_options) and not all(ledger_options):
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: the offset ledger needs all of the options pipeline, "
                "sink and settings (NatsSettings JSON), or none of them"
            )
        version_column = (options.get("versionColumn") or "").strip() or None
        if version_column is not None and (mode == "append" or not IDENTIFIER.match(version_column)
                                           or version_column in merge_key):
            raise DeltaSinkOptionError(
                f"{SHORT_NAME} at {path}: option versionColumn must be a plain column name outside "
                f"mergeKey, with mode merge or upsert; got {version_column!r} with mode {mode!r}"
            )
        return cls(os.path.normpath(path), app_id, partition_by, meta, row_group_rows, mode,
                   merge_key, *ledger_options, version_column=version_column)


# --------------------------------------------------------------------------- task output


@dataclass
class DeltaCommitMessage(WriterCommitMessage):
    """What one task wrote: add actions plus the Arrow schema of its rows (IPC bytes)."""

    actions: list[AddAction]
    schema: bytes | None
    #: source partition -> ranges of source sequences in the rows (from ``_isb_id``)
    offsets: dict[str, list[list[int]]] | None = None

    def arrow_schema(self) -> pa.Schema | None:
        return pa.ipc.read_schema(pa.py_buffer(self.schema)) if self.schema else None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _partition_string(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, datetime):
        if value.tzinfo is None:  # timestamp_ntz: the protocol's "{date} {time}"
            return value.isoformat(sep=" ")
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")  # ISO-8601 in UTC
    if isinstance(value, date):
        return value.isoformat()
    return str(value)


def partition_dir(partition_by: tuple[str, ...], values: Mapping[str, str | None]) -> str:
    """The Hive-style folder of one partition value, ``col=value/...`` (values URI-escaped)."""
    parts = []
    for c in partition_by:
        v = values[c]
        parts.append(f"{c}={NULL_PARTITION if v is None else quote(v, safe='')}")
    return "/".join(parts)


def _split_by_partition(
    batch: pa.RecordBatch, partition_by: tuple[str, ...]
) -> Iterator[tuple[dict[str, str | None], pa.Table]]:
    """Yield (partition values, rows without the partition columns) per distinct value."""
    table = pa.Table.from_batches([batch])
    if not partition_by:
        yield {}, table
        return
    combos = table.select(list(partition_by)).group_by(list(partition_by), use_threads=False)
    for combo in combos.aggregate([]).to_pylist():
        mask = None
        for c in partition_by:
            v = combo[c]
            m = (
                pc.is_null(table[c])
                if v is None
                else pc.equal(table[c], pa.scalar(v, table.schema.field(c).type))
            )
            mask = m if mask is None else pc.and_(mask, m)
        rows = table.filter(mask).drop_columns(list(partition_by))
        yield {c: _partition_string(combo[c]) for c in partition_by}, rows


class _PartitionFile:
    """One open Parquet file for one partition value, buffering rows into row groups."""

    def __init__(
        self,
        root: str,
        rel_path: str,
        values: dict[str, str | None],
        schema: pa.Schema,
        row_group_rows: int,
    ):
        self.rel_path, self.values, self.row_group_rows = rel_path, values, row_group_rows
        self.abs_path = os.path.join(root, rel_path)
        os.makedirs(os.path.dirname(self.abs_path), exist_ok=True)
        self.schema = schema
        self.collector: list[pq.FileMetaData] = []
        self.writer = pq.ParquetWriter(self.abs_path, schema, metadata_collector=self.collector)
        self.buffer: list[pa.Table] = []
        self.buffered = 0
        self.nans: set[str] = set()

    def add(self, rows: pa.Table) -> None:
        self.buffer.append(rows)
        self.nans |= nan_columns(rows)
        self.buffered += rows.num_rows
        if self.buffered >= self.row_group_rows:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            self.writer.write_table(
                pa.concat_tables(self.buffer), row_group_size=self.row_group_rows
            )
            self.buffer, self.buffered = [], 0

    def close(self) -> AddAction:
        self.flush()
        self.writer.close()
        st = os.stat(self.abs_path)
        return AddAction(
            path=self.rel_path,  # a plain relative path: delta-rs URI-encodes it in the log
            size=st.st_size,
            partition_values=self.values,
            modification_time=int(st.st_mtime * 1000),
            data_change=True,
            stats=file_stats(self.collector[0], self.schema, self.nans),
        )

    def discard(self) -> None:
        try:
            self.writer.close()
        finally:
            remove_file(self.abs_path)


def delta_arrow_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with zoned timestamps in UTC, the only zone Delta accepts.

    Spark hands over timestamps in the session zone (e.g. ``Etc/UTC``); the
    instants are the same, only the label changes, so the cast copies nothing.
    """
    fields = [
        f.with_type(pa.timestamp(f.type.unit, tz="UTC"))
        if pa.types.is_timestamp(f.type) and f.type.tz not in (None, "UTC")
        else f
        for f in schema
    ]
    return pa.schema(fields, metadata=schema.metadata)


def write_batch_files(
    options: DeltaSinkOptions,
    batches: Iterable[pa.RecordBatch],
    batch_id: int,
    task_partition: int,
) -> DeltaCommitMessage:
    """Write one task's rows as Parquet files under the table folder; return their add actions.

    One file per partition value, rows buffered into ``row_group_rows`` row
    groups. On error the files written so far are removed before re-raising.
    """
    files: dict[tuple, _PartitionFile] = {}
    schema: pa.Schema | None = None
    offsets: list[dict] = []
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if schema is None:
                schema = delta_arrow_schema(batch.schema)
            if batch.schema != schema:
                batch = batch.cast(schema)
            if ledger.ID_COLUMN in batch.schema.names:
                offsets.append(ledger.id_ranges(batch.column(ledger.ID_COLUMN)))
            for values, rows in _split_by_partition(batch, options.partition_by):
                key = tuple(values.items())
                pf = files.get(key)
                if pf is None:
                    name = batch_file_name(options.app_id, batch_id, task_partition)
                    folder = partition_dir(options.partition_by, values)
                    rel = f"{folder}/{name}" if folder else name
                    note_pending(options.path, options.app_id, batch_id, rel)
                    pf = files[key] = _PartitionFile(
                        options.path, rel, values, rows.schema, options.row_group_rows
                    )
                pf.add(rows)
        actions = [pf.close() for pf in files.values()]
    except BaseException:
        for pf in files.values():
            pf.discard()
        raise
    return DeltaCommitMessage(actions, schema.serialize().to_pybytes() if schema else None,
                              ledger.union(*offsets) if offsets else None)
