"""Hostile frames for the reading side's tests (:func:`isbflow.isb.frames.read_frame`), made by
rewriting what a writer makes: each is small, and what it claims is what makes it dangerous."""

from __future__ import annotations

import struct

import pyarrow as pa

from isbflow.isb import frames


def null_column_bomb(rows: int = 200_000_000, names: tuple[str, ...] = ("id",)) -> bytes:
    """A frame of null-typed columns ``names`` claiming ``rows`` records: 224 bytes for one column, no
    buffer to back them (casting it to the step's types allocates them all)."""
    return frames.encode(pa.RecordBatch.from_arrays([pa.nulls(rows) for _ in names], names=list(names)))


def short_buffers(table: pa.Table | None = None, claim: int = 1000) -> bytes:
    """The frame of ``table`` (default: int64 ``id`` 0..9) whose record batch and every column claim
    ``claim`` records: its buffers are shorter than its row count (read unchecked, past their end)."""
    if table is None:
        table = pa.table({"id": pa.array(range(10), pa.int64())})
    payload = bytearray(frames.encode(table))
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(bytes(payload)))
    reader.read_next_message()  # the schema
    meta = reader.read_next_message().metadata.to_pybytes()
    at = bytes(payload).find(meta)
    batch = frames._Fb(meta, struct.unpack_from("<I", meta, 0)[0]).table(2)  # Message.header: the RecordBatch
    struct.pack_into("<q", payload, at + batch._field(0), claim)  # RecordBatch.length
    for node in batch.structs(1, 16):  # RecordBatch.nodes: FieldNode{length, null_count}
        struct.pack_into("<q", payload, at + node, claim)
    return bytes(payload)
