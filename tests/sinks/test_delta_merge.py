"""Upserting aggregates: the Delta sink's ``mode=upsert`` (latest version of a key wins, a replayed
batch changes nothing), the spec's ``udf.output: update`` + ``keys``, and ``recompute_windows``
(windows rebuilt from the raw sink in batch, one commit). Real Delta tables; a real SparkSession
where Spark is the thing under test."""

from __future__ import annotations

import copy
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
import yaml
from deltalake import DeltaTable, write_deltalake

from isbflow.recovery.aggregates import AggregateError, recompute_windows
from isbflow.sinks.delta import (
    DeltaSinkError,
    DeltaSinkOptionError,
    DeltaSinkOptions,
    commit_batch,
    latest_per_key,
    read_sink,
    sink_app_id,
    sink_version,
    write_batch_files,
)
from isbflow.sinks.delta_spark import DeltaBatchWriter
from isbflow.spec import SpecError, load_specs
from isbflow.steps.update import VERSION_COLUMN, row_version
from spark_apps import logs
from tests.conftest import ROOT

APP = sink_app_id("logs", "minutely", "agg")
T0 = datetime(2025, 1, 1, tzinfo=UTC)
DEMO = ROOT / "pipelines" / "logs.yaml"
TS = pa.timestamp("us", tz="UTC")


def windows(*rows: tuple[int, str | None, int, int]) -> pa.Table:
    """Aggregate rows as an update step publishes them: (minute, service, count, version)."""
    return pa.table({
        "window_start": pa.array([T0 + timedelta(minutes=m) for m, *_ in rows], TS),
        "service": pa.array([s for _, s, *_ in rows], pa.string()),
        "count": pa.array([c for *_, c, _ in rows], pa.int64()),
        VERSION_COLUMN: pa.array([v for *_, v in rows], pa.int64()),
    })


def upsert_options(path: Path, **extra: str) -> DeltaSinkOptions:
    return DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "mode": "upsert",
                                          "mergeKey": "window_start,service",
                                          "versionColumn": VERSION_COLUMN, **extra})


def commit(options: DeltaSinkOptions, batch_id: int, *tasks: pa.Table):
    """One micro-batch: each table is what one Spark task wrote."""
    msgs = [write_batch_files(options, t.to_batches(), batch_id, i) for i, t in enumerate(tasks)]
    return commit_batch(options, msgs, batch_id)


def table_counts(path: Path) -> dict[tuple[int, str | None], int]:
    t = read_sink(str(path))
    assert t.column_names == ["window_start", "service", "count"], "the version column is never written"
    out = {(int((r["window_start"] - T0).total_seconds() // 60), r["service"]): r["count"] for r in t.to_pylist()}
    assert len(out) == t.num_rows, "a key twice in the table"
    return out


def task_files(path: Path) -> list[str]:
    """Parquet files the sink's Spark tasks wrote (``part-<batch>-<task>-<app>-<uuid>``) that the table
    does not hold: in upsert mode the driver merges their rows and removes them (the merge writes its
    own files: delta-rs', or the sink's under the same kind of name, isbflow.sinks.delta_upsert)."""
    held = {Path(u).name for u in DeltaTable(str(path)).file_uris()}
    return sorted(p.name for p in path.rglob("*.parquet")
                  if re.match(r"^part-\d+-\d+-[0-9a-f]{8}-[0-9a-f]{32}\.parquet$", p.name) and p.name not in held)


# ----------------------------------------------------------------------------- the sink


def test_latest_version_of_a_key_wins_within_a_batch(tmp_path):
    path = tmp_path / "agg"
    options = upsert_options(path)
    first = commit(options, 0, windows((0, "a", 1, 5), (0, "a", 3, 7), (0, "b", 4, 5)),
                   windows((0, "a", 2, 6), (1, "a", 9, 7), (0, None, 8, 5)))
    assert (first.version, first.rows, first.dropped) == (0, 4, 2)
    assert table_counts(path) == {(0, "a"): 3, (0, "b"): 4, (1, "a"): 9, (0, None): 8}
    assert DeltaTable(str(path)).transaction_version(APP) == 0

    # batch 1: two upstream batches changed (0, a); the rows come from two tasks
    second = commit(options, 1, windows((0, "a", 10, 8), (2, "c", 1, 8), (0, None, 9, 8)),
                    windows((0, "a", 11, 9)))
    assert (second.version, second.rows, second.dropped) == (1, 3, 1)
    assert table_counts(path) == {(0, "a"): 11, (0, "b"): 4, (1, "a"): 9, (2, "c"): 1, (0, None): 9}
    history = DeltaTable(str(path)).history(1)[0]
    assert (history["operation"], history["isb.operation"], history["isb.batchId"]) == ("MERGE", "merge_upsert", 1)
    assert task_files(path) == []


def test_a_replayed_batch_changes_nothing(tmp_path):
    path = tmp_path / "agg"
    options = upsert_options(path)
    commit(options, 0, windows((0, "a", 1, 0), (1, "a", 2, 0)))
    commit(options, 1, windows((0, "a", 5, 1)))
    before, version = table_counts(path), sink_version(str(path))

    # Spark runs batch 1 again (its checkpoint commit was lost); even different rows change nothing
    again = commit(options, 1, windows((0, "a", 99, 1), (7, "z", 1, 1)))
    assert again.version is None and "already holds batch 1" in again.skipped_reason
    older = commit(options, 0, windows((0, "a", 1, 0)))
    assert older.version is None
    assert sink_version(str(path)) == version
    assert table_counts(path) == before == {(0, "a"): 5, (1, "a"): 2}
    assert task_files(path) == []


def test_equal_versions_of_a_key_must_be_equal_rows(tmp_path):
    same = windows((0, "a", 3, 4), (0, "a", 3, 4), (1, "a", 1, 4))
    kept, dropped = latest_per_key(same, ["window_start", "service"], VERSION_COLUMN)
    assert (kept.num_rows, dropped, kept.column_names) == (2, 1, ["window_start", "service", "count"])
    with pytest.raises(DeltaSinkError, match="same _isb_version 4.*latest is undefined"):
        latest_per_key(windows((0, "a", 3, 4), (0, "a", 5, 4)), ["window_start", "service"], VERSION_COLUMN)
    with pytest.raises(DeltaSinkError, match="null _isb_version"):
        latest_per_key(windows((0, "a", 3, 4)).set_column(3, VERSION_COLUMN, pa.nulls(1, pa.int64())),
                       ["window_start", "service"], VERSION_COLUMN)


def test_without_a_version_a_repeated_key_is_refused(tmp_path):
    path = tmp_path / "agg"
    options = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "mode": "upsert",
                                             "mergeKey": "window_start,service"})
    commit(options, 0, windows((0, "a", 1, 0)).drop_columns([VERSION_COLUMN]))
    with pytest.raises(DeltaSinkError, match="1 row\\(s\\) repeat a key.*versionColumn"):
        commit(options, 1, windows((0, "a", 2, 1), (0, "a", 3, 2)).drop_columns([VERSION_COLUMN]))
    assert table_counts(path) == {(0, "a"): 1}


def test_merge_mode_with_versions_inserts_the_latest_of_missing_keys(tmp_path):
    """Recovery runs an upsert sink in merge mode: keys the table holds stay, missing keys get
    their latest version."""
    path = tmp_path / "agg"
    commit(upsert_options(path), 0, windows((0, "a", 5, 0)))
    merge = upsert_options(path, mode="merge", appId=APP + "#e1")
    result = commit(merge, 0, windows((0, "a", 1, 10), (1, "a", 1, 10), (1, "a", 2, 11)))
    assert (result.rows, result.dropped) == (1, 2)
    assert table_counts(path) == {(0, "a"): 5, (1, "a"): 2}


@pytest.mark.parametrize("options, match", [
    ({"mode": "bogus"}, "mode must be one of append, merge, upsert"),
    ({"mode": "append", "versionColumn": "v"}, "versionColumn must be .* with mode merge or upsert"),
    ({"mode": "upsert", "mergeKey": "k", "versionColumn": "k"}, "outside mergeKey"),
    ({"mode": "upsert", "versionColumn": "v-1"}, "plain column name"),
])
def test_bad_upsert_options_are_explained(options, match):
    with pytest.raises(DeltaSinkOptionError, match=match):
        DeltaSinkOptions.from_options({"path": "/abs/t", "appId": APP, **options})


def test_stream_upserts_with_spark(spark, tmp_path):
    """The stream writer in upsert mode: per service the row with the highest id of all batches."""
    from tests.helpers.memory_source import memory_rows

    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    writer = DeltaBatchWriter(DeltaSinkOptions.from_options(
        {"path": str(table), "appId": APP, "mode": "upsert", "mergeKey": "service", "versionColumn": "id"}))
    query = (spark.readStream.format("isb-memory").option("rows", "2500").option("batchRows", "1000").load()
             .writeStream.foreachBatch(writer).option("checkpointLocation", str(ckpt))
             .trigger(availableNow=True).start())
    query.awaitTermination()
    assert query.exception() is None
    got = read_sink(str(table)).sort_by("service")
    assert got.column_names == ["service", "value", "ts"]
    expected = memory_rows(2492, 2500).sort_by("service")  # 8 services: the last 8 ids are the latest
    assert got.column("service").equals(expected.column("service"))
    assert got.column("value").equals(expected.column("value"))
    assert [h["isb.batchId"] for h in sorted(DeltaTable(str(table)).history(), key=lambda h: h["version"])] \
        == [0, 1, 2]
    nope = DeltaBatchWriter(DeltaSinkOptions.from_options(
        {"path": str(tmp_path / "t2"), "appId": APP, "mode": "upsert", "mergeKey": "nope"}))
    with pytest.raises(Exception, match="mergeKey columns \\['nope'\\] are not in the stream's columns"):
        (spark.readStream.format("isb-memory").load().writeStream.foreachBatch(nope)
         .option("checkpointLocation", str(tmp_path / "ck2")).trigger(availableNow=True).start().awaitTermination())


def test_row_versions_grow_with_batch_and_epoch():
    assert row_version(0, 5) < row_version(0, 6) < row_version(1, 0) < row_version(1, 1)


# ----------------------------------------------------------------------------- the spec


def _demo_docs() -> list[dict]:
    return list(yaml.safe_load_all(DEMO.read_text()))


def _minutely(docs: list[dict]) -> dict:
    return next(v for v in docs[1]["spec"]["vertices"] if v["name"] == "minutely")


def _problems(tmp_path: Path, docs: list[dict]) -> list[str]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    with pytest.raises(SpecError) as e:
        load_specs(path)
    return [str(p).replace(str(path), "spec.yaml") for p in e.value.problems]


def test_the_demo_declares_minutely_as_an_update_step():
    udf = load_specs(DEMO).only_pipeline().vertex("minutely").udf
    assert (udf.output.value, udf.keys) == ("update", ["window_start", "service"])


def _edge(docs: list[dict], a: str, b: str) -> dict:
    return next(e for e in docs[1]["spec"]["edges"] if e["from"] == a and e["to"] == b)


def _add_udf(docs: list[dict]) -> None:
    """A step 'later' after minutely, and agg fed from it too."""
    spec = docs[1]["spec"]
    spec["vertices"].append({"name": "later", "udf": {"transform": "a:b"}})
    spec["edges"].append({"from": "minutely", "to": "later"})
    spec["edges"].append({"from": "later", "to": "agg"})


@pytest.mark.parametrize("change, problem", [
    (lambda d: _minutely(d)["udf"].pop("keys"),
     "spec.yaml: vertices[3].udf.keys: required when output is 'update'"),
    (lambda d: _minutely(d)["udf"].update(output="append"),
     "spec.yaml: vertices[3].udf.keys: only for output 'update'"),
    (lambda d: _minutely(d)["udf"].update(output="upsert"),
     "spec.yaml: vertices[3].udf.output: must be one of 'append', 'update', got 'upsert'"),
    (lambda d: _minutely(d)["udf"].update(keys=["window_start", "window start"]),
     "spec.yaml: vertices[3].udf.keys: must be plain column names"),
    (lambda d: _minutely(d)["udf"].update(keys=["service", "service"]),
     "spec.yaml: vertices[3].udf.keys: column(s) ['service'] named twice"),
    (lambda d: _edge(d, "minutely", "agg").update(partitionKey="errors"),
     "spec.yaml: edges[5].partitionKey: 'errors' is not one of the keys of 'minutely' (window_start, service)"),
    (_add_udf, "spec.yaml: edges[6].to: 'later' is a udf: 'minutely' has output 'update'"),
    (_add_udf, "spec.yaml: edges[5].to: sink 'agg' upserts the rows of 'minutely' (output 'update') and "
               "cannot take other inputs too (also fed by later)"),
])
def test_update_output_rules_name_file_and_field(tmp_path, change, problem):
    docs = copy.deepcopy(_demo_docs())
    change(docs)
    problems = _problems(tmp_path, docs)
    assert any(p.startswith(problem) for p in problems), problems


# ----------------------------------------------------------------------------- recompute_windows


RAW_SCHEMA = pa.schema([("ts", TS), ("service", pa.string()), ("latency_ms", pa.float64()),
                        ("is_error", pa.bool_()), ("_isb_id", pa.string())])


def _raw_rows() -> pa.Table:
    """24 records: minutes 0..2, services a/b, ids in/0/1..24 in time order."""
    rows = []
    for i in range(24):
        rows.append({"ts": T0 + timedelta(seconds=7.5 * i), "service": "ab"[i % 2], "latency_ms": float(10 + i),
                     "is_error": i % 5 == 0, "_isb_id": f"in/0/{i + 1}"})
    return pa.Table.from_pylist(rows, schema=RAW_SCHEMA)


def _batch(spark, raw: pa.Table) -> dict:
    out = logs.per_minute(spark.createDataFrame(raw.to_pandas())).toArrow()
    return {((r["window_start"] - T0).total_seconds() // 60, r["service"]): r for r in out.to_pylist()}


def _agg(path: Path) -> dict:
    t = DeltaTable(str(path)).to_pyarrow_table()
    out = {((r["window_start"] - T0).total_seconds() // 60, r["service"]): r for r in t.to_pylist()}
    assert len(out) == t.num_rows
    return out


def test_recompute_windows_replaces_exactly_the_touched_windows(spark, tmp_path):
    p = load_specs(DEMO).only_pipeline()
    raw_path, agg_path = tmp_path / "sinks/logs/raw", tmp_path / "sinks/logs/agg"
    raw = _raw_rows()
    write_deltalake(str(raw_path), raw)
    exact = _batch(spark, raw)
    assert sorted(exact) == [(m, s) for m in (0, 1, 2) for s in "ab"]
    assert [exact[(m, "a")]["count"] for m in (0, 1, 2)] == [4, 4, 4]
    # the aggregate as a partial replay left it: every count 1, plus a window no record makes
    wrong = pa.Table.from_pylist([{**r, "count": 1} for r in exact.values()], schema=None)
    stale = {**exact[(0, "a")], "window_start": T0 - timedelta(minutes=9),
             "window_end": T0 - timedelta(minutes=8), "count": 1}
    wrong = pa.concat_tables([wrong, pa.Table.from_pylist([stale], schema=wrong.schema)])
    write_deltalake(str(agg_path), wrong)
    v0 = sink_version(str(agg_path))

    # ids 9..12 are the records of minute 1 (7.5 s apart): only its two windows change
    n = recompute_windows(spark, p, "agg", tmp_path, {"in/0": [[9, 12]]})
    assert n == 2
    assert sink_version(str(agg_path)) == v0 + 1  # one commit
    got = _agg(agg_path)
    assert {k: r["count"] for k, r in got.items()} == {
        (0, "a"): 1, (0, "b"): 1, (1, "a"): 4, (1, "b"): 4, (2, "a"): 1, (2, "b"): 1, (-9, "a"): 1}
    assert got[(1, "a")] == exact[(1, "a")] and got[(1, "b")] == exact[(1, "b")]
    commit = DeltaTable(str(agg_path)).history(1)[0]
    assert (commit["isb.operation"], commit["isb.raw_sink"], commit["isb.raw_version"]) == (
        "recompute_windows", "raw", 0)

    # a predicate over the raw rows: every window of service b; a window is rebuilt from ALL its rows
    assert recompute_windows(spark, p, "agg", tmp_path, "service = 'b' AND _isb_id = 'in/0/2'") == 1
    assert _agg(agg_path)[(0, "b")] == exact[(0, "b")]
    assert recompute_windows(spark, p, "agg", tmp_path, {"in/0": []}) == 0  # nothing selected

    # everything: equal to the batch recomputation, the stale window gone, in one commit
    v = sink_version(str(agg_path))
    assert recompute_windows(spark, p, "agg", tmp_path) == 6
    assert sink_version(str(agg_path)) == v + 1
    assert _agg(agg_path) == exact
    assert pc.sum(DeltaTable(str(agg_path)).to_pyarrow_table()["count"]).as_py() == 24


def test_recompute_windows_explains_what_it_cannot_do(spark, tmp_path):
    p = load_specs(DEMO).only_pipeline()
    with pytest.raises(AggregateError, match="sink 'raw' .* is not fed by a step with udf.output: update"):
        recompute_windows(spark, p, "raw", tmp_path)
    with pytest.raises(AggregateError, match="no sink vertex 'nope'"):
        recompute_windows(spark, p, "nope", tmp_path)
    with pytest.raises(AggregateError, match="no raw sink"):
        recompute_windows(spark, p, "agg", tmp_path)  # no raw table yet
    write_deltalake(str(tmp_path / "sinks/logs/raw"), _raw_rows())
    with pytest.raises(AggregateError, match="windows_filter must be"):
        recompute_windows(spark, p, "agg", tmp_path, 42)
