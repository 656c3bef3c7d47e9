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
A frame id ends with :func:`payload_digest` of the frame's bytes, so a message
published beforehand under a frame's position (``step:batch:task:part:chunk``)
but with other bytes has another id and cannot make JetStream drop the real
frame as its duplicate.

Contract of :func:`read_frame` (the reading side, which trusts no frame; every
decode of a buffer's message goes through it): the records of one frame, or
:class:`BadFrame` saying why there are none:

- the bytes are not an Arrow IPC stream;
- the frame would decode to more than ``MAX_DECODE_RATIO`` (64) times its own
  size (at least ``MIN_DECODE_CAP``, 1 MiB). The decoded size is what the IPC
  metadata and the compressed buffers' length prefixes declare, checked *before*
  anything is decompressed, so a small compressed frame cannot make a reader
  allocate gigabytes. Frames the writer makes are never compressed (decoded size
  = payload size), so the cap only ever refuses foreign frames; with
  ``max_payload`` at most 8 MiB no accepted frame decodes past 512 MiB;
- a column of a type that takes no bytes per record (:func:`unbounded_type`:
  null, run-end encoded, a struct without fields, a zero-width binary or list,
  at any depth): nothing in the frame bounds how many records such a column
  claims, and a 224-byte frame of one null column can claim 200 million, which
  the cast to the step's schema then allocates;
- more than ``MAX_ROWS_PER_BYTE`` (8) records per byte of payload. Every column
  a frame may carry needs at least one bit per record (a boolean without nulls
  is the densest; an all-null column of any other type has its validity bitmap
  and its values), so a frame of ``n`` bytes honestly holds fewer than ``8 n``
  records whatever its columns. Validation holds each column's records to its
  buffers; the cap bounds the rest: a frame without columns, and a compressed
  frame's records against its compressed size;
- the batch fails ``RecordBatch.validate(full=True)``: a buffer shorter than
  the records it must hold, offsets past their data, bad UTF-8, dictionary
  indices out of range (unvalidated, such a frame reads past its buffers);
- the ``Isb-Rows`` header is not the frame's row count.

Full validation reads every byte once (measured: 0.8 ms for a 700 KB frame of
10,000 string records, on top of 0.1 ms to open it).

:func:`split_frames` (the writing side) refuses a batch with a column of an
:func:`unbounded_type`, naming it: such frames would all be dead-lettered
downstream, so the step fails where the column is made instead.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

import pyarrow as pa

#: Headers on every frame message.
HDR_FRAME = "Isb-Frame"  # format marker, value FRAME_FORMAT
HDR_ROWS = "Isb-Rows"  # records in the frame
FRAME_FORMAT = "arrow-ipc-stream/1"
#: Room kept below max_payload for NATS headers (msg id, frame headers).
HEADER_ROOM = 1024
#: A frame may decode to at most this many times its payload's size ...
MAX_DECODE_RATIO = 64
#: ... or this many bytes, whichever is larger (tiny compressed frames).
MIN_DECODE_CAP = 1 << 20
#: A frame may hold at most this many records per byte of payload (a bit per record: module doc).
MAX_ROWS_PER_BYTE = 8


class BadFrame(ValueError):
    """A frame that cannot be read (:func:`read_frame`); the message says why."""


@dataclass
class Frame:
    payload: bytes
    rows: int


@dataclass
class Split:
    frames: list[Frame] = field(default_factory=list)
    #: rows that alone exceed the frame size: (row as a 1-row table, its encoded size)
    oversized: list[tuple[pa.Table, int]] = field(default_factory=list)


def payload_digest(payload: bytes | memoryview) -> str:
    """A 64-bit BLAKE2b digest of a message's bytes, as 16 hex digits (the last part of a frame id)."""
    return hashlib.blake2b(payload, digest_size=8).hexdigest()


def frame_id(step: str, batch_id: int, task: int, partition: int | str, chunk: int,
             payload: bytes | memoryview | None = None) -> str:
    """The ``Nats-Msg-Id`` of a frame, ``<step>:<batch>:<task>:<partition>:<chunk>:<digest>``: equal
    for equal inputs, so a re-executed batch that makes the same frames deduplicates. The digest
    (:func:`payload_digest` of ``payload``) means only a message with the
    frame's own bytes counts as its duplicate: a message published earlier under the same position
    with other bytes (forged, or a re-run whose transform gave other rows) does not suppress it.
    Without ``payload`` (dead letters, whose digest :func:`isbflow.isb.dlq.encode_dead_letter`
    adds) the id is the position alone."""
    position = f"{step}:{batch_id}:{task}:{partition}:{chunk}"
    return position if payload is None else f"{position}:{payload_digest(payload)}"


def encode(batch: pa.RecordBatch | pa.Table) -> bytes:
    """One Arrow IPC stream holding ``batch`` as one record batch of freshly packed columns: the
    same rows give the same bytes however the input was chunked or sliced (a re-executed Spark
    batch may hand them over in other chunks, and the frame id carries the bytes' digest)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        if isinstance(batch, pa.Table):
            w.write_table(_packed(batch))
        else:
            w.write_batch(batch)
    return sink.getvalue().to_pybytes()


def _packed(table: pa.Table) -> pa.Table:
    """``table`` with each column concatenated into new buffers of exactly its rows (a slice keeps
    its parent's buffers, and a variable-width column's values buffer then differs with the
    slicing; measured: ~0.03 ms more per 10,000-row frame)."""
    return pa.table([pa.concat_arrays(c.chunks) if c.num_chunks else pa.array([], c.type)
                     for c in table.columns], schema=table.schema)


def decode(payload: bytes | memoryview) -> pa.Table:
    """The records of one frame as a table, checked as :func:`read_frame` checks them."""
    schema, batches = _checked(payload, MAX_DECODE_RATIO)
    return pa.Table.from_batches(batches, schema=schema)


def unbounded_type(t: pa.DataType) -> str | None:
    """Why a column of type ``t`` may claim any number of records without a byte to back them
    (None when it cannot): ``t`` or a type nested in it is null, run-end encoded, a struct without
    fields, a zero-width fixed-size binary or a fixed-size list of size 0."""
    if pa.types.is_null(t):
        return "is null-typed"
    if pa.types.is_run_end_encoded(t):
        return "is run-end encoded"
    if pa.types.is_struct(t) and t.num_fields == 0:
        return "is a struct without fields"
    if pa.types.is_fixed_size_binary(t) and t.byte_width == 0:
        return "is a zero-width binary"
    if pa.types.is_fixed_size_list(t) and t.list_size == 0:
        return "is a fixed-size list of size 0"
    if isinstance(t, pa.ExtensionType):
        return unbounded_type(t.storage_type)
    if isinstance(t, pa.DictionaryType):
        return unbounded_type(t.value_type)
    for i in range(t.num_fields):
        why = unbounded_type(t.field(i).type)
        if why is not None:
            return f"holds a field that {why}"
    return None


# Arrow IPC metadata is a flatbuffer (format/Message.fbs); these read only what the size check needs:
# Message{version, header_type, header, bodyLength}, RecordBatch{length, nodes, buffers, compression},
# DictionaryBatch{id, data}. Every read is bounds-checked: the bytes may be anything.
_HEADER_DICTIONARY, _HEADER_RECORD_BATCH = 2, 3


class _Fb:
    """One flatbuffer table at ``pos`` of ``buf``."""

    def __init__(self, buf: bytes, pos: int):
        self.buf, self.pos = buf, pos
        self.vt = pos - _unpack("<i", buf, pos)
        self.vt_len = _unpack("<H", buf, self.vt)

    def _field(self, i: int) -> int | None:
        slot = 4 + 2 * i
        if slot + 2 > self.vt_len:
            return None
        rel = _unpack("<H", self.buf, self.vt + slot)
        return None if rel == 0 else self.pos + rel

    def scalar(self, i: int, fmt: str, default: int = 0) -> int:
        at = self._field(i)
        return default if at is None else _unpack(fmt, self.buf, at)

    def table(self, i: int) -> _Fb | None:
        at = self._field(i)
        return None if at is None else _Fb(self.buf, at + _unpack("<I", self.buf, at))

    def structs(self, i: int, size: int) -> list[int]:
        """Positions of a vector of structs of ``size`` bytes."""
        at = self._field(i)
        if at is None:
            return []
        start = at + _unpack("<I", self.buf, at)
        n = _unpack("<I", self.buf, start)
        if start + 4 + n * size > len(self.buf):
            raise BadFrame("IPC metadata vector runs past its end")
        return [start + 4 + k * size for k in range(n)]


def _unpack(fmt: str, buf: bytes, at: int) -> int:
    size = struct.calcsize(fmt)
    if at < 0 or at + size > len(buf):
        raise BadFrame("IPC metadata points outside itself")
    return struct.unpack_from(fmt, buf, at)[0]


def _batch_decoded_size(batch: _Fb, body: bytes) -> int:
    """Bytes the record batch's buffers take once decoded: their lengths, or for a compressed
    body each buffer's declared uncompressed length (its first 8 bytes; -1 = stored as is)."""
    compressed = batch.table(3) is not None
    total = 0
    for at in batch.structs(2, 16):
        offset, length = struct.unpack_from("<qq", batch.buf, at)
        if offset < 0 or length < 0 or offset + length > len(body):
            raise BadFrame(f"a buffer at {offset} of {length} bytes lies outside the {len(body)}-byte body")
        if not compressed or length == 0:
            total += length
            continue
        if length < 8:
            raise BadFrame("a compressed buffer has no length prefix")
        declared = struct.unpack_from("<q", body, offset)[0]
        if declared < -1:
            raise BadFrame(f"a compressed buffer declares {declared} bytes")
        total += length - 8 if declared == -1 else declared
    return total


def decoded_size(payload: bytes | memoryview) -> int:
    """Bytes the frame's record and dictionary batches declare once decoded, from the IPC metadata
    alone (nothing is decompressed). :class:`BadFrame` when the bytes are not an IPC stream."""
    reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(payload))
    total = 0
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            return total
        meta = message.metadata.to_pybytes()
        root = _Fb(meta, _unpack("<I", meta, 0))
        kind = root.scalar(1, "<B")
        header = root.table(2)
        if header is None or kind not in (_HEADER_DICTIONARY, _HEADER_RECORD_BATCH):
            continue  # the schema (a frame has one), or a kind that carries no buffers
        if kind == _HEADER_DICTIONARY:
            header = header.table(1)
            if header is None:
                raise BadFrame("a dictionary batch without data")
        body = message.body.to_pybytes() if message.body is not None else b""
        total += _batch_decoded_size(header, body)


def _checked(payload: bytes | memoryview, max_ratio: int) -> tuple[pa.Schema, list[pa.RecordBatch]]:
    """The frame's schema and record batches, every check of :func:`read_frame` but the row header made."""
    cap = max(max_ratio * len(payload), MIN_DECODE_CAP)
    try:
        size = decoded_size(payload)
        if size > cap:
            raise BadFrame(f"the frame of {len(payload)} bytes declares {size} bytes once decoded, over "
                           f"the cap of {cap} ({max_ratio}x its size, at least {MIN_DECODE_CAP})")
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
        schema = reader.schema
        batches = list(reader)
    except BadFrame:
        raise
    except (pa.ArrowException, ValueError, OSError, IndexError, struct.error) as e:
        raise BadFrame(f"not an Arrow IPC frame ({type(e).__name__}: {e})") from None
    for f in schema:
        why = unbounded_type(f.type)
        if why is not None:
            raise BadFrame(f"its column {f.name!r} ({f.type}) {why}: such a column needs no bytes per record, "
                           "so nothing bounds the records it claims (a step never writes one)")
    rows = sum(b.num_rows for b in batches)
    if rows > MAX_ROWS_PER_BYTE * len(payload):
        raise BadFrame(f"the frame of {len(payload)} bytes claims {rows} records, over the cap of "
                       f"{MAX_ROWS_PER_BYTE * len(payload)} ({MAX_ROWS_PER_BYTE} per byte: a record takes at "
                       "least a bit)")
    for b in batches:
        try:
            b.validate(full=True)
        except (pa.ArrowException, ValueError) as e:
            raise BadFrame(f"its record batch does not hold the {b.num_rows} records it declares "
                           f"({type(e).__name__}: {e})") from None
    return schema, batches


def read_frame(payload: bytes | memoryview, rows_header: str | None = None,
               max_ratio: int = MAX_DECODE_RATIO) -> list[pa.RecordBatch]:
    """The record batches of one frame from an untrusted source (module docstring states the checks);
    ``rows_header`` is the message's ``Isb-Rows`` header when it has one."""
    _, batches = _checked(payload, max_ratio)
    if rows_header is not None:
        try:
            declared = int(str(rows_header).strip())
        except ValueError:
            raise BadFrame(f"its {HDR_ROWS} header {str(rows_header)[:64]!r} is not a row count") from None
        actual = sum(b.num_rows for b in batches)
        if declared != actual:
            raise BadFrame(f"it holds {actual} rows, its {HDR_ROWS} header says {declared}")
    return batches


def split_frames(data: pa.Table | pa.RecordBatch | Iterable[pa.RecordBatch], max_bytes: int,
                 max_rows: int = 10_000) -> Split:
    """Cut ``data`` into frames of at most ``max_rows`` rows and ``max_bytes`` bytes; a ``ValueError``
    naming a column of an :func:`unbounded_type` (no reader would take its frames)."""
    if isinstance(data, pa.RecordBatch):
        table = pa.Table.from_batches([data])
    elif isinstance(data, pa.Table):
        table = data
    else:
        batches = list(data)
        if not batches:
            return Split()
        table = pa.Table.from_batches(batches)
    for f in table.schema:
        why = unbounded_type(f.type)
        if why is not None:
            raise ValueError(f"column {f.name!r} ({f.type}) {why}: no step reads a frame carrying it "
                             "(isbflow.isb.frames.read_frame); give it a type, e.g. cast an untyped null "
                             "literal: F.lit(None).cast('string')")
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
