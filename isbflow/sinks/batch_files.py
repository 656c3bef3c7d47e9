"""A micro-batch's files on the driver before their commit: read back (the rows of a Delta sink's merge
and upsert modes, :mod:`isbflow.sinks.delta_commit`, at once or in chunks of a bounded size), and the
files a commit is about to hold named in the batch's pending folder (:func:`note_committing`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake.transaction import AddAction

from isbflow.sinks.delta_files import COMMITTING_FILE, DeltaSinkOptions, pending_dir


def _file_rows(options: DeltaSinkOptions, a: AddAction, t: pa.Table, schema: pa.Schema) -> pa.Table:
    """Rows of file ``a``, its partition columns restored from their values, in the batch's schema."""
    for c in options.partition_by:
        typ = schema.field(c).type
        value = a.partition_values.get(c)
        col = pa.array([value] * t.num_rows, pa.string())
        t = t.append_column(c, col.cast(typ) if value is not None else pa.nulls(t.num_rows, typ))
    return t.select(schema.names).cast(schema)


def read_batch_files(options: DeltaSinkOptions, actions: list[AddAction],
                     schema: pa.Schema) -> pa.Table:
    """The rows of a batch's (uncommitted) files, partition columns restored from their values."""
    return pa.concat_tables([_file_rows(options, a, pq.read_table(os.path.join(options.path, a.path)), schema)
                             for a in actions])


def batch_chunks(options: DeltaSinkOptions, actions: list[AddAction], schema: pa.Schema,
                 size: int) -> Iterator[pa.Table]:
    """The rows of a batch's files in tables of ``size`` rows (the last fewer), read a record batch at
    a time: never more than one chunk and one record batch in memory."""
    held: list[pa.Table] = []
    count = 0
    for a in actions:
        for rb in pq.ParquetFile(os.path.join(options.path, a.path)).iter_batches(batch_size=min(size, 65_536)):
            t = _file_rows(options, a, pa.Table.from_batches([rb]), schema)
            while t.num_rows:
                take = t.slice(0, size - count)
                held.append(take)
                count += take.num_rows
                t = t.slice(take.num_rows)
                if count == size:
                    yield pa.concat_tables(held)
                    held, count = [], 0
    if held:
        yield pa.concat_tables(held)


def committing(folder: str) -> list[str]:
    """The paths the ``COMMITTING`` list of a pending folder names (``[]`` when there is none)."""
    try:
        with open(os.path.join(folder, COMMITTING_FILE)) as f:
            return [line for line in f.read().splitlines() if line]
    except FileNotFoundError:
        return []


def note_committing(options: DeltaSinkOptions, batch_id: int, actions: list[AddAction]) -> None:
    """Before committing the tasks' files: name them in the pending folder (atomically), so a
    replay after a crash between the commit and the clean-up knows which files the log holds."""
    folder = pending_dir(options.path, options.app_id, batch_id)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{COMMITTING_FILE}.{os.getpid()}")
    with open(tmp, "w") as f:
        f.write("".join(f"{a.path}\n" for a in actions))
    os.replace(tmp, os.path.join(folder, COMMITTING_FILE))
