"""Transforms of tests/specs/reprocess-logs.yaml whose output depends on a module global.

``VERSION`` is read when the transform builds its plan (on the driver), so a
test changes what the pipeline computes by setting it before a run or a
reprocess: ``tag`` stamps each row with ``version`` and ``score =
latency_ms * VERSION``; ``per_window`` sums ``score`` per 10-second window and
service, so a changed ``VERSION`` changes the windows a reprocess touches.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F

VERSION = 1
WINDOW = "10 seconds"
WATERMARK = "30 seconds"


def tag(df: DataFrame) -> DataFrame:
    return (df.withColumn("version", F.lit(VERSION))
            .withColumn("score", F.col("latency_ms") * F.lit(float(VERSION))))


def per_window(df: DataFrame) -> DataFrame:
    return (df.withWatermark("ts", WATERMARK)
            .groupBy(F.window("ts", WINDOW), F.col("service"))
            .agg(F.count(F.lit(1)).alias("count"), F.sum("score").alias("score"))
            .select(F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"),
                    "service", "count", "score"))
