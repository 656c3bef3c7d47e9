"""A Delta file's statistics (isbflow.sinks.delta_stats): bounds that hold for every row of the file.

Files of several row groups are written through the sink's own writer and committed through its
own commit path; the table is then read by delta-rs with predicates it skips files on, and every
row the query asks for must come back.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from decimal import Decimal

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from isbflow.local.delta import TableCache
from isbflow.sinks.delta import DeltaSinkOptions, commit_batch, sink_app_id, write_batch_files
from isbflow.sinks.delta_spark import adopt_staged_files
from isbflow.sinks.delta_stats import file_stats, nan_columns

APP = sink_app_id("p", "s", "t")
INF, NAN = float("inf"), float("nan")


def commit(path, table: pa.Table, row_group_rows: int = 1000) -> dict:
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP,
                                          "rowGroupRows": str(row_group_rows)})
    msg = write_batch_files(opts, table.to_batches(max_chunksize=row_group_rows), 0, 0)
    assert commit_batch(opts, [msg], 0).version is not None
    (action,) = msg.actions
    assert pq.read_metadata(os.path.join(path, action.path)).num_row_groups > 1
    return json.loads(action.stats)


def test_a_long_string_max_in_one_row_group_bounds_the_whole_file(tmp_path):
    """Row group 1 has max 'aaa', row group 2 a max longer than the 32-character prefix: the file's
    max is that prefix raised by one, not 'aaa', so `s > 'b'` and `s = 'zzz…'` still read it."""
    long = "z" * 80
    stats = commit(tmp_path / "t", pa.table({"s": ["aaa"] * 1000 + ["bbb"] * 999 + [long]}))

    assert stats["maxValues"]["s"] == "z" * 31 + "{" and stats["minValues"]["s"] == "aaa"
    dt = DeltaTable(str(tmp_path / "t"))
    assert dt.to_pyarrow_table(filters=[("s", ">", "b")]).num_rows == 1000
    assert dt.to_pyarrow_table(filters=[("s", "=", long)]).num_rows == 1


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
def test_a_float_without_bounds_leaves_the_file_with_its_row_count_alone(tmp_path, bad):
    """No JSON number bounds ±inf, and Parquet statistics leave NaN out; a bound left out of
    minValues/maxValues makes delta-rs skip the file, so the file says numRecords only."""
    values = [1.0] * 1000 + [2.0] * 999 + [bad]
    stats = commit(tmp_path / "t", pa.table({"f": values, "i": list(range(2000))}))

    assert stats == {"numRecords": 2000}
    dt = DeltaTable(str(tmp_path / "t"))
    for op, bound in ((">", 1.5), ("<", 1.5), ("=", bad)):
        want = pa.table({"f": values}).filter(pc.field("f").__getattribute__(
            {">": "__gt__", "<": "__lt__", "=": "__eq__"}[op])(bound)).num_rows
        assert dt.to_pyarrow_table(filters=[("f", op, bound)]).num_rows == want
    assert dt.to_pyarrow_table(filters=[("i", ">", 1500)]).num_rows == 499


def test_bounds_of_several_row_groups_are_the_widest(tmp_path):
    table = pa.table({"i": list(range(5, 1005)) + list(range(-3, 997)),
                      "s": ["m"] * 1000 + ["a", "zz"] + ["k"] * 998,
                      "b": [True] * 1000 + [False] * 1000,
                      "n": pa.array([None] * 2000, pa.int64()),
                      "d": pa.array([Decimal("0.1")] * 1999 + [Decimal("12.35")], pa.decimal128(6, 2)),
                      "ts": pa.array([datetime(2020, 1, 1, 0, 0, 0, 1500)] * 2000, pa.timestamp("us")),
                      "bin": [b"x"] * 2000})
    stats = commit(tmp_path / "t", table)
    lo, hi = stats["minValues"].pop("d"), stats["maxValues"].pop("d")  # the nearest floats outwards
    assert Decimal(lo) <= Decimal("0.1") < Decimal(lo) + Decimal("1e-15") and Decimal(hi) >= Decimal("12.35")
    assert stats["minValues"] == {"i": -3, "s": "a", "b": False, "ts": "2020-01-01 00:00:00.001"}
    assert stats["maxValues"] == {"i": 1004, "s": "zz", "b": True, "ts": "2020-01-01 00:00:00.002"}
    assert stats["nullCount"] == {"i": 0, "s": 0, "b": 0, "n": 2000, "d": 0, "ts": 0}
    dt = DeltaTable(str(tmp_path / "t"))
    assert dt.to_pyarrow_table(filters=[("b", "=", False)]).num_rows == 1000
    assert dt.to_pyarrow_table(filters=[("n", "=", 1)]).num_rows == 0


def test_a_row_group_without_statistics_leaves_the_file_with_its_row_count_alone(tmp_path):
    path = str(tmp_path / "f.parquet")
    pq.write_table(pa.table({"i": list(range(10))}), path, row_group_size=5, write_statistics=False)
    stats = json.loads(file_stats(pq.read_metadata(path), pa.schema([("i", pa.int64())]), set()))
    assert stats == {"numRecords": 10}


@pytest.mark.parametrize("text", ["\U00020000", "\U0001f600", "\U0010ffff", "é"])
def test_characters_outside_the_basic_plane_are_found_by_their_stats(tmp_path, text):
    """delta-rs misread U+20000 written as an escaped surrogate pair: a file's stats are raw UTF-8."""
    opts = DeltaSinkOptions.from_options({"path": str(tmp_path / "t"), "appId": APP})
    tables = TableCache(str(tmp_path / "t"))
    for b in range(2):  # the table's first commit through delta-rs, the next through the sink's own
        commit_batch(opts, [write_batch_files(opts, pa.table({"s": [text * (b + 1)]}).to_batches(), b, 0)], b,
                     tables)
    dt = DeltaTable(str(tmp_path / "t"))
    assert dt.to_pyarrow_table(filters=[("s", "=", text)]).num_rows == 1
    assert dt.to_pyarrow_table(filters=[("s", "=", text * 2)]).num_rows == 1


def test_nan_columns_finds_float_columns_holding_nan():
    assert nan_columns(pa.table({"f": [1.0, None], "g": [NAN, 1.0], "s": ["a", "b"]})) == {"g"}


def test_files_spark_wrote_are_adopted_with_nan_found(tmp_path):
    """The Spark path's files: their float columns are read back for NaN (footers do not say)."""
    table_dir = tmp_path / "t"
    staging = tmp_path / "t" / "_isb_pending" / "x" / "spark-1"
    staging.mkdir(parents=True)
    pq.write_table(pa.table({"f": [1.0, NAN, 3.0]}), staging / "part-00000-abc.snappy.parquet")
    opts = DeltaSinkOptions.from_options({"path": str(table_dir), "appId": APP})
    (action,) = adopt_staged_files(opts, str(staging), 0, pa.schema([("f", pa.float64())]))
    assert json.loads(action.stats) == {"numRecords": 3}
