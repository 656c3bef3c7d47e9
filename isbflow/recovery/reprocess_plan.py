"""The range a reprocess asks for, parsed and planned: pure functions, no NATS, no Spark session.

Contract: given what the caller typed (offsets or event times) and, for the
planning, what the source streams hold, these functions return the range per
source partition (``<source>/<partition>``, the prefix of ``_isb_id``) or
raise :class:`RangeError` saying what is wrong and what to write instead.
Nothing here reads a stream or a table: :func:`isbflow.recovery.reprocess.reprocess`
fetches the streams' state and calls them.

- :func:`check_asked`: offsets OR event times, parsed (:func:`parse_offsets`,
  :func:`parse_time`) against the pipeline's JetStream source partitions
  (:func:`source_partitions`);
- :class:`Source` and :func:`plan_offsets`: one source partition's readable
  sequences (its stream's first one up to what the source step has committed)
  and the scan of an offset range, checked against them;
- :func:`event_time_column`: the event-time column of a source (its schema's first
  TIMESTAMP column, or the one given, checked);
- :func:`in_ranges`: which ``_isb_id`` values fall inside a range (vectorised).

Also the errors of reprocess: :class:`ReprocessError`, and :class:`RangeError`
for bad input (CLI exit 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from isbflow.spec.models import Pipeline
from isbflow.spec.times import TimeExpressionError, resolve_time

OFFSET_FORMS = ("N (the pipeline's only source partition), <source>:N, <source>/<partition>:N, "
                "or a comma list of the last two, e.g. in/0:100")

OffsetArg = int | str | Mapping[str, int] | None
TimeArg = datetime | str | None


class ReprocessError(Exception):
    """Reprocess could not proceed; the message says which phase, what, and what to do."""


class RangeError(ReprocessError):
    """The range asked for is malformed or cannot be reprocessed (bad input: CLI exit 2)."""


def source_partitions(p: Pipeline) -> list[str]:
    """``<source>/0`` of every JetStream source of ``p`` (a JetStream source is one stream)."""
    return [f"{v.name}/0" for v in p.spec.vertices if v.source is not None and v.source.jetstream is not None]


def _seq(text: Any, where: str) -> int:
    s = str(text).strip()
    if isinstance(text, bool) or not s.isdigit():
        raise RangeError(f"{where}: {text!r} is not a source offset (a sequence number >= 1)")
    n = int(s)
    if n < 1:
        raise RangeError(f"{where}: source offsets start at 1, got {n}")
    return n


def _partition(name: str, partitions: Sequence[str], where: str) -> str:
    name = name.strip()
    part = name if "/" in name else f"{name}/0"
    if part not in partitions:
        raise RangeError(f"{where}: {name!r} is not a source partition of this pipeline "
                         f"(its JetStream source partitions: {', '.join(partitions) or 'none'})")
    return part


def parse_offsets(value: OffsetArg, partitions: Sequence[str], side: str) -> dict[str, int]:
    """``from``/``to`` offsets as ``{<source>/<partition>: seq}`` (``{}`` when not given).

    Forms: an int or digits (the pipeline's only source partition), ``<source>:N``,
    ``<source>/<partition>:N``, a comma list of those, or a mapping of them.
    """
    where = f"{side} offset"
    if value is None or (isinstance(value, str) and not value.strip()):
        return {}
    if isinstance(value, Mapping):
        items = [(str(k), v) for k, v in value.items()]
    elif isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        if len(partitions) != 1:
            raise RangeError(f"{where} {value!r}: a bare sequence needs a pipeline with one source partition; "
                             f"this one has {', '.join(partitions) or 'none'}: write {OFFSET_FORMS}")
        return {partitions[0]: _seq(value, where)}
    elif isinstance(value, str):
        items = []
        for item in value.split(","):
            name, sep, seq = item.strip().rpartition(":")
            if not sep or not name:
                raise RangeError(f"{where} {value!r}: {item.strip()!r} is not one of {OFFSET_FORMS}")
            items.append((name, seq))
    else:
        raise RangeError(f"{where} {value!r}: expected {OFFSET_FORMS}")
    out: dict[str, int] = {}
    for name, seq in items:
        part = _partition(name, partitions, where)
        if part in out:
            raise RangeError(f"{where} {value!r}: partition {part} is named twice")
        out[part] = _seq(seq, f"{where} {part}")
    return out


def parse_time(value: TimeArg, side: str, now: datetime | None = None) -> datetime | None:
    """An event-time bound in UTC: a datetime (naive means UTC) or a time expression
    (:mod:`isbflow.spec.times`: ISO time or date, ``yesterday``, ``-6h``... relative to ``now``)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, datetime):
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    try:
        return resolve_time(str(value).strip(), now or datetime.now(UTC))
    except TimeExpressionError as e:
        raise RangeError(f"{side} time: {e}") from None


def check_asked(p: Pipeline, from_offset: OffsetArg, to_offset: OffsetArg, from_time: TimeArg,
                to_time: TimeArg) -> tuple[dict[str, int], dict[str, int], datetime | None, datetime | None]:
    """The range asked for, parsed: (from offsets, to offsets, from time, to time); RangeError if wrong."""
    by_offsets = from_offset is not None or to_offset is not None
    by_time = from_time is not None or to_time is not None
    if by_offsets and by_time:
        raise RangeError("give a range by source offsets (from/to) OR by event time (from_time/to_time), not both")
    if not (by_offsets or by_time):
        raise RangeError(f"give the range to reprocess: source offsets (from/to: {OFFSET_FORMS}) or event "
                         "times (from_time/to_time)")
    partitions = source_partitions(p)
    if not partitions:
        raise RangeError(f"pipeline {p.name} has no JetStream source: reprocess reads source offsets again from "
                         "a source stream")
    lo_map, hi_map = parse_offsets(from_offset, partitions, "from"), parse_offsets(to_offset, partitions, "to")
    t_lo, t_hi = parse_time(from_time, "from"), parse_time(to_time, "to")
    if t_lo is not None and t_hi is not None and t_lo >= t_hi:
        raise RangeError(f"the event-time range [{t_lo.isoformat()}, {t_hi.isoformat()}) is empty: 'from' must "
                         "lie before 'to'")
    return lo_map, hi_map, t_lo, t_hi


@dataclass
class Source:
    """One source partition of the range: its stream and what may be read of it."""

    vertex: str
    partition: str
    stream: str
    first: int  # the stream's first sequence
    committed: int  # the last sequence the source step has committed (and the stream holds)
    scan: tuple[int, int] = (1, 0)  # the sequences read (inclusive)
    time_column: str | None = None


def plan_offsets(sources: dict[str, Source], lo_map: dict[str, int], hi_map: dict[str, int]) -> None:
    """Set each partition's scan to the asked range, checked against the stream and the committed offset."""
    for part in sorted(set(lo_map) | set(hi_map)):
        s = sources[part]
        lo, hi = lo_map.get(part, s.first), hi_map.get(part, s.committed)
        if lo > hi:
            raise RangeError(f"{part}: the range {lo}..{hi} is empty ('from' must not be after 'to')")
        if lo < s.first:
            raise RangeError(f"{part}: sequences {lo}..{min(hi, s.first - 1)} are no longer in source stream "
                             f"{s.stream} (it starts at {s.first}: removed by its limits or maxAge); "
                             f"start at {s.first} or later")
        if hi > s.committed:
            raise RangeError(f"{part}: 'to' {hi} is past what the pipeline has processed (source step "
                             f"{s.vertex} committed {s.committed} of {s.stream}); reprocessing records the "
                             "pipeline has not processed yet would write them twice: wait until it has, "
                             f"or end the range at {s.committed} or before")
        s.scan = (lo, hi)


def event_time_column(schema, vertex: str, given: str | None) -> str:
    """The event-time column of source ``vertex`` (its Spark ``schema``): ``given`` (checked), else
    the schema's first TIMESTAMP column."""
    from pyspark.sql.types import (  # lazy: Spark, the plan needs none
        TimestampNTZType,
        TimestampType,
    )

    stamps = [f.name for f in schema.fields if isinstance(f.dataType, (TimestampType, TimestampNTZType))]
    if given:
        if given not in schema.fieldNames():
            raise RangeError(f"time column {given!r} is not a column of source {vertex!r} "
                             f"(its schema: {', '.join(schema.fieldNames())})")
        if given not in stamps:
            raise RangeError(f"time column {given!r} of source {vertex!r} is not a TIMESTAMP column")
        return given
    if not stamps:
        raise RangeError(f"source {vertex!r} has no TIMESTAMP column to select event time on "
                         "(source.schema in the spec); reprocess it by source offsets")
    return stamps[0]


def in_ranges(ids: pa.Array | pa.ChunkedArray, rng: Mapping[str, Sequence[Sequence[int]]]) -> np.ndarray:
    """A boolean mask: which ``_isb_id`` values name a sequence inside ``rng`` (vectorised)."""
    if isinstance(ids, pa.ChunkedArray):
        ids = ids.combine_chunks()
    n = len(ids)
    out = np.zeros(n, dtype=bool)
    if n == 0 or not rng:
        return out
    ids = pc.fill_null(ids.cast(pa.string()), "")
    pieces = pc.split_pattern(ids, "/", max_splits=1, reverse=True)
    two = pc.fill_null(pc.equal(pc.list_value_length(pieces), 2), False).to_numpy(zero_copy_only=False)
    padded = pc.if_else(pa.array(two), pieces, pa.scalar(["", ""], pieces.type))
    names = pc.list_element(padded, 0)
    digits = pc.list_element(padded, 1)
    numeric = pc.fill_null(pc.utf8_is_digit(digits), False)
    seq = pc.if_else(numeric, digits, "0").cast(pa.int64()).to_numpy(zero_copy_only=False)
    numeric = numeric.to_numpy(zero_copy_only=False)
    for part, ranges in rng.items():
        if not ranges:
            continue
        mine = pc.equal(names, part).to_numpy(zero_copy_only=False) & numeric
        if not mine.any():
            continue
        los = np.array([r[0] for r in ranges], dtype=np.int64)
        his = np.array([r[1] for r in ranges], dtype=np.int64)
        idx = np.searchsorted(los, seq, side="right") - 1
        hit = (idx >= 0) & (seq <= his[np.clip(idx, 0, None)])
        out |= mine & hit
    return out
