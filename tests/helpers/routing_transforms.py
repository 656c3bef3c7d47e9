"""Transforms of the conditional-forwarding tests (tests/steps/test_routing.py).

:func:`tag` turns the event's comma-separated ``tags`` string into the ``_tags``
array the runner routes on; :func:`untagged` returns no ``_tags`` at all;
:func:`tagged_as_string` returns ``_tags`` of the wrong type.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def tag(df: DataFrame) -> DataFrame:
    return df.withColumn("_tags", F.when(F.col("tags") == "", F.array().cast("array<string>"))
                         .otherwise(F.split(F.col("tags"), ",")))


def untagged(df: DataFrame) -> DataFrame:
    return df


def tagged_as_string(df: DataFrame) -> DataFrame:
    return df.withColumn("_tags", F.col("tags"))
