"""Built-in checks every sink gets, computed with Spark on the sink's current version.

Each check returns a :class:`CheckResult` (pass/fail, how many things are
wrong, a few samples). What each one means:

- **completeness** (sinks with ``_isb_id``): the sink holds every record of the
  source offset range it covers. Ids are ``<source>/<partition>/<seq>``; per
  ``<source>/<partition>`` the expected range comes from an
  :class:`OffsetBasis`. Today's basis, :class:`SinkOffsetBasis`, takes the
  sink's own ``min..max`` seq (so it finds holes, not a missing tail) and
  excludes the dead-lettered ids (records the pipeline rejected on purpose).
  Issue 5's offset ledger plugs in as another basis (its committed ranges),
  with no change here. ``unexpected_count`` is the number of missing ids.
- **uniqueness** of ``_isb_id`` runs in GX (:mod:`isbflow.quality.gx`), so it
  is not here.
- **schema**: the sink's columns and types equal the expected schema (the
  upstream step's output); column order and nullability are not compared.
  ``unexpected_count`` is the number of differing columns.
- **freshness**: the newest event time (``ts``; ``window_end`` for
  aggregates) is at most ``max_lag`` seconds before ``now`` (injectable).
- **windows** (aggregate sinks: no ``_isb_id``, a ``window_start``): a sample
  of windows is recomputed from the raw sink, counting distinct ``_isb_id``
  per key with ``window_start <= ts < window_end``; ``unexpected_count`` is
  the number of windows whose count differs. A difference means the
  aggregate is wrong, or late events reached the raw sink after the window
  was emitted.

Timestamps are read as epoch microseconds and reported in ISO 8601 UTC, so
neither the Python process nor the Spark session time zone changes a result.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Literal, Protocol

from isbflow.isb.ledger import ID_COLUMN

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
    """Today's basis: the sink's own ``min..max`` per stream, minus dead-lettered ids.

    Holes are found; records missing after the sink's newest id are not (the
    offset ledger's basis will know the committed end).
    """

    dead_letter_ids: frozenset[str] = frozenset()

    def ranges(self, observed: Mapping[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
        return dict(observed)

    def excluded(self) -> set[str]:
        return set(self.dead_letter_ids)


def split_id(isb_id: str) -> tuple[str, int] | None:
    """``"in/0/17"`` -> ``("in/0", 17)``; None when not in that form."""
    stream, _, seq = isb_id.rpartition("/")
    return (stream, int(seq)) if stream and seq.isdigit() else None


def _parsed_ids(df):
    from pyspark.sql import functions as F

    return df.select(F.col(ID_COLUMN).alias("id"),
                     F.regexp_extract(ID_COLUMN, _ID_RE, 1).alias("stream"),
                     F.regexp_extract(ID_COLUMN, _ID_RE, 2).alias("seq_text"))


def offset_ranges(df) -> dict[str, tuple[int, int, int]]:
    """Per ``<source>/<partition>``: (min seq, max seq, distinct seqs) the sink holds."""
    from pyspark.sql import functions as F

    rows = (_parsed_ids(df).filter(F.col("seq_text") != "")
            .groupBy("stream").agg(F.min(F.col("seq_text").cast("long")).alias("lo"),
                                   F.max(F.col("seq_text").cast("long")).alias("hi"),
                                   F.countDistinct(F.col("seq_text").cast("long")).alias("n"))
            .collect())
    return {r["stream"]: (int(r["lo"]), int(r["hi"]), int(r["n"])) for r in rows}


def completeness(df, basis: OffsetBasis, observed: Mapping[str, tuple[int, int, int]] | None = None
                 ) -> CheckResult:
    """Missing ids per stream: expected range, minus ids present, minus dead-lettered ids."""
    from pyspark.sql import Window
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
         "basis": type(basis).__name__},
    )


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
    from pyspark.sql import functions as F

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


def window_recompute(agg, raw, keys: Sequence[str] = ("service",), count_column: str = "count",
                     time_column: str = "ts", sample: int = 200, seed: int = 7) -> CheckResult:
    """A sample of ``agg``'s windows recomputed from ``raw``: counts per (window, keys) equal."""
    from pyspark.sql import functions as F

    need_agg = ["window_start", "window_end", count_column, *keys]
    need_raw = [time_column, *keys]
    lacking = [c for c in need_agg if c not in agg.columns] + [c for c in need_raw if c not in raw.columns]
    if lacking:
        return skipped("windows", f"columns {lacking} are missing from the aggregate or raw sink")
    windows = agg.select(F.unix_micros("window_start").alias("ws"), F.unix_micros("window_end").alias("we"),
                         *keys, F.col(count_column).alias("agg_count"))
    total = windows.count()
    if total > sample:
        windows = windows.orderBy(F.rand(seed)).limit(sample)
    picked = windows.collect()
    if not picked:
        return CheckResult("windows", True, 0, [], {"windows": 0, "checked": 0})
    spark = agg.sparkSession
    wdf = spark.createDataFrame([tuple(r) for r in picked], windows.schema).withColumn("_w", F.monotonically_increasing_id())
    t = F.unix_micros(F.col(time_column))
    cond = (t >= F.col("ws")) & (t < F.col("we"))
    for k in keys:
        cond = cond & (raw[k] == wdf[k])
    counted = F.countDistinct(ID_COLUMN) if ID_COLUMN in raw.columns else F.count(F.lit(1))
    recomputed = {r["_w"]: int(r["n"]) for r in
                  raw.join(F.broadcast(wdf), cond).groupBy("_w").agg(counted.alias("n")).collect()}
    mismatches = []
    for r in wdf.collect():
        n = recomputed.get(r["_w"], 0)
        if n != r["agg_count"]:
            mismatches.append({"window_start": iso(r["ws"]), "window_end": iso(r["we"]),
                               **{k: r[k] for k in keys}, "count": r["agg_count"], "recomputed": n})
    mismatches.sort(key=lambda m: (m["window_start"], *[str(m[k]) for k in keys]))
    return CheckResult("windows", not mismatches, len(mismatches), mismatches[:SAMPLE_SIZE],
                       {"windows": total, "checked": len(picked), "keys": list(keys)})
