"""A test transform that tries to read the ISB admin's password (tests/steps/test_driver.py).

:func:`probe` passes its rows on with two more columns: what reading
``$ISBFLOW_HOME/nats/password`` gave in the driver's Python, where the transform is
called, and in the Python worker that runs its tasks: ``read``, ``denied``
(PermissionError) or ``missing``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import StringType, StructField, StructType


def try_admin_password() -> str:
    """``read``, ``denied`` or ``missing``: opening the admin's password file from this process."""
    try:
        (Path(os.environ["ISBFLOW_HOME"]) / "nats" / "password").read_bytes()
    except PermissionError:
        return "denied"
    except FileNotFoundError:
        return "missing"
    return "read"


def _in_worker(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    outcome = try_admin_password()
    for b in batches:
        yield b.append_column("worker_read", pa.array([outcome] * b.num_rows, pa.string()))


def probe(df: DataFrame) -> DataFrame:
    """``df`` with ``driver_read`` and ``worker_read`` (module docstring)."""
    df = df.withColumn("driver_read", F.lit(try_admin_password()))
    schema = StructType([*df.schema.fields, StructField("worker_read", StringType())])
    return df.mapInArrow(_in_worker, schema)
