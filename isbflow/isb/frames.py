"""Frames: the unit on an internal edge is an Arrow IPC batch of many records.

One NATS message per record costs a Python round trip per record; a frame
carries up to ``max_rows`` records in one message of at most ``max_bytes``
(the server's ``max_payload`` less header room), so records move at Spark's
speed. A frame is self-describing: an Arrow IPC *stream* (schema + one record
batch), readable with nothing but pyarrow.

Contract of :func:`split_frames`: every input row lands in exactly one frame
or, when that row alone exceeds ``max_bytes``, in ``oversized`` (to be sent to
the dead-letter buffer with its size); order within the input is kept.
The split is deterministic: the same batch gives the same frames, which is what
makes frame ids (``Nats-Msg-Id``) stable across a re-executed Spark batch.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa

#: Headers on every frame message.
HDR_FRAME = "Isb-Frame"  # format marker, value FRAME_FORMAT
HDR_ROWS = "Isb-Rows"  # records in the frame
FRAME_FORMAT = "arrow-ipc-stream/1"
#: Room kept below max_payload for NATS headers (msg id, frame headers).
HEADER_ROOM = 1024


@dataclass
class Frame:
    payload: bytes
    rows: int


@dataclass
class Split:
    frames: list[Frame] = field(default_factory=list)
    #: rows that alone exceed the frame size: (row as a 1-row table, its encoded size)
    oversized: list[tuple[pa.Table, int]] = field(default_factory=list)


def encode(batch: pa.RecordBatch | pa.Table) -> bytes:
    """One Arrow IPC stream holding ``batch`` (all its chunks)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        if isinstance(batch, pa.Table):
            w.write_table(batch)
        else:
            w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode(payload: bytes | memoryview) -> pa.Table:
    """The records of one frame."""
    return pa.ipc.open_stream(pa.py_buffer(payload)).read_all()


def decode_batches(payload: bytes | memoryview) -> list[pa.RecordBatch]:
    return list(pa.ipc.open_stream(pa.py_buffer(payload)))


def split_frames(data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch], max_bytes: int,
                 max_rows: int = 10_000) -> Split:
    """Cut ``data`` into frames of at most ``max_rows`` rows and ``max_bytes`` bytes."""
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    else:
        batches = list(data)
        if not batches:
            return Split()
        table = pa.Table.from_batches(batches)
    out = Split()
    limit = max_bytes - HEADER_ROOM
    if limit <= 0:
        raise ValueError(f"max_bytes must exceed {HEADER_ROOM}")
    start = 0
    n = table.num_rows
    while start < n:
        rows = min(max_rows, n - start)
        # Estimate from Arrow's buffer sizes, then shrink until the encoding fits.
        while True:
            piece = table.slice(start, rows)
            payload = encode(piece)
            if len(payload) <= limit:
                out.frames.append(Frame(payload, rows))
                start += rows
                break
            if rows == 1:
                out.oversized.append((piece, len(payload)))
                start += 1
                break
            # Scale by the overshoot, at least halving progress.
            rows = max(1, min(rows // 2, int(rows * limit / len(payload) * 0.9)))
    return out
