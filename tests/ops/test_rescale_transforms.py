"""The aggregation of tests/specs/rescale.yaml (no tests here): a running count per service, whose
state Spark keeps in the step's checkpoint."""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def per_service(df: DataFrame) -> DataFrame:
    return df.groupBy("service").agg(F.count(F.lit(1)).alias("count"))
