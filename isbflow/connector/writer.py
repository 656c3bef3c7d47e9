"""The JetStream stream writer: Spark tasks publish frames into a step's output buffers.

``df.writeStream.format("jetstream")`` (the ``streamWriter`` of
:class:`isbflow.connector.reader.JetStreamDataSource`) writes a step's output into the buffers of
one edge ``step -> to``: one stream per partition of ``to``
(:class:`isbflow.isb.naming.EdgePartition`).

Contract of :meth:`JetStreamStreamWriter.write` (runs in an executor task):

- **Routing.** A row goes to the edge partition in its ``_isb_partition``
  column (an integer in ``[0, partitions)``, computed by the runner *in Spark*
  as ``pmod(xxhash64(<partitionKey>), partitions)``; the writer never hashes
  in Python). The column is dropped from the published records. Without the
  column, every row of a task goes to partition ``taskPartitionId mod
  partitions`` (a keyless edge: tasks spread over partitions, a task's order is
  kept). A null or out-of-range value fails the task with
  :class:`InvalidPartitionColumn`.
- **Frames.** Rows of one partition are cut into frames by
  :func:`isbflow.isb.frames.split_frames` (``frameRows`` rows, at most
  ``maxPayload`` bytes), in input order. Each frame is published with an
  acked JetStream publish, pipelined (``publishWindow`` frames in flight), and
  the deterministic ``Nats-Msg-Id`` ``<step>:<batchId>:<taskPartitionId>:<edgePartition>:<chunk>``.
  The batch id is the Spark local property ``streaming.sql.batchId``. A
  re-executed batch (task retry, restart from the checkpoint) sees the same
  rows in the same order, so it republishes the same ids and JetStream's
  duplicates window drops them; the PubAck's ``duplicate`` flag is counted.
  Order within a partition is kept (see *Full buffer* for the one exception).
- **Oversized records.** A row that alone exceeds ``maxPayload`` goes to the
  dead-letter buffer (:mod:`isbflow.isb.dlq`) with the reason
  ``record of N bytes exceeds max_payload M at step S``; the rest flows on.
- **Full buffer.** With ``bufferMaxLength`` set, a partition holds at most
  ``ceil(bufferMaxLength * bufferUsageLimit / frameRows)`` frames not yet
  committed downstream: usage = the stream's last sequence minus the
  downstream's committed sequence, read from the status KV key
  ``committed.<to>.<stream>`` (missing = nothing committed). Stream info and
  the key are read only when the writer's own running estimate comes within
  ``publishWindow`` frames of capacity; near capacity frames go one at a time.
  When full, ``onFull=retryUntilSuccess`` waits with backoff (back-pressure:
  the batch takes longer; a log line at most every 5 s) and
  ``onFull=discardLatest`` drops the frame and counts its rows as discarded.
  A publish refused with "maximum messages/bytes exceeded" (a stream with
  discard ``new`` and its own limits) is handled the same way; in that case
  only, a frame already in flight behind the refused one may land before it.
- **Result.** A :class:`JetStreamWriteReport` with counts per edge partition.

:meth:`JetStreamStreamWriter.commit` (driver, once per micro-batch, batch 0
too) sums the task reports (:func:`aggregate_reports`), logs them and, with
the ``statsDir`` option, writes them to ``<statsDir>/batch-<batchId>.json``
(:func:`read_write_stats` reads them back). Publishing is already durable
when the tasks end: ``commit`` commits nothing to JetStream.

Options (strings): ``settings`` (JSON of NatsSettings, see
:func:`isbflow.connector.options.settings_to_json`; resolved from the
environment when absent), ``pipeline``, ``step``, ``to`` (required),
``partitions`` (default 1), ``maxPayload`` (default: the server's),
``frameRows`` (10000), ``bufferMaxLength`` (none = unbounded),
``bufferUsageLimit`` (0.8), ``onFull`` (retryUntilSuccess|discardLatest),
``committedKey`` (template, default ``committed.{to}.{stream}``),
``dlqSubject`` (default ``naming.dlq_subject(pipeline, step)``),
``statsDir``, ``publishWindow`` (32).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import ByteType, IntegerType, LongType, ShortType, StructType

from isbflow.connector.options import DEFAULT_FRAME_ROWS, int_option
from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, connect, resolve_settings, settings_from_json
from isbflow.isb.dlq import DeadLetter, publish_dead_letters
from isbflow.isb.errors import ConnectorOptionError
from isbflow.isb.frames import FRAME_FORMAT, HDR_FRAME, HDR_ROWS, Frame, split_frames
from isbflow.isb.publish import ACK_TIMEOUT, Ack, AckedPublisher, resolve_future, settled
from isbflow.spec.models import DEFAULT_LIMITS, OnFull

if TYPE_CHECKING:
    import nats.js

log = logging.getLogger(__name__)

PARTITION_COLUMN = "_isb_partition"
#: A row with this column set is not published: it goes to the dead-letter buffer with
#: the column's text as its reason (the source step marks records it cannot parse).
ERROR_COLUMN = "_isb_error"
#: The raw record of a rejected row, kept for its dead letter; never published.
RAW_COLUMN = "_isb_raw"
BATCH_ID_PROPERTY = "streaming.sql.batchId"
DEFAULT_COMMITTED_KEY = "committed.{to}.{stream}"
DEFAULT_WINDOW = 32
#: seconds a frame answered 'no stream' (503) is sent again before the buffer counts as missing
#: (a cluster stream electing a new leader answers 503 for a few seconds)
UNAVAILABLE_FOR = 5.0
_LOG_EVERY = 5.0
_MAX_BACKOFF = 2.0


class InvalidPartitionColumn(ValueError):
    """A row's ``_isb_partition`` is null or outside the edge's partitions."""


class OutputBufferNotFound(Exception):
    """The stream of an output buffer does not exist (no stream answers its subject)."""

    def __init__(self, stream: str, subject: str):
        super().__init__(stream, subject)
        self.stream, self.subject = stream, subject

    def __str__(self) -> str:
        return (f"output buffer {self.stream} does not exist on the ISB service (nothing stores subject "
                f"{self.subject}): provision the pipeline ('isbflow isb apply') or check the writer options "
                "'pipeline', 'step', 'to' and 'partitions'")


class BufferWriteError(Exception):
    """Publishing a frame failed for a reason other than a full buffer (the message says which frame)."""


# ------------------------------------------------------------------ options


def _optional_int(options: Mapping[str, str], key: str) -> int | None:
    raw = options.get(key)
    return None if raw is None or str(raw).strip() == "" else int_option(options, key, 0)


def _required(options: Mapping[str, str], key: str, what: str) -> str:
    value = str(options.get(key) or "").strip()
    if not value:
        raise ConnectorOptionError(f"option '{key}' is required: {what}")
    return value


@dataclass(frozen=True)
class WriterOptions:
    """Typed writer options (module docstring lists them). Picklable: it travels to executors."""

    settings: NatsSettings
    pipeline: str
    step: str
    to: str
    partitions: int = 1
    max_payload: int | None = None
    frame_rows: int = DEFAULT_FRAME_ROWS
    buffer_max_length: int | None = None
    buffer_usage_limit: float = DEFAULT_LIMITS.bufferUsageLimit or 0.8
    on_full: OnFull = OnFull.RETRY_UNTIL_SUCCESS
    committed_key: str = DEFAULT_COMMITTED_KEY
    dlq_subject: str | None = None
    stats_dir: str | None = None
    window: int = DEFAULT_WINDOW

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        raw_settings = options.get("settings")
        settings = settings_from_json(raw_settings) if raw_settings else resolve_settings()
        raw_limit = options.get("bufferUsageLimit")
        usage_limit = cls.buffer_usage_limit
        if raw_limit is not None and str(raw_limit).strip():
            try:
                usage_limit = float(raw_limit)
            except ValueError:
                usage_limit = -1.0
            if not 0 < usage_limit <= 1:
                raise ConnectorOptionError(f"option 'bufferUsageLimit': expected a fraction in (0, 1], "
                                           f"got {raw_limit!r}")
        raw_on_full = str(options.get("onFull") or OnFull.RETRY_UNTIL_SUCCESS.value).strip()
        try:
            on_full = OnFull(raw_on_full)
        except ValueError:
            raise ConnectorOptionError(
                f"option 'onFull': expected one of {', '.join(m.value for m in OnFull)}, got {raw_on_full!r}"
            ) from None
        committed_key = str(options.get("committedKey") or DEFAULT_COMMITTED_KEY)
        try:
            committed_key.format(to="t", stream="s")
        except (KeyError, IndexError, ValueError):
            raise ConnectorOptionError(
                f"option 'committedKey': a template with at most {{to}} and {{stream}}, got {committed_key!r}"
            ) from None
        return cls(
            settings=settings,
            pipeline=_required(options, "pipeline", "the pipeline name (names the buffers)"),
            step=_required(options, "step", "the writing vertex (names the buffers and frame ids)"),
            to=_required(options, "to", "the target vertex of the edge written"),
            partitions=int_option(options, "partitions", 1),
            max_payload=_optional_int(options, "maxPayload"),
            frame_rows=int_option(options, "frameRows", DEFAULT_FRAME_ROWS),
            buffer_max_length=_optional_int(options, "bufferMaxLength"),
            buffer_usage_limit=usage_limit,
            on_full=on_full,
            committed_key=committed_key,
            dlq_subject=str(options.get("dlqSubject") or "").strip() or None,
            stats_dir=str(options.get("statsDir") or "").strip() or None,
            window=int_option(options, "publishWindow", DEFAULT_WINDOW),
        )

    def buffer(self, partition: int) -> naming.EdgePartition:
        return naming.EdgePartition(self.pipeline, self.step, self.to, partition)

    @property
    def capacity_frames(self) -> int | None:
        """Frames a partition may hold uncommitted downstream; None = unbounded."""
        if self.buffer_max_length is None:
            return None
        return max(1, math.ceil(self.buffer_max_length * self.buffer_usage_limit / self.frame_rows))


# ------------------------------------------------------------------ task identity


def spark_task_identity() -> tuple[int, int]:
    """(micro-batch id, task partition id) of the running Spark task. Executor only."""
    from pyspark import TaskContext

    tc = TaskContext.get()
    if tc is None:
        raise RuntimeError("JetStreamStreamWriter.write runs inside a Spark task (no TaskContext here)")
    raw = tc.getLocalProperty(BATCH_ID_PROPERTY)
    if raw is None:
        raise RuntimeError(f"no Spark local property {BATCH_ID_PROPERTY!r}: the jetstream writer works in "
                           "streaming queries (writeStream) only")
    return int(raw), tc.partitionId()


def frame_id(step: str, batch_id: int, task: int, partition: int | str, chunk: int) -> str:
    """The ``Nats-Msg-Id`` of a frame: equal for equal inputs, so a re-executed batch deduplicates."""
    return f"{step}:{batch_id}:{task}:{partition}:{chunk}"


# ------------------------------------------------------------------ reports


_COUNTS = ("frames", "rows", "duplicate_frames", "duplicate_rows", "discarded_frames", "discarded_rows",
           "dead_lettered")


@dataclass
class JetStreamWriteReport(WriterCommitMessage):
    """What one task published. ``frames``/``rows`` count frames JetStream stored anew;
    duplicates (PubAck ``duplicate``), discarded (``onFull=discardLatest``) and
    dead-lettered rows are counted apart. ``partitions`` maps edge partition ->
    {count name: n}; ``blocked_seconds`` is time spent waiting on full buffers."""

    batch_id: int
    task: int
    partitions: dict[int, dict[str, int]] = field(default_factory=dict)
    blocked_seconds: float = 0.0

    def count(self, partition: int, name: str, n: int = 1) -> None:
        counts = self.partitions.setdefault(partition, dict.fromkeys(_COUNTS, 0))
        counts[name] += n

    def total(self, name: str) -> int:
        return sum(c[name] for c in self.partitions.values())


def aggregate_reports(messages: Iterable[JetStreamWriteReport | None], batch_id: int,
                      options: WriterOptions | None = None) -> dict[str, Any]:
    """The batch's counts, summed over tasks; ``partitions`` keyed by stream name when options are given."""
    out: dict[str, Any] = {"batchId": batch_id, "tasks": 0, "failedTasks": 0, "blockedSeconds": 0.0,
                           **dict.fromkeys(_COUNTS, 0), "partitions": {}}
    for m in messages:
        if m is None:
            out["failedTasks"] += 1
            continue
        out["tasks"] += 1
        out["blockedSeconds"] += m.blocked_seconds
        for p, counts in m.partitions.items():
            key = options.buffer(p).stream if options else str(p)
            agg = out["partitions"].setdefault(key, dict.fromkeys(_COUNTS, 0))
            for name, n in counts.items():
                agg[name] += n
                out[name] += n
    out["blockedSeconds"] = round(out["blockedSeconds"], 3)
    return out


def read_write_stats(stats_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The per-batch stats files written by :meth:`JetStreamStreamWriter.commit`, by batch id."""
    out = [json.loads(p.read_text()) for p in Path(stats_dir).glob("batch-*.json")]
    return sorted(out, key=lambda s: s["batchId"])


# ------------------------------------------------------------------ the task's publisher


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


class _TaskPublisher:
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
        self.nc = await connect(self.opts.settings, name=f"isbflow-writer-{self.opts.step}-{self.task}")
        try:
            self.js: nats.js.JetStreamContext = self.nc.jetstream()
            self.pipe = AckedPublisher(self.nc, _settle_in_flight, _in_flight_message, unavailable_for=UNAVAILABLE_FOR)
            await self.pipe.start()
            self.max_payload = min(self.opts.max_payload or self.nc.max_payload, self.nc.max_payload)
            self.kv = await self._status_kv() if self.capacity is not None else None
            for batch in itertools.chain([first], batches):
                batch = await self._dead_letter_errors(batch)
                for p, rows in self._route(batch):
                    buf = self._buffer(p)
                    buf.pending.append(rows)
                    buf.pending_rows += rows.num_rows
                    if buf.pending_rows >= self.opts.frame_rows:
                        await self._flush(buf, final=False)
            for buf in list(self.buffers.values()):
                await self._flush(buf, final=True)
            while self.inflight:
                await self._settle_oldest()
        finally:
            await self.nc.close()
        self.report.blocked_seconds = round(self.report.blocked_seconds, 3)
        return self.report

    async def _status_kv(self):
        from nats.js.errors import BucketNotFoundError

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
        rejected = batch.filter(bad).drop_columns([c for c in (PARTITION_COLUMN,) if c in batch.schema.names])
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
    def _route(self, batch: pa.RecordBatch) -> Iterator[tuple[int, pa.RecordBatch]]:
        if batch.num_rows == 0:
            return
        n = self.opts.partitions
        idx = batch.schema.get_field_index(PARTITION_COLUMN)
        if idx < 0:
            yield self.task % n, batch
            return
        col = batch.column(idx)
        data = batch.drop_columns([PARTITION_COLUMN])
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
        msg_id = frame_id(self.opts.step, self.batch_id, self.task, buf.partition, buf.chunk)
        buf.chunk += 1
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
        from nats.js.errors import APIError, NoStreamResponseError

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
        from nats.js.errors import APIError

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
        from nats.js.errors import KeyNotFoundError, NotFoundError

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


# ------------------------------------------------------------------ Spark classes


class JetStreamStreamWriter(DataSourceStreamArrowWriter):
    """Spark's stream writer for the buffers of one edge (module docstring states the contract).

    Created on the driver, pickled to executors. ``task_identity`` returns
    (batch id, task partition id); the default reads the Spark task's context.
    """

    def __init__(self, options: WriterOptions,
                 task_identity: Callable[[], tuple[int, int]] = spark_task_identity):
        self.options = options
        self.task_identity = task_identity

    def write(self, iterator: Iterator[pa.RecordBatch]) -> JetStreamWriteReport:
        """Executor: publish this task's rows as frames; return what was published."""
        batch_id, task = self.task_identity()
        return asyncio.run(_TaskPublisher(self.options, batch_id, task).run(iterator))

    def commit(self, messages: list[JetStreamWriteReport | None], batchId: int) -> None:  # noqa: N803
        """Driver: sum the tasks' counts, log them, write them to ``statsDir`` if set."""
        stats = aggregate_reports(messages, batchId, self.options)
        stats.update(pipeline=self.options.pipeline, step=self.options.step, to=self.options.to)
        log.info("jetstream writer %s -> %s batch %s: %s", self.options.step, self.options.to, batchId,
                 json.dumps(stats))
        if self.options.stats_dir:
            d = Path(self.options.stats_dir)
            d.mkdir(parents=True, exist_ok=True)
            tmp = d / f".batch-{batchId}.json.tmp"
            tmp.write_text(json.dumps(stats, indent=1))
            tmp.replace(d / f"batch-{batchId}.json")

    def abort(self, messages: list[JetStreamWriteReport | None], batchId: int) -> None:  # noqa: N803
        """Driver: a task failed. Frames already published stay; the retried batch republishes
        the same ids, which JetStream drops as duplicates."""
        stats = aggregate_reports(messages, batchId, self.options)
        log.warning("jetstream writer %s -> %s batch %s aborted after %s task(s) published %s frames "
                    "(%s failed); the re-run deduplicates by frame id", self.options.step, self.options.to,
                    batchId, stats["tasks"], stats["frames"], stats["failedTasks"])


_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def stream_writer(options: Mapping[str, str], schema: StructType) -> JetStreamStreamWriter:
    """The writer for a ``streamWriter(schema, overwrite)`` call: options parsed, schema checked."""
    opts = WriterOptions.parse(options)
    if PARTITION_COLUMN in schema.fieldNames():
        dtype = schema[PARTITION_COLUMN].dataType
        if not isinstance(dtype, _INTEGRAL):
            raise ConnectorOptionError(f"column {PARTITION_COLUMN} must be an integer (pmod(xxhash64(key), n)), "
                                       f"got {dtype.simpleString()}")
    return JetStreamStreamWriter(opts)
