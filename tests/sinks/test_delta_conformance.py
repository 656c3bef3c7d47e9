"""Differential conformance of the sink's own Delta commits against delta-rs (hypothesis).

Random schemas (integers, floats with NaN and ±inf, strings short and long, binary, dates, zoned
timestamps, nulls everywhere) and random batches (files of several row groups; a partition
column with nulls and empty strings) are committed once through the sink's own path
(:func:`isbflow.sinks.delta.write_batch_files` + :func:`isbflow.sinks.delta.commit_batch`) and
once through delta-rs' ``write_deltalake``. Then:

- both tables hold the same rows;
- every file of the sink's table has stats that bound its real data (the Parquet read back);
- reads that skip files on stats and partitions (``to_pyarrow_table(filters=...)``) return the
  rows a full scan and filter returns.

The number of examples is bounded for the suite; ``HYPOTHESIS_PROFILE=long`` runs many more.
A race test interleaves another writer's OPTIMIZE, checkpoint, log trim and VACUUM with the
sink's appends and upserts: no row lost or doubled.
"""

from __future__ import annotations

import json
import math
import os
import threading
from datetime import UTC, date, datetime, timedelta
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isbflow.local.delta import TableCache
from isbflow.sinks.delta import DeltaSinkOptions, commit_batch, sink_app_id, write_batch_files
from isbflow.sinks.delta_log import bound_log
from isbflow.sinks.maintain import compact_table, vacuum_table

APP = sink_app_id("conformance", "step", "sink")
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "suite")
EXAMPLES = {"suite": 25, "long": 1000}[PROFILE]
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=PROFILE == "suite",
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

_T0 = datetime(2020, 1, 1, tzinfo=UTC)
_FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=64),
                    st.sampled_from([0.0, -0.0, 1.5, float("inf"), float("-inf"), float("nan")]))
_TEXT = st.one_of(st.text(max_size=4), st.text(min_size=30, max_size=80),
                  st.sampled_from(["", "a", "z" * 40, "é" * 33, "\U0010ffff" * 33, "a\u2028b", "\x85", "\U00020000"]))
#: column kind -> (arrow type, value strategy)
KINDS = {
    "int": (pa.int64(), st.integers(-(2**63), 2**63 - 1)),
    "float": (pa.float64(), _FLOATS),
    "string": (pa.string(), _TEXT),
    "binary": (pa.binary(), st.binary(max_size=40)),
    "date": (pa.date32(), st.dates(date(1900, 1, 1), date(2200, 1, 1))),
    "ts": (pa.timestamp("us", tz="UTC"),
           st.integers(-10**15, 10**15).map(lambda us: _T0 + timedelta(microseconds=us))),
}
PART_VALUES = st.one_of(st.none(), st.sampled_from(["", "a", "b c", "x/y=z", "ü"]))


@st.composite
def cases(draw):
    kinds = draw(st.lists(st.sampled_from(sorted(KINDS)), min_size=1, max_size=4))
    names = [f"c{i}_{k}" for i, k in enumerate(kinds)]
    partitioned = draw(st.booleans())
    n_batches = draw(st.integers(1, 3))
    batches = []
    for _ in range(n_batches):
        n = draw(st.integers(1, 40))
        cols = {name: pa.array([draw(st.one_of(st.none(), KINDS[k][1])) for _ in range(n)], KINDS[k][0])
                for name, k in zip(names, kinds, strict=True)}
        if partitioned:
            cols["part"] = pa.array([draw(PART_VALUES) for _ in range(n)], pa.string())
        batches.append(pa.table(cols))
    row_group_rows = draw(st.integers(2, 16))
    return batches, ("part",) if partitioned else (), row_group_rows


def _key(row: dict) -> tuple:
    """A row as a sortable, NaN-safe tuple (NaN equal to NaN; -0.0 kept apart from 0.0)."""
    out = []
    for k in sorted(row):
        v = row[k]
        if isinstance(v, float):
            v = ("nan",) if math.isnan(v) else ("f", v, math.copysign(1, v))
        out.append((k, repr(v) if v is not None else ""))
    return tuple(out)


def _rows(table: pa.Table) -> list[tuple]:
    return sorted(_key(r) for r in table.to_pylist())


def _ours(path, batches, partition_by, row_group_rows) -> None:
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "partitionBy": ",".join(partition_by),
                                          "rowGroupRows": str(row_group_rows)})
    tables = TableCache(str(path))
    for b, batch in enumerate(batches):
        commit_batch(opts, [write_batch_files(opts, batch.to_batches(max_chunksize=row_group_rows), b, 0)], b, tables)


def _theirs(path, batches, partition_by) -> None:
    for batch in batches:
        write_deltalake(str(path), batch, mode="append", partition_by=list(partition_by) or None)


def _active_adds(path) -> list[dict]:
    """The add actions of the table's active files, read from its commit files (no checkpoint here)."""
    active: dict[str, dict] = {}
    for name in sorted(f for f in os.listdir(path / "_delta_log") if f.endswith(".json")):
        for line in filter(None, (path / "_delta_log" / name).read_text(encoding="utf-8").split("\n")):
            action = json.loads(line)  # JSON lines: str.splitlines would also cut at U+2028 in a string
            if "add" in action:
                active[action["add"]["path"]] = action["add"]
            elif "remove" in action:
                active.pop(action["remove"]["path"], None)
    return [{**a, "path": unquote(a["path"])} for a in active.values()]


def _bounds_hold(root, add: dict, schema: pa.Schema) -> None:
    stats = json.loads(add["stats"])
    data = pq.read_table(os.path.join(root, add["path"]))
    assert stats["numRecords"] == data.num_rows
    for kind, cmp in (("minValues", pc.greater_equal), ("maxValues", pc.less_equal)):
        for col, bound in stats.get(kind, {}).items():
            values = data.column(col)
            typ = schema.field(col).type
            if pa.types.is_timestamp(typ):
                bound = datetime.fromisoformat(bound.replace("Z", "+00:00"))
            elif pa.types.is_date32(typ):
                bound = date.fromisoformat(bound)
            ok = cmp(values, pa.scalar(bound, typ))
            assert pc.all(pc.or_kleene(ok, pc.is_null(values))).as_py(), (col, kind, bound, add["path"])
            assert not (pa.types.is_floating(typ) and pc.any(pc.is_nan(values)).as_py())
    for col, nulls in stats.get("nullCount", {}).items():
        assert data.column(col).null_count == nulls


def _predicates(table: pa.Table, partition_by):
    """(column, op, value) predicates drawn from the table's own values, partition columns included."""
    for f in table.schema:
        if pa.types.is_binary(f.type):
            continue
        values = [v for v in table.column(f.name).to_pylist() if v is not None]
        if f.name in partition_by:
            values = [v for v in values if v != ""]  # the protocol reads an empty partition value as null
        values = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        for v in sorted(set(values), key=repr)[:3]:
            for op in ("=", ">", "<", ">=", "<="):
                yield f.name, op, v


_OPS = {"=": pc.equal, ">": pc.greater, "<": pc.less, ">=": pc.greater_equal, "<=": pc.less_equal}


@SETTINGS
@given(case=cases())
def test_the_sinks_own_commits_match_delta_rs_and_skip_no_row(tmp_path_factory, case):
    batches, partition_by, row_group_rows = case
    base = tmp_path_factory.mktemp("conf")
    ours, theirs = base / "ours", base / "theirs"
    _ours(ours, batches, partition_by, row_group_rows)
    _theirs(theirs, batches, partition_by)

    ours_dt, theirs_dt = DeltaTable(str(ours)), DeltaTable(str(theirs))
    full = ours_dt.to_pyarrow_table()
    assert _rows(full) == _rows(theirs_dt.to_pyarrow_table())

    schema = pa.concat_tables(b.cast(batches[0].schema) for b in batches).schema
    for add in _active_adds(ours):
        _bounds_hold(str(ours), add, schema)
    for col, op, value in _predicates(full, partition_by):
        want = full.filter(pc.fill_null(_OPS[op](full.column(col), pa.scalar(value, full.schema.field(col).type)),
                                        False))
        got = ours_dt.to_pyarrow_table(filters=[(col, op, value)])
        assert _rows(got) == _rows(want), (col, op, value)


def test_the_sinks_stats_are_exact_where_they_are_given(tmp_path):
    """The bound checks above read stats through delta-rs; one file checked on the raw log too."""
    path = tmp_path / "t"
    _ours(path, [pa.table({"i": [3, 1, 2], "s": ["b", "a", None]})], (), 2)
    (add,) = _active_adds(path)
    assert json.loads(add["stats"]) == {"numRecords": 3, "minValues": {"i": 1, "s": "a"},
                                        "maxValues": {"i": 3, "s": "b"}, "nullCount": {"i": 0, "s": 1}}
    _bounds_hold(str(path), add, pa.schema([("i", pa.int64()), ("s", pa.string())]))


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_maintenance_racing_the_sinks_commits_loses_and_doubles_nothing(tmp_path, mode):
    """Another writer compacts (OPTIMIZE), checkpoints and trims the log, and vacuums, in a loop,
    while the sink commits batches through its own path: every row once, each key once."""
    path = tmp_path / "t"
    extra = {"mode": "upsert", "mergeKey": "k"} if mode == "upsert" else {}
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, **extra})
    tables = TableCache(str(path))
    batches = 40
    per = 25

    def batch(b: int) -> pa.Table:
        # an upsert batch rewrites the previous batch's keys (new values) and adds as many new ones
        first = max(0, (b - 1) * per) if mode == "upsert" else b * per
        keys = list(range(first, (b + 1) * per))
        return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([b] * len(keys), pa.int64())})

    commit_batch(opts, [write_batch_files(opts, batch(0).to_batches(), 0, 0)], 0, tables)
    stop, errors, rounds = threading.Event(), [], [0]

    def maintenance():
        while not stop.is_set():
            try:
                compact_table(DeltaTable(str(path)))
                bound_log(str(path), 0, force=True)
                vacuum_table(DeltaTable(str(path)), 0, dry_run=False, force=True)
                rounds[0] += 1
            except Exception as e:  # noqa: BLE001 - a maintenance run may lose a race; the sink must not
                errors.append(e)

    other = threading.Thread(target=maintenance, daemon=True)
    other.start()
    try:
        for b in range(1, batches):
            commit_batch(opts, [write_batch_files(opts, batch(b).to_batches(), b, 0)], b, tables)
    finally:
        stop.set()
        other.join(timeout=60)

    assert rounds[0] > 0, errors[:3]
    got = DeltaTable(str(path)).to_pyarrow_table()
    keys = got.column("k").to_pylist()
    assert sorted(keys) == list(range(batches * per))  # none lost, none doubled
    if mode == "upsert":  # each key holds the value of the last batch that wrote it
        last = {k: v for k, v in zip(keys, got.column("v").to_pylist(), strict=True)}
        assert all(last[k] == min(k // per + 1, batches - 1) for k in keys)
    assert DeltaTable(str(path)).transaction_version(APP) == batches - 1
