"""What reprocess reads: the sources' state, the range's records again through the current code, the buffers.

Contract: :func:`source_of` reads what a source partition holds and what
its step has committed (a :class:`~isbflow.recovery.reprocess_plan.Source`).
:class:`RangeRows` reads a source partition's range in ONE Spark
batch read (``spark.read.format("jetstream")`` with ``startingOffsets`` and
``endingOffsets``), parses it as the source step does and keeps the well-formed
records of the range (malformed ones are already in the dead-letter buffer;
by event time, those in ``[from, to)`` on the source's time column);
:meth:`RangeRows.output` then gives the range's rows as any vertex outputs
them, the transforms between the source and it run in batch (not through the
buffers). Rows stay cached in Spark until :meth:`RangeRows.close`. Nothing is
written.

:func:`check_in_flight` refuses a range some record of which is still in an
unconsumed frame of a region buffer: it would reach the sinks after their
replacement. It reads each frame through :func:`isbflow.isb.frames.read_frame`;
a frame that read refuses is logged and passed over: the step that consumes it
dead-letters it (:mod:`isbflow.connector.reader`), so its records never reach
a sink.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pyspark.sql import functions as F

from isbflow.isb import frames, ledger, naming
from isbflow.isb import state as st
from isbflow.isb.buffers import read_range, stream_state
from isbflow.recovery.reprocess_plan import RangeError, ReprocessError, Source, in_ranges
from isbflow.spec.models import Pipeline
from isbflow.steps import routing
from isbflow.steps.restart import retry_transient
from isbflow.steps.runner import ERROR_COLUMN

log = logging.getLogger(__name__)


async def source_of(nc, p: Pipeline, part: str) -> Source:
    """Source partition ``part``: its stream's first sequence and the last one its source step has
    committed (and the stream holds). ReprocessError without a stream; RangeError when nothing is
    committed yet."""
    src = part.rpartition("/")[0]
    stream = naming.source_stream(p, src)
    sst = await stream_state(nc, stream)
    if sst is None:
        raise ReprocessError(f"source stream {stream} of {src!r} does not exist: nothing to read again "
                             "(provision and run the pipeline first)")
    committed = await st.get_committed(nc, p.name, src, stream)
    if committed is None:
        raise RangeError(f"source {src!r} has committed nothing of {stream} yet (status key "
                         f"{st.committed_key(src, stream)}): run the pipeline before reprocessing")
    return Source(src, part, stream, max(1, sst.first_seq), min(committed, sst.last_seq))


@dataclass
class SourceRead:
    """What :meth:`RangeRows.read` found in one source partition's scan."""

    scanned: int  # records read
    reread: int  # records of the range (event time: inside [from, to); offsets: every one read)
    #: event time: the sequence ranges of the records inside [from, to) (None: none)
    ranges: ledger.Ranges | None = None


class RangeRows:
    """The range's rows of one reprocess, in batch (module docstring)."""

    def __init__(self, spark, runner):
        self.spark, self.runner, self.p = spark, runner, runner.p
        self.source_rows: dict[str, Any] = {}  # source vertex -> its parsed rows of the range
        self.outs: dict[str, Any] = {}
        self.cached: list[Any] = []
        self.parsed: dict[str, Any] = {}  # source partition -> every record read, parsed

    def read(self, s: Source, t_lo: datetime | None, t_hi: datetime | None, by_time: bool) -> SourceRead:
        """Read ``s.scan`` of source partition ``s``; its rows of the range become ``output(s.vertex)``."""
        lo, hi = s.scan
        events = (self.spark.read.format("jetstream").option("settings", self.runner.settings_json)
                  .option("streams", s.stream).option("mode", "events").option("sourceName", s.vertex)
                  .option("startingOffsets", json.dumps({s.stream: {"seq": lo - 1}}))
                  .option("endingOffsets", json.dumps({s.stream: {"seq": hi}})).load())
        parsed = self.parsed[s.partition] = self._cache(self.runner.apply_transform(s.vertex, events))
        n = retry_transient(parsed.count, f"reading {s.stream}")
        good = parsed.filter(F.col(ERROR_COLUMN).isNull()).drop(ERROR_COLUMN, "_isb_raw")
        self.source_rows[s.vertex] = good
        if not by_time:
            return SourceRead(n, n)
        c = F.col(s.time_column)
        if t_lo is not None:
            good = good.filter(c >= F.lit(t_lo))
        if t_hi is not None:
            good = good.filter(c < F.lit(t_hi))
        good = self.source_rows[s.vertex] = self._cache(good)
        ids = retry_transient(good.select(ledger.ID_COLUMN).toArrow, f"reading {s.stream}").column(ledger.ID_COLUMN)
        return SourceRead(n, len(ids), ledger.id_ranges(ids).get(s.partition))

    def malformed(self, s: Source) -> int:
        """The malformed records :meth:`read` found in ``s`` (skipped: already dead-lettered)."""
        return retry_transient(self.parsed[s.partition].filter(F.col(ERROR_COLUMN).isNotNull()).count,
                               f"counting malformed records of {s.stream}")

    def _cache(self, df):
        df = df.persist()
        self.cached.append(df)
        return df

    def output(self, v: str):
        """The range's rows as vertex ``v`` outputs them (sinks: as they reach it), in batch; None if none."""
        if v not in self.outs:
            vx = self.p.vertex(v)
            if vx.source is not None:
                df = self.source_rows.get(v)
            else:
                # each input as its edge carries it: conditions.tags applied, _tags dropped
                ins = [routing.edge_rows(d, self.p, e) for e in self.p.inputs(v)
                       if (d := self.output(e.from_)) is not None]
                df = None
                for d in ins:
                    df = d if df is None else df.unionByName(d)
                if df is not None and vx.sink is None:
                    df = self.runner.apply_transform(v, df).drop(ERROR_COLUMN, "_isb_raw")
            self.outs[v] = df
        return self.outs[v]

    def close(self) -> None:
        for df in self.cached:
            try:
                df.unpersist()
            except Exception:  # noqa: BLE001 - best effort on the way out
                log.debug("unpersist failed", exc_info=True)


async def check_in_flight(nc, p: Pipeline, region: set[str], rng: ledger.PartitionRanges) -> None:
    """Refuse when an unconsumed frame of a region buffer carries an id of the range."""
    for ep in naming.edge_partitions(p):
        if ep.from_vertex not in region:
            continue
        sst = await stream_state(nc, ep.stream)
        if sst is None or sst.last_seq == 0:
            continue
        done = await st.get_committed(nc, p.name, ep.to_vertex, ep.stream) or 0
        first = max(done + 1, sst.first_seq)
        if first > sst.last_seq:
            continue
        hits = 0
        async for msgs in read_range(nc, ep.stream, first, sst.last_seq, on_gap=lambda a, b: None):
            for seq, data, headers, _ in msgs:
                try:
                    batches = frames.read_frame(data, headers.get(frames.HDR_ROWS))
                except frames.BadFrame as e:
                    log.warning("frame %d of buffer %s cannot be read: %s; passed over (%s dead-letters it, "
                                "its records never reach a sink)", seq, ep.stream, e, ep.to_vertex)
                    continue
                for b in batches:
                    if ledger.ID_COLUMN in b.schema.names:
                        hits += int(in_ranges(b.column(ledger.ID_COLUMN), rng).sum())
        if hits:
            raise ReprocessError(
                f"{hits} record(s) of the range are still in flight in buffer {ep.stream} ({ep.from_vertex} -> "
                f"{ep.to_vertex}, sequences {first}..{sst.last_seq} not yet committed by {ep.to_vertex}): "
                "they would reach the sinks after the replacement. Let the pipeline process them (or drain "
                "it), then run reprocess again")
