"""Test transforms that are slow on purpose (tests/specs/fault-backpressure.yaml).

:func:`slow` is the demo's parse (:func:`spark_apps.logs.parse`) with a pause in
every task of every micro-batch, so a step falls behind the step feeding it and
that step's writer has to wait for room in the buffer between them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pyarrow as pa
from pyspark.sql import DataFrame

from spark_apps.logs import parse

#: seconds each task of each micro-batch sleeps before passing its rows on
PAUSE_S = 0.4


def _pause(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    time.sleep(PAUSE_S)
    yield from batches


def slow(df: DataFrame) -> DataFrame:
    """``parse(df)``, row for row, but every task sleeps :data:`PAUSE_S` first."""
    parsed = parse(df)
    return parsed.mapInArrow(_pause, parsed.schema)
