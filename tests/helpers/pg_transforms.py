"""The transform of the PostgreSQL sink's pipeline test (tests/specs/postgres-sink.yaml)."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def shape(df: DataFrame) -> DataFrame:
    """Types PostgreSQL must get right: a long, a decimal, an array, a date."""
    return df.select("n", "service", "ts", "_isb_id", (F.col("n").cast("long") * 1000).alias("big"),
                     (F.col("n") / 4).cast("decimal(10,2)").alias("quarter"),
                     F.array(F.col("service"), F.lit("x")).alias("tags"), F.to_date("ts").alias("day"))
