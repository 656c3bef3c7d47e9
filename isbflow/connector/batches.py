"""Executor side of the ``jetstream`` source: messages to the Arrow batches Spark takes.

Pure functions (no NATS, no Spark session): :func:`events_batches` cuts a task's events
into batches of at most :data:`EVENTS_BATCH_ROWS` rows or :data:`EVENTS_BATCH_BYTES`
payload bytes, whichever comes first (always one event at least), and
:func:`events_batch` builds one in bulk; :func:`conform` fits a frame's batches to the schema the query was
given, or fails naming the frame (a frame of another schema is a deployment
mismatch, not a bad record).
"""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import LongType, StringType, StructField, StructType, TimestampType

from isbflow.isb.errors import BufferReadError
from isbflow.isb.read import Message

#: The fixed schema of events mode. ``_isb_ts`` is the time JetStream stored the event.
EVENTS_SCHEMA = StructType([
    StructField("value", StringType()),
    StructField("_isb_id", StringType()),
    StructField("_isb_seq", LongType()),
    StructField("_isb_stream", StringType()),
    StructField("_isb_ts", TimestampType()),
])
#: Events per Arrow batch handed to Spark, at most.
EVENTS_BATCH_ROWS = 10_000
#: Payload bytes per Arrow batch, at most (a batch is cut before the event that would pass
#: it): 10,000 events of 1 MiB would otherwise make one 10 GiB batch in a Python worker.
EVENTS_BATCH_BYTES = 64 * 1024 * 1024


def arrow_schema(schema: StructType) -> pa.Schema:
    """The Arrow schema Spark checks each yielded batch against (UTC timestamps)."""
    return to_arrow_schema(schema, timezone="UTC")


def conform(stream: str, seq: int, batches: list[pa.RecordBatch],
             target: pa.Schema) -> Iterator[pa.RecordBatch]:
    """The record batches of one frame, conformed to ``target`` (column order, types); a frame of
    another schema is a deployment mismatch and fails (module doc, *Bad frames*)."""
    for b in batches:
        if not b.schema.equals(target):
            missing = [n for n in target.names if n not in b.schema.names]
            if missing:
                raise BufferReadError(
                    f"buffer {stream}: frame {seq} lacks column(s) {missing} of the schema given "
                    "with .schema(...); the upstream step writes " + ", ".join(b.schema.names))
            try:
                b = b.select(target.names).cast(target)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise BufferReadError(f"buffer {stream}: frame {seq} does not fit the given schema "
                                      f"({e})") from None
        yield b


def events_batches(msgs: list[Message], stream: str, prefix: str, target: pa.Schema,
                   max_rows: int = EVENTS_BATCH_ROWS,
                   max_bytes: int = EVENTS_BATCH_BYTES) -> Iterator[pa.RecordBatch]:
    """``msgs`` as Arrow batches of at most ``max_rows`` events and ``max_bytes`` payload bytes."""
    lo, size = 0, 0
    for i, m in enumerate(msgs):
        if i > lo and (i - lo >= max_rows or size + len(m[1]) > max_bytes):
            yield events_batch(msgs[lo:i], stream, prefix, target)
            lo, size = i, 0
        size += len(m[1])
    if lo < len(msgs):
        yield events_batch(msgs[lo:], stream, prefix, target)


def events_batch(msgs: list[Message], stream: str, prefix: str, target: pa.Schema) -> pa.RecordBatch:
    """One Arrow batch of events: payloads, ids, sequences, stream, store time; built in bulk."""
    n = len(msgs)
    seqs = pa.array([m[0] for m in msgs], pa.int64())
    raw = pa.array([m[1] for m in msgs], pa.binary())
    try:
        value = raw.cast(pa.string())
    except pa.ArrowInvalid:  # not UTF-8: keep the event (from_json will route it to the DLQ)
        value = pa.array([m[1].decode("utf-8", "replace") for m in msgs], pa.string())
    ids = pc.binary_join_element_wise(prefix, seqs.cast(pa.string()), "")
    times = [m[3] for m in msgs]
    if isinstance(times[0], int):  # consumer path: ns since the epoch
        ts = pa.array(times, pa.int64()).cast(pa.timestamp("ns", "UTC"))
    else:  # direct get: RFC 3339 strings
        ts = pa.array(times, pa.string()).cast(pa.timestamp("ns", "UTC"))
    ts = ts.cast(pa.timestamp("us", "UTC"), safe=False)
    return pa.RecordBatch.from_arrays(
        [value, ids, seqs, pa.repeat(pa.scalar(stream, pa.string()), n), ts], schema=target)
