"""The ``jetstream`` Spark data source: read inter-step buffers and JetStream event streams.

Usage (``spark.dataSource.register(JetStreamDataSource)`` once per session; the class is in
:mod:`isbflow.connector.source`, which imports this module only when a reader is made)::

    spark.readStream.format("jetstream")
        .option("streams", "isb-logs-in-parse-0,isb-logs-in-parse-1")
        .option("mode", "frames")                   # or "events"
        .option("settings", settings_to_json(nats_settings))
        .schema(upstream_schema)                    # frames mode only
        .load()

Options (strings, see :class:`isbflow.connector.options.ReaderOptions`):

- ``streams``: the streams to read, one per partition; a stream's index in this
  list is its partition number (in ``_isb_id``);
- ``mode``: ``frames`` (internal edge: each message is an Arrow IPC frame of the
  given schema, see :mod:`isbflow.isb.frames`) or ``events`` (external source:
  each message is one event, schema :data:`EVENTS_SCHEMA`, the payload as
  ``value`` for ``from_json`` and ids ``_isb_id = <sourceName>/<partition>/<seq>``);
- ``settings``: NatsSettings JSON (default: resolved from the environment);
- ``readMaxRows`` (default ``limits.readBatchSize``, 100000): the default read
  limit; in frames mode converted to ``ceil(readMaxRows / frameRows)`` frames
  (``frameRows``, default 10000, is the writer's max rows per frame);
- ``startingOffsets``: ``earliest`` (default), ``latest`` or offsets JSON
  (:mod:`isbflow.connector.offsets`), e.g. to rewind for recovery; used only by a
  query without a checkpoint, like Kafka's;
- ``onBufferLoss``: ``fail`` (default) or ``replay``;
- ``maxMessagesPerPartition``: messages per Spark task (default 100 frames or
  50000 events);
- ``minPartitions`` (default 1; a written-through Delta sink's read: its session's
  task slots): a batch is read by at least this many tasks, each of at least 4
  frames or 5000 events (Kafka's ``minPartitions``), so a large batch of one
  buffer partition keeps every core busy where a task reads and writes in one
  Python process, while a small batch stays one task. Where the task's rows go
  on into the JVM, its Python read and the JVM's work already run side by side
  (events into Delta, 200K events in batches of 40K: 50.0K rec/s in one task a
  batch, 45.7K in two; one run each);
- ``replicasFile``: a file holding the step's replicas now, an integer its autoscaler rewrites
  (:mod:`isbflow.steps.autoscale_apply`): each batch is planned with at least that many tasks,
  as with ``minPartitions`` (read when the batch is planned; missing or unreadable: 1);
- ``idleWait`` (seconds, default 0): a streaming trigger that finds nothing new
  waits this long for a stream to grow and then reads at once (event-driven steps,
  :mod:`isbflow.isb.wait`; ``Limits`` streams only, never under availableNow or
  while draining); ``noWaitFile``: while this file exists it does not wait (the
  runner creates it before it drains or stops the step);
- batch reads (``spark.read``) only: ``endingOffsets`` (``latest`` or JSON).

Memory per task is bounded in bytes, not only in messages: the range read holds at
most :func:`isbflow.isb.read.read_bound` bytes (48 MiB with the defaults), and events
mode yields Arrow batches of at most ``EVENTS_BATCH_ROWS`` rows or
``EVENTS_BATCH_BYTES`` (64 MiB) of payload, whichever comes first.

Contract: the source is *replayable*. An offset range names exact sequences of
exact stream incarnations, and ``read`` returns exactly those messages or fails,
so reading a range twice gives the same rows; this is what makes Spark's
checkpoint exactly-once. Nothing here acknowledges or deletes: space is released
by :func:`isbflow.isb.release.release` after the *downstream* commit.

Bad frames (frames mode): a message that is not a readable frame (any frame
:func:`isbflow.isb.frames.read_frame` refuses: not an Arrow IPC stream, one that
would decode past its cap, a column that takes no bytes per record, more
records than its bytes can hold, buffers that fail full validation, an
``Isb-Rows`` header that is not its row count) does not stop the step. With the
``pipeline`` and ``vertex`` options set (the runner sets them), the task sends
it to the dead-letter buffer (:mod:`isbflow.isb.dlq`) on
``dlq_subject(pipeline, vertex)`` with the reason, the stream, the sequence and
the payload's first KiB (``Nats-Msg-Id`` ``<vertex>:frame:<stream>:<inc>:<seq>``, so a
retried task adds no second letter), counts it in the status KV key
``deadframes.<vertex>`` (:func:`dead_frames`; the runner adds it to the step's
``dlq_total``) and reads on. Without those options it fails the task with
:class:`~isbflow.isb.errors.BufferReadError` (nowhere to put it). A readable
frame of another schema still fails the step: that is a deployment mismatch,
and dead-lettering every frame would drop the data.

Buffer loss (a stream missing, recreated, or whose first sequence moved past an
offset not yet read) raises :class:`~isbflow.isb.errors.BufferLost`
naming the stream and range with ``onBufferLoss=fail``; with ``replay`` the
source logs it, records it in the offset (``lost``) and continues from what the
stream holds now.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from isbflow.connector import offsets as off
from isbflow.connector.batches import (  # noqa: F401
    EVENTS_BATCH_BYTES,
    EVENTS_BATCH_ROWS,
    EVENTS_SCHEMA,
    arrow_schema,
    conform,
    events_batch,
    events_batches,
)
from isbflow.connector.offsets import StreamOffset
from isbflow.connector.options import MIN_SPLIT_MSGS, ReaderOptions
from isbflow.isb import dlq, frames
from isbflow.isb.buffers import StreamState, read_partition, stream_state, wait_for_append
from isbflow.isb.connect import NatsSettings, SyncSession, run_with
from isbflow.isb.dlq import add_dead_frames, dead_frames, dead_frames_key  # noqa: F401 - re-exported
from isbflow.isb.errors import (
    BufferLost,
    BufferNotFound,
    BufferReadError,
    ConnectorOptionError,
)
from isbflow.isb.state import get_drain_point

log = logging.getLogger(__name__)

#: Bytes of a bad frame's payload kept in its dead letter (enough to see what it was).
BAD_FRAME_PREFIX = 1024
#: seconds a trigger that waited for new data lingers before reading, so the rest of the upstream
#: micro-batch's frames (its other tasks and partitions) come in the same batch
LINGER = 0.1


class JetStreamPartition(InputPartition):
    """One Spark task: sequences ``first..last`` of one incarnation of one stream (picklable)."""

    def __init__(self, stream: str, index: int, inc: str, first: int, last: int):
        super().__init__((stream, first, last))
        self.stream, self.index, self.inc, self.first, self.last = stream, index, inc, first, last

    def __repr__(self) -> str:
        return f"JetStreamPartition({self.stream}#{self.index} {self.first}..{self.last} inc={self.inc})"


class _Link(SyncSession):
    """A driver-side connection: its own event loop and client, opened on first use."""

    def __init__(self, settings: NatsSettings):
        super().__init__(settings, name="isbflow-source")
        self._warned = -60.0

    def states(self, streams: Sequence[str]) -> dict[str, StreamState | None]:
        async def all_states(nc):
            return await asyncio.gather(*(stream_state(nc, s) for s in streams))

        return dict(zip(streams, self.run(all_states), strict=True))

    def wait_for_append(self, after: dict[str, int], timeout: float, cancelled) -> bool:
        """:func:`isbflow.isb.wait.wait_for_append` on this connection; True (look again) when
        the wait itself fails."""
        try:
            return self.run(lambda nc: wait_for_append(nc, after, timeout, cancelled))
        except Exception as e:  # noqa: BLE001 - a wait is an optimisation: the trigger reads as before
            now = time.monotonic()
            if now - self._warned >= 60:  # tried each trigger: say so once a minute
                self._warned = now
                log.warning("waiting for new data on %s failed (%s); reading on", ", ".join(after), e)
            return True

    def drain_point(self, pipeline: str, vertex: str) -> dict[str, int] | None:
        """The end offsets frozen for a draining step (stream -> last seq), or None."""

        point = self.run(lambda nc: get_drain_point(nc, pipeline, vertex))
        return {s: int(v) for s, v in point.items()} if point else None


class _RangeReader:
    """What the stream and batch readers share: options, planning tasks, reading them."""

    def __init__(self, opts: ReaderOptions, schema: StructType):
        self.opts = opts
        self.schema = schema
        self._link: _Link | None = None

    # The reader is pickled to executors for read(): never ship the driver's connection.
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_link": None}

    def _states(self) -> dict[str, StreamState | None]:
        if self._link is None:
            self._link = _Link(self.opts.settings)
        return self._link.states(self.opts.streams)

    def stop(self) -> None:
        """Driver, when the query ends: close the driver's connection."""
        if self._link is not None:
            self._link.close()
            self._link = None

    def _start_offsets(self, states: dict[str, StreamState | None]) -> off.Offsets:
        """Where a reader without a checkpoint starts (``startingOffsets``)."""
        given = self.opts.starting_offsets
        out: off.Offsets = {}
        for s in self.opts.streams:
            st = states[s]
            if isinstance(given, dict) and s in given:
                out[s] = StreamOffset.from_json({"inc": st.incarnation if st else "", **given[s]})
                continue
            if st is None:
                raise BufferNotFound(s)
            # an empty new stream reports first_seq 0: start at 0, not -1
            seq = st.last_seq if given == "latest" else max(0, st.first_seq - 1)
            out[s] = StreamOffset(st.incarnation, seq)
        return out

    def _plan(self, start: off.Offsets, end: off.Offsets) -> list[JetStreamPartition]:
        """Driver: split each stream's batch range into tasks of at most ``partition_msgs`` messages,
        smaller ones when that gives fewer than ``min_partitions`` tasks (:func:`off.task_size`)."""
        ranges = [(index, s, end[s], *off.batch_range(start.get(s), end[s]))
                  for index, s in enumerate(self.opts.streams) if s in end]
        step = off.task_size([last - first + 1 for *_, first, last in ranges], self.opts.partition_msgs,
                             max(self.opts.min_partitions, off.replicas(self.opts.replicas_file)),
                             MIN_SPLIT_MSGS[self.opts.mode])
        return [JetStreamPartition(s, index, e.inc, lo, min(lo + step - 1, last))
                for index, s, e, first, last in ranges for lo in range(first, last + 1, step)]

    def read(self, partition: JetStreamPartition) -> Iterator[pa.RecordBatch]:
        """Executor: the records of exactly ``partition``'s sequences, as Arrow batches.

        Stateless (connects, reads, disconnects). A missing sequence or a changed
        incarnation raises :class:`BufferLost`; with ``onBufferLoss=replay`` what
        is missing is logged and skipped (a recreated stream yields nothing: its
        sequences belong to other records).
        """
        p = partition
        replay = self.opts.on_buffer_loss == "replay"

        def on_gap(a: int, b: int) -> None:
            log.warning("%s; skipped (onBufferLoss=replay)", BufferLost(
                p.stream, a, b, "messages missing inside the read range").summary)

        def on_recreated(reason: str) -> None:
            log.warning("%s; skipped (onBufferLoss=replay)",
                        BufferLost(p.stream, p.first, p.last, reason).summary)

        chunks = read_partition(self.opts.settings, p.stream, p.inc, p.first, p.last,
                                on_gap=on_gap if replay else None,
                                on_recreated=on_recreated if replay else None,
                                prefer_consumer=self.opts.mode == "events",
                                keep_headers=self.opts.mode != "events")
        target = arrow_schema(self.schema)
        if self.opts.mode == "frames":
            bad: list[dlq.DeadLetter] = []
            for msgs in chunks:
                for seq, data, headers, _ in msgs:
                    try:
                        batches = frames.read_frame(data, headers.get(frames.HDR_ROWS))
                    except frames.BadFrame as e:
                        bad.append(self._bad_frame(p, seq, data, headers, str(e)))
                        continue
                    yield from conform(p.stream, seq, batches, target)
            if bad:
                self._dead_letter(bad)
        else:
            prefix = f"{self.opts.source_name}/{p.index}/"
            for msgs in chunks:
                yield from events_batches(msgs, p.stream, prefix, target)


    def _bad_frame(self, p: JetStreamPartition, seq: int, data: bytes, headers: dict, why: str) -> dlq.DeadLetter:
        """Executor: the dead letter of an unreadable frame, or BufferReadError with nowhere to put it."""
        pipeline, vertex = self.opts.drain_pipeline, self.opts.drain_vertex
        if not (pipeline and vertex):
            raise BufferReadError(f"buffer {p.stream}: message {seq} is not a readable frame: {why}; is this an "
                                  "events stream (mode=events)? (with the options 'pipeline' and 'vertex' it "
                                  "would go to the dead-letter buffer)")
        reason = f"frame {seq} of buffer {p.stream} cannot be read at step {vertex}: {why}"
        log.warning("%s; dead-lettered, the step reads on", reason)
        keep = ("Nats-Msg-Id", frames.HDR_FRAME, frames.HDR_ROWS)
        record = {"stream": p.stream, "seq": seq, "incarnation": p.inc, "bytes": len(data),
                  "headers": {k: str(headers[k])[:256] for k in keep if k in headers},
                  "payloadPrefix": bytes(data[:BAD_FRAME_PREFIX])}
        return dlq.DeadLetter(record=record, reason=reason, size=len(data),
                              msg_id=f"{vertex}:frame:{p.stream}:{p.inc}:{seq}")

    def _dead_letter(self, letters: list[dlq.DeadLetter]) -> None:
        """Executor: publish the task's bad frames (acked; a missing dead-letter buffer fails the
        task, a frame never vanishes silently) and count those stored anew."""
        pipeline, vertex = self.opts.drain_pipeline, self.opts.drain_vertex
        assert pipeline and vertex

        async def go(nc) -> None:
            stored = await dlq.publish_dead_letters(dlq.dead_letter_target(nc), pipeline, vertex, letters)
            if stored:
                await add_dead_frames(nc, pipeline, vertex, stored)

        run_with(self.opts.settings, go, name=f"isbflow-dlq-{pipeline}-{vertex}")


class JetStreamStreamReader(_RangeReader, DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The streaming reader. ``initialOffset``, ``latestOffset``, ``partitions``,
    ``prepareForTriggerAvailableNow``, ``commit`` and ``stop`` run on the driver;
    ``read`` runs in executor tasks on a pickled copy."""

    def __init__(self, opts: ReaderOptions, schema: StructType):
        super().__init__(opts, schema)
        #: availableNow: the end offsets frozen by prepareForTriggerAvailableNow
        self._target: off.Offsets | None = None
        #: stream -> (incarnation, last_seq) last observed, to name lost ranges
        self._seen: dict[str, tuple[str, int]] = {}
        #: losses already logged under onBufferLoss=replay while a stream is missing
        self._reported: set[tuple[str, str]] = set()

    def initialOffset(self) -> dict:
        """Driver: each stream's first sequence - 1, or ``startingOffsets``."""
        return off.to_json(self._start_offsets(self._states()))

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.opts.read_max_rows)

    def prepareForTriggerAvailableNow(self) -> None:
        """Driver, once at the start of an availableNow run: freeze the end offsets."""
        self._target = {s: StreamOffset(st.incarnation, st.last_seq)
                        for s, st in self._states().items() if st is not None}

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        """Driver: the end of the next batch: what the streams hold, capped by ``limit``.

        Detects buffer loss against ``start`` (see module doc). ``ReadMaxRows(n)``
        admits ``n`` events or ``ceil(n / frameRows)`` frames, shared fairly across
        streams (at least one message for every stream with data); ``ReadAllAvailable``
        admits everything. Under availableNow never past the frozen target. Returns
        ``start`` unchanged when there is nothing new, after waiting up to ``idleWait``
        seconds for a stream to grow (then it reads at once; :mod:`isbflow.isb.wait`).
        """
        end, draining = self._latest(start, limit)
        if end == start and self.opts.idle_wait > 0 and self._target is None and not draining \
                and not self._told_not_to_wait():
            after = {s: self._seen[s][1] for s in self.opts.streams if s in self._seen}
            assert self._link is not None
            if after and self._link.wait_for_append(after, self.opts.idle_wait, self._told_not_to_wait):
                time.sleep(LINGER)  # the rest of the upstream batch's frames, so they come in one batch
                end, _ = self._latest(start, limit)
        return end

    def _told_not_to_wait(self) -> bool:
        return self.opts.no_wait_file is not None and os.path.exists(self.opts.no_wait_file)

    def _latest(self, start: dict, limit: ReadLimit) -> tuple[dict, bool]:
        """:meth:`latestOffset` without waiting; and whether a drain point caps it."""
        begin = off.from_json(start)
        states = self._states()
        drain = None
        if self.opts.drain_pipeline and self.opts.drain_vertex:
            assert self._link is not None
            drain = self._link.drain_point(self.opts.drain_pipeline, self.opts.drain_vertex)
        bases: dict[str, StreamOffset] = {}
        available: dict[str, int] = {}
        for s in self.opts.streams:
            st, so = states[s], begin.get(s)
            base = self._base(s, st, so)
            if base is None:  # missing stream under replay: stay where we are
                if so is not None:
                    bases[s] = so
                available[s] = 0
                continue
            bases[s] = base
            hi = st.last_seq
            t = self._target.get(s) if self._target is not None else None
            if self._target is not None:
                hi = min(hi, t.seq) if t is not None and t.inc == base.inc else base.seq
            if drain is not None and s in drain:  # draining: never past the frozen point
                hi = min(hi, drain[s])
            available[s] = max(0, hi - base.seq)
            self._seen[s] = (st.incarnation, st.last_seq)
        if isinstance(limit, ReadMaxRows):
            # every stream with data advances in every batch (one message at least): a stream read to
            # its end before the others runs ahead in event time, and a watermark downstream then
            # drops the others' records as late
            cap = max(self.opts.max_messages(limit.max_rows), sum(1 for n in available.values() if n > 0))
            take = off.fair_share(available, cap)
        elif isinstance(limit, ReadAllAvailable) or limit is None:
            take = available
        else:  # Spark only passes the default limit or ReadAllAvailable
            take = available
        end: off.Offsets = {}
        for s, base in bases.items():
            so = begin.get(s)
            if take.get(s, 0) == 0 and base.rebased_from is None and so is not None:
                end[s] = so  # unchanged, keys and all, so an idle source returns `start`
            else:
                end[s] = StreamOffset(base.inc, base.seq + take.get(s, 0), base.rebased_from, base.lost)
        return off.to_json(end), drain is not None

    def _base(self, s: str, st: StreamState | None, so: StreamOffset | None) -> StreamOffset | None:
        """Where stream ``s`` continues from: ``so``, or past a loss (replay) / raise (fail)."""
        if so is None:  # a stream added to `streams` since the checkpoint: start at its beginning
            if st is None:
                raise BufferNotFound(s)
            return StreamOffset(st.incarnation, max(0, st.first_seq - 1), rebased_from=max(0, st.first_seq - 1))
        seen_inc, seen_last = self._seen.get(s, (None, None))
        # the old incarnation's last sequence, when observed and beyond the offset
        old_last = seen_last if seen_inc == so.inc and seen_last > so.seq else None
        fully_read = seen_inc == so.inc and seen_last <= so.seq
        if st is None:
            loss = BufferLost(s, so.seq + 1, old_last, "the stream no longer exists")
        elif st.incarnation != so.inc:
            if fully_read:
                # everything of the old incarnation was read: nothing lost, follow the new one
                return StreamOffset(st.incarnation, max(0, st.first_seq - 1), rebased_from=max(0, st.first_seq - 1))
            loss = BufferLost(s, so.seq + 1, old_last,
                              f"the stream was recreated (incarnation {so.inc} is gone, new "
                              f"incarnation {st.incarnation} starts at sequence {st.first_seq})")
        elif st.first_seq > so.seq + 1:
            loss = BufferLost(s, so.seq + 1, st.first_seq - 1,
                              "the stream's first sequence moved past the offset not yet read "
                              "(removed by its limits, a purge or its retention policy)")
        else:
            return so if so.rebased_from is None and so.lost is None else StreamOffset(so.inc, so.seq)
        if self.opts.on_buffer_loss == "fail":
            raise loss
        if st is None:
            if (s, so.inc) not in self._reported:
                self._reported.add((s, so.inc))
                log.warning("%s; waiting for the stream to be recreated (onBufferLoss=replay)",
                            loss.summary)
            return None
        log.warning("%s; continuing from sequence %d of incarnation %s (onBufferLoss=replay)",
                    loss.summary, st.first_seq, st.incarnation)
        lost = {"first": loss.lost_first, "last": loss.lost_last, "reason": loss.reason}
        return StreamOffset(st.incarnation, st.first_seq - 1, rebased_from=st.first_seq - 1, lost=lost)

    def partitions(self, start: dict, end: dict) -> Sequence[InputPartition]:
        """Driver: the tasks reading ``(start, end]``, each at most ``maxMessagesPerPartition``."""
        return self._plan(off.from_json(start), off.from_json(end))

    def commit(self, end: dict) -> None:
        """Driver. Deliberately a no-op: not an acknowledgement.

        Spark calls it a batch late (after the next ``latestOffset``), never for
        the last batch of an availableNow run, and not again after a restart, and
        it says nothing about the *downstream* commit. Buffer space is released by
        :func:`isbflow.isb.release.release` after the downstream commit."""


class JetStreamBatchReader(_RangeReader, DataSourceReader):
    """``spark.read.format("jetstream")``: one fixed range, ``startingOffsets`` to
    ``endingOffsets`` (default: earliest to latest), e.g. to replay or inspect a buffer."""

    def __init__(self, opts: ReaderOptions, schema: StructType):
        super().__init__(opts, schema)
        states = self._states()
        try:
            start = self._start_offsets(states)
            given = opts.ending_offsets
            end: off.Offsets = {}
            for s in opts.streams:
                if isinstance(given, dict) and s in given:
                    end[s] = StreamOffset.from_json({"inc": start[s].inc, **given[s]})
                elif states[s] is None:
                    raise BufferNotFound(s)
                else:
                    end[s] = StreamOffset(states[s].incarnation, states[s].last_seq)
                if end[s].inc != start[s].inc:
                    raise ConnectorOptionError(
                        f"startingOffsets and endingOffsets name different incarnations of {s}")
            self._parts = self._plan(start, end)
        finally:
            self.stop()

    def partitions(self) -> Sequence[InputPartition]:
        return self._parts or [JetStreamPartition("", -1, "", 1, 0)]

    def read(self, partition: JetStreamPartition) -> Iterator[pa.RecordBatch]:
        if partition.index < 0:  # Spark asks for at least one partition
            return iter(())
        return super().read(partition)


