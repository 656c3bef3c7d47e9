"""Reference tables (``isbflow ref put/get``): a pipeline's KV-backed lookup tables, put and read whole."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from isbflow.isb import reference
from isbflow.isb.connect import NatsSettings
from isbflow.isb.reference import ReferenceError, check_rows

__all__ = ["ReferenceError", "check_rows", "load", "put"]


def put(settings: NatsSettings, pipeline: str, name: str, rows: Mapping[str, Mapping[str, Any]], *,
        replace: bool = False) -> dict[str, int]:
    """Write the table's rows (unchanged ones skipped; with ``replace``, keys not in ``rows`` deleted);
    counts and the new revision."""
    return asyncio.run(reference.put(settings, pipeline, name, rows, replace=replace))


def load(settings: NatsSettings, pipeline: str, name: str, key: str = "key") -> tuple[int, pa.Table]:
    """(revision, table) of the reference table."""
    return asyncio.run(reference.load(settings, pipeline, name, key))
