"""A Delta file's statistics from its Parquet footer: bounds that hold for every row of the file.

Delta readers (delta-rs, Spark, Trino, DuckDB) skip a file when its ``minValues`` /
``maxValues`` say no row can match a predicate, so a bound that is too tight hides rows
from every reader of the table. And a bound left out is not safe either: delta-rs (1.x)
takes a column missing from ``minValues``/``maxValues`` for a column of nulls and skips the
file for any comparison on it. So each column a reader keeps statistics for gets exact
bounds over **every** row group of the file, or the file's stats carry ``numRecords``
alone (every reader then reads the file). Per column:

- integers, booleans, dates, timestamps (rounded outwards to Delta's milliseconds): exact;
- decimals: the nearest JSON number rounded outwards;
- floats: exact, unless the file holds ``+inf``, ``-inf`` (strict JSON has no such number)
  or ``NaN`` (Parquet writers leave ``NaN`` out of their statistics, and engines disagree on
  where it sorts: Spark and arrow-rs put it above every number, IEEE comparisons nowhere);
- strings: compared by code point (the order of their UTF-8 bytes, as engines compare
  them); the min keeps a 32-character prefix (a prefix is never greater), a longer max is
  cut to 32 characters with its last one raised by one (greater than every string with
  that prefix), as Delta Spark and delta-rs write it;
- a column of nulls only: no bounds (readers take it for that), its ``nullCount``;
- binary, lists and maps: none (readers keep no statistics for them);
- anything else (structs, a row group without statistics): the file's stats are
  ``numRecords`` alone.

``nullCount`` is the sum over the row groups. Reading the footer costs no pass over the
data; only :func:`nan_columns` of a written file reads its float columns back.
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

STATS_STRING_PREFIX = 32  # like Delta Spark: string stats keep a 32-character prefix
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class _Unbounded(Exception):
    """A column of the file has no bound that holds: the file's stats are ``numRecords`` alone."""


def _raised_prefix(s: str) -> str:
    """A string greater than every string starting with ``s[:STATS_STRING_PREFIX]``."""
    head = s[:STATS_STRING_PREFIX]
    while head:
        last = ord(head[-1])
        if last < 0x10FFFF and not 0xD7FF <= last < 0xDFFF:  # the next code point is a character
            return head[:-1] + chr(last + 1)
        head = head[:-1]
    raise _Unbounded


def _decimal_bound(value: Decimal, is_max: bool) -> float:
    f = float(value)
    if math.isinf(f):
        raise _Unbounded
    if is_max and Decimal(f) < value:
        return math.nextafter(f, math.inf)
    if not is_max and Decimal(f) > value:
        return math.nextafter(f, -math.inf)
    return f


def _timestamp_bound(raw: Any, typ: pa.TimestampType, is_max: bool) -> str:
    """Delta keeps milliseconds: the min rounded down and the max up, so the bounds still hold."""
    raw = int(raw)
    if typ.unit == "s":
        ms = raw * 1000
    else:
        per_ms = {"ms": 1, "us": 1000, "ns": 1_000_000}[typ.unit]
        ms = -(-raw // per_ms) if is_max else raw // per_ms
    t = _EPOCH + timedelta(milliseconds=ms)
    if typ.tz is None:  # timestamp_ntz
        return t.strftime("%Y-%m-%d %H:%M:%S.") + f"{t.microsecond // 1000:03d}"
    return t.strftime("%Y-%m-%dT%H:%M:%S.") + f"{t.microsecond // 1000:03d}Z"


def _stat_value(value: Any, raw: Any, typ: pa.DataType, is_max: bool) -> Any:
    """A Parquet min (``is_max`` false) or max as Delta stats JSON wants it, bounding every row it
    stands for; raises :class:`_Unbounded` when there is none."""
    if pa.types.is_boolean(typ):
        return bool(value)
    if pa.types.is_integer(typ):
        return int(value)
    if pa.types.is_floating(typ):
        if not math.isfinite(value):
            raise _Unbounded
        return float(value)
    if pa.types.is_decimal(typ):
        return _decimal_bound(Decimal(value), is_max)
    if pa.types.is_string(typ) or pa.types.is_large_string(typ):
        s = value.decode() if isinstance(value, bytes) else str(value)
        if len(s) <= STATS_STRING_PREFIX:
            return s
        return _raised_prefix(s) if is_max else s[:STATS_STRING_PREFIX]
    if pa.types.is_date32(typ):
        return value.isoformat()
    if pa.types.is_timestamp(typ):
        return _timestamp_bound(raw, typ, is_max)
    raise _Unbounded


def _not_collected(typ: pa.DataType) -> bool:
    """Types Delta readers keep no statistics for."""
    return (pa.types.is_binary(typ) or pa.types.is_large_binary(typ) or pa.types.is_fixed_size_binary(typ)
            or pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_map(typ))


def nan_columns(data: pa.Table | pa.RecordBatch | str) -> set[str]:
    """The floating-point columns of ``data`` (a table, a batch, or a Parquet file's path:
    its float columns are read back) that hold at least one ``NaN``."""
    if isinstance(data, str):
        schema = pq.read_schema(data)
        floats = [f.name for f in schema if pa.types.is_floating(f.type)]
        if not floats:
            return set()
        data = pq.read_table(data, columns=floats)
    found = set()
    for f in data.schema:
        if pa.types.is_floating(f.type) and pc.any(pc.is_nan(data.column(f.name))).as_py():
            found.add(f.name)
    return found


def file_stats(metadata: pq.FileMetaData, schema: pa.Schema, nans: Collection[str]) -> str:
    """Delta stats JSON of a Parquet file from its footer ``metadata``: ``numRecords`` and, when
    every column has bounds that hold (the module's rules), ``minValues``, ``maxValues`` and
    ``nullCount``. ``schema`` is the rows' Arrow schema and ``nans`` the float columns that hold
    a ``NaN`` (:func:`nan_columns`)."""
    try:
        # raw UTF-8, as delta-rs writes it: delta-rs misreads some characters outside the BMP
        # escaped as surrogate pairs (U+20000 as "\\ud840\\udc00" matched no row)
        return json.dumps({"numRecords": metadata.num_rows, **_column_stats(metadata, schema, nans)},
                          ensure_ascii=False)
    except _Unbounded:
        return json.dumps({"numRecords": metadata.num_rows})


def _column_stats(metadata: pq.FileMetaData, schema: pa.Schema, nans: Collection[str]) -> dict:
    leaves = {metadata.schema.column(i).path: i for i in range(metadata.num_columns)}
    mins: dict[str, Any] = {}
    maxs: dict[str, Any] = {}
    nulls: dict[str, int] = {}
    for f in schema:
        if _not_collected(f.type):
            continue
        i = leaves.get(f.name)
        if i is None or f.name in nans:
            raise _Unbounded  # a nested column, or a NaN no statistic shows
        lo = hi = None
        null_count = 0
        for rg in range(metadata.num_row_groups):
            st = metadata.row_group(rg).column(i).statistics
            if st is None or not st.has_null_count:
                raise _Unbounded
            null_count += st.null_count
            if not st.has_min_max:
                if metadata.row_group(rg).num_rows > st.null_count:
                    raise _Unbounded  # rows with values but no bounds for them
                continue
            a = _stat_value(st.min, st.min_raw, f.type, False)
            b = _stat_value(st.max, st.max_raw, f.type, True)
            lo = a if lo is None or a < lo else lo
            hi = b if hi is None or b > hi else hi
        nulls[f.name] = null_count
        if lo is not None:
            mins[f.name], maxs[f.name] = lo, hi
    return {"minValues": mins, "maxValues": maxs, "nullCount": nulls}
