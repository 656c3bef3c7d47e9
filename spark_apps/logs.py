"""The demo's transforms (pipelines/logs.yaml): log events -> parsed -> enriched (tagged) -> per-minute stats.

User code: each function takes and returns Spark DataFrames and knows nothing
of buffers; ``_isb_id`` is carried through untouched where rows map one to one.

- :func:`parse`: input the source's parsed columns (``ts, service, level, host,
  latency_ms, status, msg``) plus ``_isb_id``; normalises ``service`` (trimmed,
  lower case) and ``level`` (trimmed, upper case, ``WARNING`` -> ``WARN``) and
  adds ``is_error`` (``status >= 500`` or level ``ERROR``).
- :func:`enrich`: joins the reference table ``services`` (``service`` -> ``team``,
  ``tier``) on ``service``; a service missing from it gets team ``unknown``. It
  tags each event for routing (``_tags``, Numaflow's message tags): ``error`` on
  ``ERROR``-level events, which the spec's edge ``enrich -> errors`` takes
  (``conditions.tags``); ``_tags`` never leaves the step.
- :func:`per_minute`: 1-minute event-time tumbling windows per service, with a
  2-minute watermark: ``window_start, window_end, service, count, errors,
  latency_avg, latency_p95``. The spec runs it with ``output: update`` and
  ``keys: [window_start, service]``: each micro-batch emits the current value of
  every window it changed, and the agg sink upserts them. On a batch DataFrame
  the watermark is a no-op, so the same function recomputes windows exactly
  (:func:`isbflow.recovery.aggregates.recompute_windows`).
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

UNKNOWN_TEAM = "unknown"
#: the tag :func:`enrich` gives ERROR-level events (the demo's ``errors`` sink takes them)
ERROR_TAG = "error"
WATERMARK = "2 minutes"
WINDOW = "1 minute"


def parse(df: DataFrame) -> DataFrame:
    level = F.upper(F.trim(F.col("level")))
    return (df
            .withColumn("service", F.lower(F.trim(F.col("service"))))
            .withColumn("level", F.when(level == "WARNING", F.lit("WARN")).otherwise(level))
            .withColumn("is_error", F.coalesce((F.col("status") >= 500) | (F.col("level") == "ERROR"),
                                               F.lit(False))))


def enrich(df: DataFrame, services: DataFrame) -> DataFrame:
    """Left join on ``service``; every input row comes out once (the reference has one row per key)."""
    ref = services
    if "team" not in ref.columns:
        ref = ref.withColumn("team", F.lit(None).cast("string"))
    ref = ref.select("service", *[c for c in ref.columns if c != "service"])
    return (df.join(F.broadcast(ref), on="service", how="left")
            .withColumn("team", F.coalesce(F.col("team"), F.lit(UNKNOWN_TEAM)))
            .withColumn("_tags", F.when(F.col("level") == "ERROR", F.array(F.lit(ERROR_TAG)))
                        .otherwise(F.array().cast("array<string>"))))


def per_minute(df: DataFrame) -> DataFrame:
    """Per (minute, service): count, errors, mean and p95 latency. Streaming: rows later than the
    watermark are dropped (and counted by the runner); batch: every row counts."""
    return (df
            .withWatermark("ts", WATERMARK)
            .groupBy(F.window("ts", WINDOW), F.col("service"))
            .agg(F.count(F.lit(1)).alias("count"),
                 F.sum(F.col("is_error").cast("long")).alias("errors"),
                 F.avg("latency_ms").alias("latency_avg"),
                 F.percentile_approx("latency_ms", 0.95).alias("latency_p95"))
            .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                    "service", "count", "errors", "latency_avg", "latency_p95"))
