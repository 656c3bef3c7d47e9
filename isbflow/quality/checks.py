"""Built-in checks every sink gets, computed with Spark on the sink's current version.

Each check returns a :class:`CheckResult` (pass/fail, how many things are
wrong, a few samples). What each one means:

- **completeness** (sinks with ``_isb_id``): the sink holds every record it must.
  Ids are ``<source>/<partition>/<seq>``. With the offset ledger
  (:func:`ledger_completeness`, the basis a ``quality run`` uses when the ISB
  service answers): per source partition, every offset from the source stream's
  first one up to the **committed low watermark** (the offset every step from
  the source to the sink has committed, :mod:`isbflow.quality.basis`), plus
  every offset the ledger records as committed, minus dead letters. What lies
  past the watermark and is not in the sink is *in flight*: counted, the oldest
  named with its age, never a failure. ``unexpected_count`` is the number of
  missing offsets (each a real loss), samples name them; ``details["proven"]``
  is, per partition, the ranges proven held. Without the ISB service the
  fallback basis, :class:`SinkOffsetBasis`, takes the sink's own ``min..max``
  seq (holes only; a missing tail is not seen, records in flight below the
  newest id count as missing) and says so.
- **uniqueness** of ``_isb_id`` runs in GX (:mod:`isbflow.quality.gx`); its
  ``unexpected_count`` is the number of surplus rows (:func:`duplicate_ids`:
  17 copies of rows are 17, however GX counts them).
- **schema**: the sink's columns and types equal the expected schema (the
  upstream step's output); column order and nullability are not compared.
  ``unexpected_count`` is the number of differing columns.
- **freshness**: the newest event time (``ts``; ``window_end`` for
  aggregates) is at most ``max_lag`` seconds before ``now`` (injectable).
- **windows** (aggregate sinks: no ``_isb_id``, a ``window_start``): windows
  are recounted from the raw sink once **closed** (:class:`~isbflow.quality.basis.WindowClosure`):
  the aggregating step's event-time watermark has passed their end and the sink
  has committed what that step emitted up to then. A sample of closed windows is
  recomputed, counting distinct ``_isb_id`` per key with
  ``window_start <= ts < window_end``; ``unexpected_count`` is the number of
  closed windows whose count differs. Open windows, and closed ones whose
  aggregate exceeds the recount by no more than the records still in flight to
  the raw sink, are *pending* (counted, a few named), never a failure. A
  difference means the aggregate is wrong, or late events reached the raw sink
  after the watermark had passed.

Timestamps are read as epoch microseconds and reported in ISO 8601 UTC, so
neither the Python process nor the Spark session time zone changes a result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from isbflow.isb import ledger
from isbflow.isb.ledger import ID_COLUMN, CommittedWatermark, PartitionRanges, Ranges

SAMPLE_SIZE = 5
_ID_RE = r"^(.*)/([0-9]+)$"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

SinkKind = Literal["raw", "aggregate", "other"]


@dataclass
class CheckResult:
    """One check's outcome as a report keeps it."""

    name: str
    success: bool
    unexpected_count: int = 0
    samples: list[Any] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    origin: Literal["builtin", "spec"] = "builtin"
    engine: Literal["spark", "gx"] = "spark"
    kwargs: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None  # why the check did not apply (then success is True)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def skipped(name: str, reason: str) -> CheckResult:
    return CheckResult(name, True, skipped=reason)


def sink_kind(columns: Iterable[str]) -> SinkKind:
    """``raw`` (has ``_isb_id``), ``aggregate`` (no id, has ``window_start``), else ``other``."""
    cols = set(columns)
    if ID_COLUMN in cols:
        return "raw"
    if "window_start" in cols:
        return "aggregate"
    return "other"


def iso(micros: int | None) -> str | None:
    return None if micros is None else (_EPOCH + timedelta(microseconds=micros)).isoformat()


# ------------------------------------------------------------------ completeness


class OffsetBasis(Protocol):
    """Where completeness gets the range a sink must hold and the ids allowed to be absent."""

    def ranges(self, observed: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        """Expected ``first..last`` seq (inclusive) per ``<source>/<partition>``,
        given what the sink holds (``observed``: its min/max seq per stream)."""
        ...

    def excluded(self) -> set[str]:
        """Ids that legitimately are not in the sink (dead-lettered)."""
        ...


@dataclass(frozen=True)
class SinkOffsetBasis:
    """The fallback basis: the sink's own ``min..max`` per stream, minus dead-lettered ids.

    Holes are found; records missing after the sink's newest id are not, and
    records in flight below it count as missing (the ledger's basis,
    :func:`ledger_completeness`, knows the committed end).
    """

    dead_letter_ids: frozenset[str] = frozenset()
    #: why this basis and not the ledger's (shown in the report)
    note: str = ""

    def ranges(self, observed: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        return dict(observed)

    def excluded(self) -> set[str]:
        return set(self.dead_letter_ids)


def split_id(isb_id: str) -> tuple[str, int] | None:
    """``"in/0/17"`` -> ``("in/0", 17)``; None when not in that form."""
    stream, _, seq = isb_id.rpartition("/")
    return (stream, int(seq)) if stream and seq.isdigit() else None


def _parsed_ids(df):
    from pyspark.sql import functions as F  # lazy: pyspark (0.3-1 s); module loads without it

    return df.select(F.col(ID_COLUMN).alias("id"),
                     F.regexp_extract(ID_COLUMN, _ID_RE, 1).alias("stream"),
                     F.regexp_extract(ID_COLUMN, _ID_RE, 2).alias("seq_text"))


def offset_ranges(df) -> dict[str, tuple[int, int, int]]:
    """Per ``<source>/<partition>``: (min seq, max seq, distinct seqs) the sink holds."""
    from pyspark.sql import functions as F  # lazy: pyspark (0.3-1 s); module loads without it

    rows = (_parsed_ids(df).filter(F.col("seq_text") != "")
            .groupBy("stream").agg(F.min(F.col("seq_text").cast("long")).alias("lo"),
                                   F.max(F.col("seq_text").cast("long")).alias("hi"),
                                   F.countDistinct(F.col("seq_text").cast("long")).alias("n"))
            .collect())
    return {r["stream"]: (int(r["lo"]), int(r["hi"]), int(r["n"])) for r in rows}


def completeness(df, basis: OffsetBasis, observed: Mapping[str, tuple[int, int, int]] | None = None
                 ) -> CheckResult:
    """Missing ids per stream: expected range, minus ids present, minus dead-lettered ids."""
    from pyspark.sql import Window  # lazy: pyspark (0.3-1 s); module loads without it
    from pyspark.sql import functions as F

    observed = offset_ranges(df) if observed is None else observed
    expected = basis.ranges({s: (lo, hi) for s, (lo, hi, _) in observed.items()})
    parsed = _parsed_ids(df)
    malformed = parsed.filter(F.col("seq_text") == "").count()
    seq = F.col("seq_text").cast("long")
    if any(expected.get(s) != (lo, hi) for s, (lo, hi, _) in observed.items()) or set(expected) - set(observed):
        # the basis's ranges differ from what the sink holds: count inside them
        in_range = F.lit(False)
        for s, (lo, hi) in expected.items():
            in_range = in_range | ((F.col("stream") == s) & seq.between(lo, hi))
        counts = {r["stream"]: int(r["n"]) for r in parsed.filter(in_range).groupBy("stream")
                  .agg(F.countDistinct(seq).alias("n")).collect()}
    else:
        counts = {s: n for s, (_, _, n) in observed.items()}
    excluded: dict[str, set[int]] = {}
    for i in basis.excluded():
        p = split_id(i)
        if p and p[0] in expected and expected[p[0]][0] <= p[1] <= expected[p[0]][1]:
            excluded.setdefault(p[0], set()).add(p[1])
    present_excluded: set[tuple[str, int]] = set()
    if excluded:
        spark = df.sparkSession
        wanted = spark.createDataFrame([(f"{s}/{q}",) for s, qs in excluded.items() for q in qs], "id string")
        for r in parsed.join(F.broadcast(wanted), "id").select("stream", "seq_text").distinct().collect():
            present_excluded.add((r["stream"], int(r["seq_text"])))
    missing: dict[str, int] = {}
    for s, (lo, hi) in expected.items():
        absent_excluded = sum(1 for q in excluded.get(s, ()) if (s, q) not in present_excluded)
        m = (hi - lo + 1) - counts.get(s, 0) - absent_excluded
        if m:
            missing[s] = m
    samples: list[str] = []
    if missing:
        gaps: list[tuple[str, int, int]] = []
        for s, (lo, hi) in expected.items():
            olo, ohi = observed.get(s, (hi + 1, lo - 1, 0))[:2]
            if olo > lo:
                gaps.append((s, lo, min(hi, olo - 1)))
            if ohi < hi and ohi >= lo:
                gaps.append((s, ohi + 1, hi))
        w = Window.partitionBy("stream").orderBy("seq")
        inner = (parsed.filter(F.col("stream").isin(list(missing))).select("stream", seq.alias("seq")).distinct()
                 .withColumn("prev", F.lag("seq").over(w)).filter(F.col("seq") - F.col("prev") > 1)
                 .orderBy("stream", "seq").limit(200).collect())
        gaps.extend((r["stream"], int(r["prev"]) + 1, int(r["seq"]) - 1) for r in inner)
        for s, a, b in sorted(gaps):
            for q in range(a, b + 1):
                if q not in excluded.get(s, ()) and len(samples) < SAMPLE_SIZE:
                    samples.append(f"{s}/{q}")
            if len(samples) >= SAMPLE_SIZE:
                break
    total = sum(missing.values())
    return CheckResult(
        "completeness", total == 0 and malformed == 0, total + malformed, samples,
        {"ranges": {s: list(r) for s, r in sorted(expected.items())}, "missing": missing,
         "dead_lettered": sum(len(v) for v in excluded.values()), "malformed_ids": malformed,
         "basis": type(basis).__name__, **({"basis_note": basis.note} if getattr(basis, "note", "") else {})},
    )


# ------------------------------------------------------------------ completeness on the offset ledger


def present_ranges(df) -> tuple[PartitionRanges, int]:
    """(per ``<source>/<partition>``, the ranges of seqs the sink holds; how many ids are malformed)."""
    from pyspark.sql import Window  # lazy: pyspark (0.3-1 s); module loads without it
    from pyspark.sql import functions as F

    parsed = _parsed_ids(df)
    malformed = parsed.filter(F.col("seq_text") == "").count()
    ids = (parsed.filter(F.col("seq_text") != "")
           .select("stream", F.col("seq_text").cast("long").alias("seq")).distinct())
    islands = (ids.withColumn("g", F.col("seq") - F.row_number().over(Window.partitionBy("stream").orderBy("seq")))
               .groupBy("stream", "g").agg(F.min("seq").alias("lo"), F.max("seq").alias("hi")))
    acc: dict[str, list] = {}
    for r in islands.collect():
        acc.setdefault(r["stream"], []).append([int(r["lo"]), int(r["hi"])])
    return {s: ledger.normalize(r) for s, r in sorted(acc.items())}, malformed


def duplicate_ids(df) -> tuple[int, int, list[str]]:
    """(surplus rows: rows less distinct ids, ids held more than once, a few of them)."""
    from pyspark.sql import functions as F  # lazy: pyspark (0.3-1 s); module loads without it

    dup = df.filter(F.col(ID_COLUMN).isNotNull()).groupBy(ID_COLUMN).count().filter(F.col("count") > 1)
    row = dup.agg(F.sum(F.col("count") - 1).alias("extra"), F.count(F.lit(1)).alias("ids")).first()
    extra, n = int(row["extra"] or 0), int(row["ids"] or 0)
    samples = [r[ID_COLUMN] for r in dup.orderBy(ID_COLUMN).limit(SAMPLE_SIZE).collect()] if n else []
    return extra, n, samples


@dataclass
class PartitionVerdict:
    """One source partition judged against the ledger (:func:`judge_partition`)."""

    partition: str
    #: every offset from the source stream's first up to here must be in the sink (None: source unknown)
    watermark: int | None
    watermark_from: str
    required: Ranges
    missing: Ranges
    proven: Ranges
    in_flight: Ranges
    dead_lettered: int
    source: tuple[int, int] | None = None  # the source stream's first and last sequence

    def to_json(self, in_flight_age: float | None = None) -> dict[str, Any]:
        return {"watermark": self.watermark, "watermark_from": self.watermark_from,
                "source": list(self.source) if self.source else None,
                "required": ledger.count(self.required), "missing": ledger.count(self.missing),
                "missing_first": ledger.first_of(self.missing, SAMPLE_SIZE),
                "proven": self.proven, "dead_lettered": self.dead_lettered,
                "in_flight": {"count": ledger.count(self.in_flight),
                              "oldest": self.in_flight[0][0] if self.in_flight else None,
                              "oldest_age_s": in_flight_age}}


def judge_partition(partition: str, present: Ranges, held: Ranges, dead: Ranges,
                    source: tuple[int, int] | None, committed: int | None, why: str = "") -> PartitionVerdict:
    """What the sink must hold of one source partition, and what it lacks. Pure.

    ``present``: seqs in the table; ``held``: seqs the ledger records as committed;
    ``dead``: dead-lettered seqs; ``source``: the source stream's (first, last) now;
    ``committed``: the confirmed committed watermark (None: not confirmed, ``why`` says
    why). The watermark is the higher of ``committed`` and the end of the ledger's
    gap-free prefix (dead letters counted as held): both are offsets every step has passed.
    """
    if source is None:
        required = ledger.difference(held, dead)
        missing = ledger.difference(required, present)
        return PartitionVerdict(partition, None, "no source stream: only what the ledger records is required",
                                required, missing, ledger.difference(held, missing), [], 0)
    first, last = source
    prefix = ledger.low_offsets({"sink": {partition: held}}, [partition], dead={partition: dead},
                                first={partition: first})[partition].low - 1
    if committed is not None and committed >= prefix:
        watermark, whence = committed, "committed by every step from the source to the sink"
    else:
        watermark = prefix
        whence = "the ledger's gap-free prefix" + (f" ({why})" if why else "")
    span = [[first, watermark]] if watermark >= first else []
    within = ledger.normalize([*span, *held])
    required = ledger.difference(within, dead)
    missing = ledger.difference(required, present)
    beyond = [[watermark + 1, last]] if last > watermark else []
    in_flight = ledger.difference(ledger.difference(ledger.difference(beyond, present), dead), held)
    return PartitionVerdict(partition, watermark, whence, required, missing, ledger.difference(within, missing),
                            in_flight, ledger.count(within) - ledger.count(required), (first, last))


def judge_sink(df, held: PartitionRanges, dead: PartitionRanges, sources: Mapping[str, tuple[int, int]],
               watermark: CommittedWatermark | None, present: tuple[PartitionRanges, int] | None = None
               ) -> tuple[list[PartitionVerdict], int]:
    """(every source partition of the sink judged, :func:`judge_partition`; how many ids are malformed)."""
    present_by, malformed = present_ranges(df) if present is None else present
    parts = set(present_by) | set(held) | (set(watermark.committed) if watermark is not None else set())
    why = ""
    if watermark is not None and not watermark.confirmed and watermark.behind is not None:
        why = f"step {watermark.behind.vertex!r}: {watermark.behind.reason}"
    verdicts = []
    for part in sorted(parts):
        committed = watermark.committed.get(part) if watermark is not None and watermark.confirmed else None
        verdicts.append(judge_partition(part, present_by.get(part, []), held.get(part, []), dead.get(part, []),
                                        sources.get(part), committed, why))
    return verdicts, malformed


def ledger_completeness(verdicts: Sequence[PartitionVerdict], malformed: int, now: datetime,
                        stored_at: Callable[[str, int], float | None] | None = None,
                        watermark: CommittedWatermark | None = None) -> CheckResult:
    """Completeness against the offset ledger (module docstring), from :func:`judge_sink`'s verdicts.
    ``stored_at(partition, seq)``: when the source stored a record (the age of the oldest in flight)."""
    missing = {v.partition: ledger.count(v.missing) for v in verdicts if v.missing}
    samples = [f"{v.partition}/{q}" for v in verdicts for q in ledger.first_of(v.missing, SAMPLE_SIZE)][:SAMPLE_SIZE]
    ages: dict[str, float | None] = {}
    for v in verdicts:
        t = stored_at(v.partition, v.in_flight[0][0]) if stored_at and v.in_flight else None
        ages[v.partition] = None if t is None else max(0.0, now.timestamp() - t)
    flying = sum(ledger.count(v.in_flight) for v in verdicts)
    oldest = max((v for v in verdicts if v.in_flight), default=None,
                 key=lambda v: ages[v.partition] if ages[v.partition] is not None else -1.0)
    total = sum(missing.values())
    return CheckResult(
        "completeness", total == 0 and malformed == 0, total + malformed, samples,
        {"basis": "ledger",
         "ranges": {v.partition: [v.source[0], v.watermark] for v in verdicts if v.source},
         "proven": {v.partition: v.proven for v in verdicts},
         "missing": missing,
         "in_flight": {"count": flying,
                       "oldest": f"{oldest.partition}/{oldest.in_flight[0][0]}" if oldest else None,
                       "oldest_age_s": ages[oldest.partition] if oldest else None},
         "partitions": {v.partition: v.to_json(ages[v.partition]) for v in verdicts},
         "dead_lettered": sum(v.dead_lettered for v in verdicts), "malformed_ids": malformed,
         "watermark": watermark.to_json() if watermark is not None else None},
    )


def in_flight_upto(verdicts: Sequence[PartitionVerdict], upto: Mapping[str, int]) -> int:
    """How many records in flight to the sink have an offset at or below ``upto`` (per partition;
    e.g. what the source step has committed: only those can be anywhere downstream already)."""
    return sum(ledger.count(ledger.difference(v.in_flight, [[upto[v.partition] + 1, 2**63 - 1]]))
               for v in verdicts if v.partition in upto)


# ------------------------------------------------------------------ schema


def schema_check(actual, expected) -> CheckResult:
    """Columns and types of ``actual`` (a Spark StructType) against ``expected`` (one, or None)."""
    if expected is None:
        return skipped("schema", "no expected schema given (the upstream step's output schema)")
    have = {f.name: f.dataType.simpleString() for f in actual.fields}
    want = {f.name: f.dataType.simpleString() for f in expected.fields}
    problems = [f"missing column {n} ({t})" for n, t in want.items() if n not in have]
    problems += [f"unexpected column {n} ({t})" for n, t in have.items() if n not in want]
    problems += [f"column {n} is {have[n]}, expected {t}" for n, t in want.items()
                 if n in have and have[n] != t]
    return CheckResult("schema", not problems, len(problems), problems[:SAMPLE_SIZE],
                       {"expected": want, "actual": have, "problems": problems})


# ------------------------------------------------------------------ freshness


def freshness_column(columns: Sequence[str]) -> str | None:
    return next((c for c in ("ts", "window_end") if c in columns), None)


def freshness(df, max_lag: float | None, now: datetime) -> CheckResult:
    """The newest event time is at most ``max_lag`` seconds before ``now``."""
    from pyspark.sql import functions as F  # lazy: pyspark (0.3-1 s); module loads without it

    if max_lag is None:
        return skipped("freshness", "no freshness configured for this sink")
    column = freshness_column(df.columns)
    if column is None:
        return skipped("freshness", "the sink has no 'ts' or 'window_end' column")
    newest = df.agg(F.max(F.unix_micros(F.col(column))).alias("m")).first()["m"]
    details = {"column": column, "now": now.astimezone(UTC).isoformat(), "max_lag_s": max_lag,
               "newest": iso(newest)}
    if newest is None:
        return CheckResult("freshness", False, 1, [], {**details, "lag_s": None, "reason": "the sink is empty"})
    lag = (now - (_EPOCH + timedelta(microseconds=newest))).total_seconds()
    ok = lag <= max_lag
    return CheckResult("freshness", ok, 0 if ok else 1, [] if ok else [iso(newest)], {**details, "lag_s": lag})


# ------------------------------------------------------------------ aggregate windows


@dataclass(frozen=True)
class WindowClosure:
    """Which windows of an aggregate sink are closed: those ending at or before ``watermark_us``
    (epoch microseconds; None: none is). ``source`` says where the watermark comes from
    (:mod:`isbflow.quality.basis`); ``raw_in_flight``: records the source step has committed that
    the raw sink the windows are recounted from lacks yet (a closed window whose aggregate
    exceeds its recount by no more than these waits for them)."""

    watermark_us: int | None
    source: str
    step: str | None = None
    raw_in_flight: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"watermark": iso(self.watermark_us), "watermark_from": self.source, "step": self.step,
                "raw_in_flight": self.raw_in_flight}


def window_recompute(agg, raw, keys: Sequence[str] = ("service",), count_column: str = "count",
                     time_column: str = "ts", sample: int = 200, seed: int = 7,
                     closure: WindowClosure | None = None) -> CheckResult:
    """A sample of ``agg``'s closed windows recomputed from ``raw``: counts per (window, keys) equal.

    Without ``closure`` every window counts as closed.
    """
    from pyspark.sql import functions as F  # lazy: pyspark (0.3-1 s); module loads without it

    need_agg = ["window_start", "window_end", count_column, *keys]
    need_raw = [time_column, *keys]
    lacking = [c for c in need_agg if c not in agg.columns] + [c for c in need_raw if c not in raw.columns]
    if lacking:
        return skipped("windows", f"columns {lacking} are missing from the aggregate or raw sink")
    windows = agg.select(F.unix_micros("window_start").alias("ws"), F.unix_micros("window_end").alias("we"),
                         *keys, F.col(count_column).alias("agg_count"))
    total = windows.count()
    details: dict[str, Any] = {"windows": total, "keys": list(keys), **(closure.to_json() if closure else {})}
    pending_samples: list[dict[str, Any]] = []
    if closure is not None:
        wm = closure.watermark_us
        is_open = F.lit(True) if wm is None else F.col("we") > F.lit(wm)
        open_windows = windows.filter(is_open)
        details["open"] = open_windows.count()
        pending_samples = [{"window_start": iso(r["ws"]), "window_end": iso(r["we"]), **{k: r[k] for k in keys},
                            "count": r["agg_count"], "why": "open"}
                           for r in open_windows.orderBy("ws", *keys).limit(SAMPLE_SIZE).collect()]
        windows = windows.filter(~is_open)
    closed = total - details.get("open", 0)
    details["closed"] = closed
    if closed > sample:
        windows = windows.orderBy(F.rand(seed)).limit(sample)
    picked = windows.collect()
    mismatches: list[dict[str, Any]] = []
    waiting: list[dict[str, Any]] = []
    if picked:
        spark = agg.sparkSession
        wdf = (spark.createDataFrame([tuple(r) for r in picked], windows.schema)
               .withColumn("_w", F.monotonically_increasing_id()))
        t = F.unix_micros(F.col(time_column))
        cond = (t >= F.col("ws")) & (t < F.col("we"))
        for k in keys:
            cond = cond & (raw[k] == wdf[k])
        counted = F.countDistinct(ID_COLUMN) if ID_COLUMN in raw.columns else F.count(F.lit(1))
        recomputed = {r["_w"]: int(r["n"]) for r in
                      raw.join(F.broadcast(wdf), cond).groupBy("_w").agg(counted.alias("n")).collect()}
        budget = closure.raw_in_flight if closure else 0
        differing = []
        for r in wdf.collect():
            n = recomputed.get(r["_w"], 0)
            if n != r["agg_count"]:
                differing.append({"window_start": iso(r["ws"]), "window_end": iso(r["we"]),
                                  **{k: r[k] for k in keys}, "count": r["agg_count"], "recomputed": n})
        # an aggregate above its recount may wait for raw records still in flight: the smallest gaps first
        for m in sorted(differing, key=lambda m: m["count"] - m["recomputed"]):
            gap = m["count"] - m["recomputed"]
            if 0 < gap <= budget:
                budget -= gap
                waiting.append({**m, "why": "raw records in flight"})
            else:
                mismatches.append(m)
    mismatches.sort(key=lambda m: (m["window_start"], *[str(m[k]) for k in keys]))
    details.update(checked=len(picked), waiting_for_raw=len(waiting),
                   pending=details.get("open", 0) + len(waiting),
                   pending_samples=(pending_samples + waiting)[:SAMPLE_SIZE])
    return CheckResult("windows", not mismatches, len(mismatches), mismatches[:SAMPLE_SIZE], details)
