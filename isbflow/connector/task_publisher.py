"""One executor task of the JetStream writer: route rows into frames, publish them acked, wait when full.

The contract (routing, frames, oversized records, full buffers) is stated in
:mod:`isbflow.connector.writer`; this module is its executor side, one event
loop and one connection per task.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
from nats.js.errors import (
    APIError,
    BucketNotFoundError,
    KeyNotFoundError,
    NoStreamResponseError,
    NotFoundError,
)

from isbflow.connector.write_options import (
    ERROR_COLUMN,
    PARTITION_COLUMN,
    RAW_COLUMN,
    UNAVAILABLE_FOR,
    UNROUTED_COLUMN,
    BufferWriteError,
    InvalidPartitionColumn,
    JetStreamWriteReport,
    OutputBufferNotFound,
    WriterOptions,
    partition_columns,
)
from isbflow.isb import naming
from isbflow.isb.connect import connect
from isbflow.isb.dlq import DeadLetter, publish_dead_letters
from isbflow.isb.frames import FRAME_FORMAT, HDR_FRAME, HDR_ROWS, Frame, frame_id, split_frames
from isbflow.isb.ledger import ID_COLUMN
from isbflow.isb.publish import ACK_TIMEOUT, Ack, AckedPublisher, resolve_future, settled
from isbflow.isb.ranges import union
from isbflow.isb.routed import routed_away
from isbflow.isb.store import BufferFull, OutFrame, has_buffer_role, write_until_stored
from isbflow.spec.constants import OnFull

if TYPE_CHECKING:
    import nats.js

log = logging.getLogger(__name__)
_LOG_EVERY = 5.0
_MAX_BACKOFF = 2.0
#: frames of one partition a store's writer gets per call (the generic path of :meth:`TaskPublisher.attach`)
STORE_WRITE_FRAMES = 64
#: the largest frame on a store without a server-wide limit (JetStream's is the server's max_payload):
#: the embedded nats-server's, so a pipeline's frames are cut the same on either store
STORE_MAX_PAYLOAD = 8 * 1024 * 1024



def _is_full_error(e: Exception) -> bool:
    text = (getattr(e, "description", None) or str(e)).lower()
    return "maximum messages" in text or "maximum bytes" in text


@dataclass
class _Buffer:
    """Per edge partition state of one task."""

    partition: int
    ep: naming.EdgePartition
    pending: list[pa.RecordBatch] = field(default_factory=list)
    pending_rows: int = 0
    chunk: int = 0
    dead: int = 0
    #: frames not committed downstream, as far as this task knows (upper bound); None = unknown
    usage: int | None = None
    tight: bool = False


@dataclass
class _InFlight:
    buf: _Buffer
    msg_id: str
    payload: bytes
    headers: dict[str, str]
    rows: int
    future: asyncio.Future


def _settle_in_flight(f: _InFlight, ack: Ack | None, error: BaseException | None) -> None:
    resolve_future(f.future, ack, error)


def _in_flight_message(f: _InFlight) -> tuple[str, bytes, dict[str, str]]:
    return f.buf.ep.subject, f.payload, f.headers


class TaskPublisher:
    """Publishes one task's rows; one event loop, one connection, per :meth:`JetStreamStreamWriter.write`."""

    def __init__(self, opts: WriterOptions, batch_id: int, task: int):
        self.opts = opts
        self.batch_id, self.task = batch_id, task
        self.report = JetStreamWriteReport(batch_id=batch_id, task=task)
        self.buffers: dict[int, _Buffer] = {}
        self.inflight: deque[_InFlight] = deque()
        self.rejected = 0  # records dead-lettered by _isb_error, for their deterministic ids
        self.capacity = opts.capacity_frames
        self._last_log = 0.0

    # -- setup
    async def run(self, batches: Iterator[pa.RecordBatch]) -> JetStreamWriteReport:
        batches = iter(batches)
        first = next((b for b in batches if b.num_rows), None)
        if first is None:  # an empty task (e.g. one of many shuffle partitions) does not connect
            return self.report
        nc = await connect(self.opts.settings, name=f"isbflow-writer-{self.opts.step}-{self.task}")
        try:
            await self.attach(nc)
            for batch in itertools.chain([first], batches):
                if self.opts.routed_sinks and UNROUTED_COLUMN in batch.schema.names:  # one conditional edge
                    self.note_routed(batch, pc.invert(pc.fill_null(batch.column(UNROUTED_COLUMN), False)))
                await self.feed(await self.screen(batch))
            await self.finish()
        finally:
            await nc.close()
        return self.report

    async def attach(self, nc) -> None:
        """Publish on ``nc`` (one connection per task, shared by a fan-out's edges): a nats-py
        client (acked, pipelined JetStream publishes) or a store object whose partitions are
        :class:`isbflow.isb.store.BufferWriter` objects (``nc.buffer(stream)``: frames are written
        in calls of :data:`STORE_WRITE_FRAMES`, idempotent by frame id, the store refusing what a
        full partition cannot take)."""
        self.nc = nc
        if has_buffer_role(nc):
            self.store_frames: dict[int, list[OutFrame]] | None = {}
            self.js = nc  # the dead-letter target: the store object itself (isb.dlq)
            self.max_payload = self.opts.max_payload or STORE_MAX_PAYLOAD
            return
        self.store_frames = None
        self.js: nats.js.JetStreamContext = nc.jetstream()
        self.pipe = AckedPublisher(nc, _settle_in_flight, _in_flight_message, unavailable_for=UNAVAILABLE_FOR)
        await self.pipe.start()
        self.max_payload = min(self.opts.max_payload or nc.max_payload, nc.max_payload)
        self.kv = await self._status_kv() if self.capacity is not None else None

    async def screen(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """What a step publishes of ``batch``: unrouted rows counted, rows marked with an error
        dead-lettered, both taken out (once per row, whichever edges it goes to)."""
        unrouted = self._count_unrouted(batch)
        batch = await self._dead_letter_errors(batch)
        return self._drop_unrouted(batch, unrouted)

    def note_routed(self, batch: pa.RecordBatch, taken: pa.Array) -> None:
        """Keep the ``_isb_id`` ranges of the rows this edge does not take (``taken``: per row), for
        the sinks it gates (``routedSinks``; :mod:`isbflow.isb.routed`)."""
        idx = batch.schema.get_field_index(ID_COLUMN)
        if idx >= 0:
            away = routed_away(batch.column(idx), taken)
            if away:
                self.report.routed = union(self.report.routed, away)

    async def feed(self, batch: pa.RecordBatch, partitions: pa.Array | None = None) -> None:
        """Route ``batch``'s rows to this edge's partitions (``partitions``: each row's, else the
        ``_isb_partition`` column) and publish every full frame."""
        for p, rows in self._route(batch, partitions):
            buf = self._buffer(p)
            buf.pending.append(rows)
            buf.pending_rows += rows.num_rows
            if buf.pending_rows >= self.opts.frame_rows:
                await self._flush(buf, final=False)

    async def finish(self) -> None:
        """Publish what is pending and wait for every acknowledgement."""
        for buf in list(self.buffers.values()):
            await self._flush(buf, final=True)
        if self.store_frames is not None:
            for buf in list(self.buffers.values()):
                await self._store_write(buf)
        while self.inflight:
            await self._settle_oldest()
        self.report.blocked_seconds = round(self.report.blocked_seconds, 3)

    async def _status_kv(self):
        bucket = naming.status_bucket(self.opts.pipeline)
        try:
            return await self.js.key_value(bucket)
        except BucketNotFoundError:
            log.warning("status bucket %s does not exist: buffer usage of %s -> %s counts every stored "
                        "frame as unconsumed", bucket, self.opts.step, self.opts.to)
            return None

    def _buffer(self, p: int) -> _Buffer:
        buf = self.buffers.get(p)
        if buf is None:
            buf = self.buffers[p] = _Buffer(p, self.opts.buffer(p))
        return buf

    # -- records no out edge's conditions took (isbflow.steps.routing): counted, never published
    def _count_unrouted(self, batch: pa.RecordBatch) -> bool:
        """Count the rows marked unrouted; True when the batch has the column at all."""
        idx = batch.schema.get_field_index(UNROUTED_COLUMN)
        if idx < 0:
            return False
        n = pc.sum(pc.fill_null(batch.column(idx), False).cast(pa.int64())).as_py() or 0
        if n:
            self.report.count(0, "unrouted", n)
        return True

    @staticmethod
    def _drop_unrouted(batch: pa.RecordBatch, marked: bool) -> pa.RecordBatch:
        """The rows to publish: those not marked unrouted (dead-lettered ones are gone already)."""
        if not marked:
            return batch
        keep = pc.invert(pc.fill_null(batch.column(UNROUTED_COLUMN), False))
        return batch.filter(keep).drop_columns([UNROUTED_COLUMN])

    # -- records a step marked bad (e.g. the source's parse): to the dead-letter buffer
    async def _dead_letter_errors(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        """Rows whose ``_isb_error`` is set go to the DLQ with that reason; the rest flow on."""
        idx = batch.schema.get_field_index(ERROR_COLUMN)
        if idx < 0:
            return batch
        errors = batch.column(idx)
        drop = [c for c in (ERROR_COLUMN, RAW_COLUMN) if c in batch.schema.names]
        if errors.null_count == batch.num_rows:
            return batch.drop_columns(drop)
        bad = pc.is_valid(errors)
        rejected = batch.filter(bad).drop_columns([*partition_columns(batch.schema.names),
                                                   *([UNROUTED_COLUMN] if UNROUTED_COLUMN in batch.schema.names
                                                     else [])])
        letters = []
        for row in rejected.to_pylist():
            reason = row.pop(ERROR_COLUMN)
            letters.append(DeadLetter(
                record=row, reason=f"{reason} at step {self.opts.step}",
                msg_id=f"{frame_id(self.opts.step, self.batch_id, self.task, 'dlq', self.rejected)}",
            ))
            self.rejected += 1
        await publish_dead_letters(self.js, self.opts.pipeline, self.opts.step, letters,
                                   max_payload=self.max_payload, subject=self.opts.dlq_subject)
        self.report.count(0, "dead_lettered", len(letters))
        return batch.filter(pc.invert(bad)).drop_columns(drop)

    # -- routing
    def _route(self, batch: pa.RecordBatch, col: pa.Array | None = None) -> Iterator[tuple[int, pa.RecordBatch]]:
        if batch.num_rows == 0:
            return
        n = self.opts.partitions
        if col is None:
            idx = batch.schema.get_field_index(PARTITION_COLUMN)
            if idx < 0:
                yield self.task % n, batch
                return
            col = batch.column(idx)
            batch = batch.drop_columns([PARTITION_COLUMN])
        data = batch
        if col.null_count:
            raise InvalidPartitionColumn(
                f"step {self.opts.step} -> {self.opts.to}: {col.null_count} row(s) have a null {PARTITION_COLUMN}")
        mm = pc.min_max(col)
        lo, hi = mm["min"].as_py(), mm["max"].as_py()
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise InvalidPartitionColumn(
                f"step {self.opts.step} -> {self.opts.to}: a row has {PARTITION_COLUMN}={bad} but the edge has "
                f"{n} partition(s) (option 'partitions'); compute it as pmod(xxhash64(key), {n})")
        if lo == hi:
            yield lo, data
            return
        for p in range(lo, hi + 1):
            part = data.filter(pc.equal(col, p))
            if part.num_rows:
                yield p, part

    # -- frames
    async def _flush(self, buf: _Buffer, final: bool) -> None:
        if not buf.pending_rows:
            return
        table = pa.Table.from_batches(buf.pending)
        take = table.num_rows if final else (table.num_rows // self.opts.frame_rows) * self.opts.frame_rows
        rest = table.slice(take)
        buf.pending = rest.to_batches() if rest.num_rows else []
        buf.pending_rows = rest.num_rows
        split = split_frames(table.slice(0, take), max_bytes=self.max_payload, max_rows=self.opts.frame_rows)
        if split.oversized:
            await self._dead_letter(buf, split.oversized)
        for frame in split.frames:
            await self._publish(buf, frame)

    async def _dead_letter(self, buf: _Buffer, oversized: list[tuple[pa.Table, int]]) -> None:
        letters = []
        for row, size in oversized:
            letters.append(DeadLetter(
                record=row.to_pylist()[0],
                reason=f"record of {size} bytes exceeds max_payload {self.max_payload} at step {self.opts.step}",
                size=size,
                msg_id=f"{frame_id(self.opts.step, self.batch_id, self.task, buf.partition, buf.dead)}:dlq",
            ))
            buf.dead += 1
        await publish_dead_letters(self.js, self.opts.pipeline, self.opts.step, letters,
                                   max_payload=self.max_payload, subject=self.opts.dlq_subject)
        self.report.count(buf.partition, "dead_lettered", len(letters))

    async def _publish(self, buf: _Buffer, frame: Frame) -> None:
        msg_id = frame_id(self.opts.step, self.batch_id, self.task, buf.partition, buf.chunk, frame.payload)
        buf.chunk += 1
        if self.store_frames is not None:
            pending = self.store_frames.setdefault(buf.partition, [])
            pending.append(OutFrame(msg_id, frame.payload, frame.rows))
            if len(pending) >= STORE_WRITE_FRAMES:
                await self._store_write(buf)
            return
        headers = {"Nats-Msg-Id": msg_id, HDR_FRAME: FRAME_FORMAT, HDR_ROWS: str(frame.rows)}
        if self.capacity is not None and not await self._admit(buf):
            self._discard(buf, frame.rows)
            return
        f = _InFlight(buf, msg_id, frame.payload, headers, frame.rows, asyncio.get_running_loop().create_future())
        await self.pipe.publish(buf.ep.subject, frame.payload, headers, f)
        self.inflight.append(f)
        if buf.usage is not None:
            buf.usage += 1
        if buf.tight:
            while self.inflight:
                await self._settle_oldest()
        elif len(self.inflight) >= self.opts.window:
            await self._settle_oldest()

    def _discard(self, buf: _Buffer, rows: int) -> None:
        self.report.count(buf.partition, "discarded_frames")
        self.report.count(buf.partition, "discarded_rows", rows)

    async def _settle_oldest(self) -> None:
        f = self.inflight.popleft()
        try:
            ack = await settled(f.future, ACK_TIMEOUT)
        except NoStreamResponseError:
            raise OutputBufferNotFound(f.buf.ep.stream, f.buf.ep.subject) from None
        except TimeoutError:
            raise BufferWriteError(f"no acknowledgement for frame {f.msg_id} on buffer {f.buf.ep.stream} within "
                                   f"{ACK_TIMEOUT:.0f}s (is the ISB service overloaded or partitioned?)") from None
        except APIError as e:
            if not _is_full_error(e):
                raise BufferWriteError(f"publishing frame {f.msg_id} to buffer {f.buf.ep.stream} failed: {e}") from e
            await self._refused_as_full(f)
            return
        self._acked(f.buf, f.rows, ack.duplicate)

    def _acked(self, buf: _Buffer, rows: int, duplicate: bool | None) -> None:
        if duplicate:
            self.report.count(buf.partition, "duplicate_frames")
            self.report.count(buf.partition, "duplicate_rows", rows)
        else:
            self.report.count(buf.partition, "frames")
            self.report.count(buf.partition, "rows", rows)

    async def _refused_as_full(self, f: _InFlight) -> None:
        """The stream itself refused the frame (discard new at its limits): onFull decides."""
        buf = f.buf
        buf.tight, buf.usage = True, None
        if self.opts.on_full == OnFull.DISCARD_LATEST:
            self._discard(buf, f.rows)
            return
        delay, started = 0.05, time.monotonic()
        while True:
            self._log_full(buf, "the stream refused a frame (maximum messages/bytes exceeded)")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)
            if self.capacity is not None and not await self._admit(buf):
                continue
            try:
                ack = await self.js.publish(buf.ep.subject, f.payload, headers=f.headers, timeout=ACK_TIMEOUT)
            except APIError as e:
                if _is_full_error(e):
                    continue
                raise BufferWriteError(f"publishing frame {f.msg_id} to buffer {buf.ep.stream} failed: {e}") from e
            break
        self.report.blocked_seconds += time.monotonic() - started
        self._acked(buf, f.rows, ack.duplicate)

    async def _store_write(self, buf: _Buffer) -> None:
        """Write the partition's pending frames through the store's writer role: under
        ``retryUntilSuccess`` waiting while the partition is full (back-pressure), under
        ``discardLatest`` dropping and counting what a full partition refused."""
        assert self.store_frames is not None
        frames = self.store_frames.pop(buf.partition, [])
        if not frames:
            return
        # a partition lost (flushed, deleted) is refused, never made again here: BufferMissing
        writer = self.nc.buffer(buf.ep.stream, capacity=self.capacity, create_missing=False)
        rows = {f.frame_id: f.rows for f in frames}
        if self.opts.on_full == OnFull.DISCARD_LATEST:
            try:
                written = await writer.write(frames)
            except BufferFull as full:
                written = full.stored
                for f in frames[full.written:]:
                    self._discard(buf, f.rows)
        else:
            started, refused = time.monotonic(), []

            def on_full(full: BufferFull) -> None:
                refused.append(full)
                self._log_full(buf, f"{full.capacity} frames not yet committed by {self.opts.to}")

            written = await write_until_stored(writer, frames, max_pause=_MAX_BACKOFF, on_full=on_full)
            if refused:
                self.report.blocked_seconds += time.monotonic() - started
        for w in written:
            self._acked(buf, rows[w.frame_id], w.duplicate)

    # -- full buffers
    async def _admit(self, buf: _Buffer) -> bool:
        """True when the partition has room for one more frame (waiting for it under
        retryUntilSuccess); False under discardLatest when full."""
        assert self.capacity is not None
        if buf.usage is not None and buf.usage + 1 + self.opts.window <= self.capacity:
            return True  # far from full by our own upper-bound estimate: no round trip
        while self.inflight:  # settle so the stream's last sequence counts our frames
            await self._settle_oldest()
        buf.usage = await self._usage(buf)
        if buf.usage < self.capacity:
            buf.tight = buf.usage + self.opts.window >= self.capacity
            return True
        if self.opts.on_full == OnFull.DISCARD_LATEST:
            return False
        delay, started = 0.05, time.monotonic()
        while buf.usage >= self.capacity:
            self._log_full(buf, f"{buf.usage} of {self.capacity} frames not yet committed by {self.opts.to}")
            await asyncio.sleep(delay)
            delay = min(delay * 2, _MAX_BACKOFF)
            buf.usage = await self._usage(buf)
        self.report.blocked_seconds += time.monotonic() - started
        buf.tight = True
        return True

    def _log_full(self, buf: _Buffer, why: str) -> None:
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY:
            self._last_log = now
            log.warning("buffer %s is full (%s); step %s batch %s task %s waits (onFull=%s)",
                        buf.ep.stream, why, self.opts.step, self.batch_id, self.task, self.opts.on_full.value)

    async def _usage(self, buf: _Buffer) -> int:
        """Frames in the stream not yet committed downstream."""
        try:
            info = await self.js.stream_info(buf.ep.stream)
        except NotFoundError:
            raise OutputBufferNotFound(buf.ep.stream, buf.ep.subject) from None
        first, last = info.state.first_seq, info.state.last_seq
        committed = 0
        if self.kv is not None:
            key = self.opts.committed_key.format(to=self.opts.to, stream=buf.ep.stream)
            try:
                entry = await self.kv.get(key)
                committed = int((entry.value or b"0").decode().strip() or 0)
            except KeyNotFoundError:
                committed = 0
            except ValueError:
                log.warning("status key %s does not hold a sequence number; treated as nothing committed", key)
        return max(0, last - max(committed, first - 1))
