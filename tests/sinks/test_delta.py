"""The Delta sink (isbflow.sinks.delta, its Spark writer isbflow.sinks.delta_spark) against a real
SparkSession local[2] and real tables."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from pyspark.errors import StreamingQueryException
from pyspark.sql import functions as F

from isbflow.sinks.delta import (
    DeltaSchemaMismatch,
    DeltaSinkDataSource,
    DeltaSinkOptionError,
    DeltaSinkOptions,
    commit_batch,
    merge_insert_missing,
    read_sink,
    replace_range,
    sink_app_id,
    sink_version,
    write_batch_files,
)
from isbflow.sinks.delta_spark import DeltaBatchWriter, batch_offsets
from tests.helpers.memory_source import memory_rows

APP = sink_app_id("logs", "out", "events")

pytestmark = pytest.mark.slow


# ----------------------------------------------------------------------------- fixtures


class FlakyBatchWriter(DeltaBatchWriter):
    """The Delta sink's writer failing once at batch 1, where ``fail_at`` says.

    ``task``: a Spark task of the batch's Parquet write raises while it writes
    (its file is open, rows are in it). ``driver``: the driver dies after the
    batch's files were written into the table folder and before the Delta
    commit; a dead driver runs no clean-up, so the batch's files stay behind.
    A marker file makes the failure happen only once.
    """

    def __init__(self, options, fail_at, marker):
        super().__init__(options)
        self.fail_at, self.marker = fail_at, marker

    def _fail_once(self) -> bool:
        try:
            with open(self.marker, "x"):
                return True
        except FileExistsError:
            return False

    def __call__(self, df, batch_id):
        if self.fail_at == "task" and batch_id == 1 and self._fail_once():
            # the last row of one task's share (ids 1000-1499 and 1500-1999): its file holds rows already
            boom = F.raise_error(F.lit("injected task failure while writing"))
            df = df.where(F.when(F.col("id") == 1499, boom).otherwise(F.lit(True)))
        return super().__call__(df, batch_id)

    def commit(self, message, batch_id):
        if self.fail_at == "driver" and batch_id == 1 and self._fail_once():
            assert message.actions and all(os.path.exists(os.path.join(self.options.path, a.path))
                                           for a in message.actions), "the files must be in the table"
            raise RuntimeError("injected driver failure before the Delta commit")
        return super().commit(message, batch_id)


def run_stream(spark, table: Path, checkpoint: Path, *, source=None, sink=None, flaky=None):
    """Run memory source -> the Delta sink's writer with availableNow to the end; return the query."""
    reader = spark.readStream.format("isb-memory")
    for k, v in {"rows": 2500, "batchRows": 1000, **(source or {})}.items():
        reader = reader.option(k, str(v))
    options = DeltaSinkOptions.from_options(
        {"path": str(table), "appId": APP, **{k: str(v) for k, v in (sink or {}).items()}})
    writer = FlakyBatchWriter(options, **flaky) if flaky else DeltaBatchWriter(options)
    query = (reader.load().writeStream.foreachBatch(writer)
             .option("checkpointLocation", str(checkpoint)).trigger(availableNow=True).start())
    query.awaitTermination()
    return query


def parquet_files(table: Path) -> set[str]:
    return {
        os.path.normpath(os.path.join(d, f))
        for d, _, fs in os.walk(table)
        if "_delta_log" not in d
        for f in fs
        if f.endswith(".parquet")
    }


def unreferenced(table: Path) -> set[str]:
    """Parquet files in the table folder that the current version does not reference."""
    referenced = {os.path.normpath(u) for u in DeltaTable(str(table)).file_uris()}
    return parquet_files(table) - referenced


def sorted_by_id(t: pa.Table) -> pa.Table:
    return t.sort_by("id")


def batch_commits(table: Path) -> list[dict]:
    """commitInfo of every version, oldest first."""
    return sorted(DeltaTable(str(table)).history(), key=lambda h: h["version"])


# ----------------------------------------------------------------------------- streaming


def test_stream_commits_one_version_per_batch(spark, tmp_path):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    meta = json.dumps({"isb.offsets": json.dumps({"src": {"row": 7}}), "owner": "tests"})
    query = run_stream(spark, table, ckpt, sink={"commitMetadata": meta})

    assert query.lastProgress["batchId"] == 2
    dt = DeltaTable(str(table))
    assert dt.version() == 2  # batches 0, 1, 2 -> versions 0, 1, 2
    assert dt.transaction_version(APP) == 2
    history = batch_commits(table)
    assert [h["isb.batchId"] for h in history] == [0, 1, 2]
    assert [h["isb.rows"] for h in history] == [1000, 1000, 500]
    assert history[-1]["isb.offsets"] == json.dumps({"src": {"row": 7}})
    assert history[-1]["owner"] == "tests"

    expected = memory_rows(0, 2500)
    got = sorted_by_id(read_sink(str(table)).select(expected.column_names))
    assert got.equals(expected.cast(got.schema))
    assert unreferenced(table) == set()

    # Spark itself reads the files of the current version to the same rows.
    df = spark.read.parquet(*dt.file_uris())
    assert df.count() == 2500
    back = sorted_by_id(df.toArrow().select(expected.column_names))
    assert back.column("id").equals(expected.column("id"))
    assert back.column("service").equals(expected.column("service"))
    assert back.column("value").equals(expected.column("value"))


def test_replayed_batch_commits_nothing_and_removes_its_files(spark, tmp_path):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    run_stream(spark, table, ckpt, source={"rows": 2000})
    assert sink_version(str(table)) == 1
    files_before = parquet_files(table)

    # The Delta commit of batch 1 landed, Spark's checkpoint commit did not.
    (ckpt / "commits" / "1").unlink()
    (ckpt / "commits" / ".1.crc").unlink(missing_ok=True)
    query = run_stream(spark, table, ckpt, source={"rows": 2000})

    assert query.lastProgress["batchId"] == 1
    assert query.lastProgress["numInputRows"] == 1000  # Spark really ran batch 1 again
    assert (ckpt / "commits" / "1").exists()
    assert sink_version(str(table)) == 1
    got = read_sink(str(table))
    assert got.num_rows == 2000
    assert pc.count_distinct(got["id"]).as_py() == 2000
    assert parquet_files(table) == files_before
    assert unreferenced(table) == set()


def test_writer_commit_replay_is_a_no_op(tmp_path):
    """Driving the writer directly: the second commit of batch 0 adds nothing."""
    path = str(tmp_path / "t")
    writer = DeltaSinkDataSource({"path": path, "appId": APP}).streamWriter(
        schema=None, overwrite=False
    )
    rows = memory_rows(0, 300)
    first = write_batch_files(writer.options, rows.to_batches(max_chunksize=100), 0, 0)
    writer.commit([first, None], 0)
    assert sink_version(path) == 0

    again = write_batch_files(writer.options, rows.to_batches(), 0, 1)
    (replay_file,) = [tmp_path / "t" / a.path for a in again.actions]
    assert replay_file.exists()
    result = commit_batch(writer.options, [again], 0)

    assert result.version is None and result.skipped_reason
    assert not replay_file.exists()
    assert sink_version(path) == 0
    assert read_sink(path).num_rows == 300
    assert unreferenced(tmp_path / "t") == set()


@pytest.mark.parametrize("fail_at", ["task", "driver"])
def test_failed_batch_rerun_leaves_no_duplicates(spark, tmp_path, fail_at):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    flaky = {"fail_at": fail_at, "marker": tmp_path / "failed-once"}
    with pytest.raises(StreamingQueryException, match="injected"):
        run_stream(spark, table, ckpt, flaky=flaky)

    assert (tmp_path / "failed-once").exists()
    assert read_sink(str(table)).num_rows == 1000  # only batch 0 is in the table
    if fail_at == "task":
        # abort removed what the failed task wrote (task 1 may still be finishing its file
        # while Spark aborts: the re-run's commit removes such stragglers)
        assert not [f for f in unreferenced(table) if os.path.basename(f).startswith("part-1-0-")]
    else:
        assert unreferenced(table)  # a driver crash leaves the batch's files behind

    run_stream(spark, table, ckpt, flaky=flaky)

    got = read_sink(str(table))
    assert got.num_rows == 2500
    assert pc.count_distinct(got["id"]).as_py() == 2500
    assert DeltaTable(str(table)).transaction_version(APP) == 2
    assert unreferenced(table) == set()


def test_partitioned_table(spark, tmp_path):
    table, ckpt = tmp_path / "t", tmp_path / "ckpt"
    run_stream(
        spark,
        table,
        ckpt,
        source={"rows": 1200, "batchRows": 600, "services": 3},
        sink={"partitionBy": "service"},
    )

    dt = DeltaTable(str(table))
    assert dt.metadata().partition_columns == ["service"]
    assert sorted(p.name for p in table.iterdir() if not p.name.startswith("_")) == [
        "service=svc-0",
        "service=svc-1",
        "service=svc-2",
    ]
    expected = memory_rows(0, 1200, services=3)
    got = sorted_by_id(read_sink(str(table)).select(expected.column_names))
    assert got.equals(expected.cast(got.schema))
    assert unreferenced(table) == set()

    df = spark.read.option("basePath", str(table)).parquet(*dt.file_uris())
    per_service = {r["service"]: r["count"] for r in df.groupBy("service").count().collect()}
    assert per_service == {"svc-0": 400, "svc-1": 400, "svc-2": 400}


def test_partition_values_are_escaped_and_null_safe(tmp_path):
    path = tmp_path / "t"
    options = DeltaSinkOptions(str(path), APP, partition_by=("service",))
    rows = pa.table(
        {"id": pa.array([1, 2, 3, 4], pa.int64()), "service": ["a b", "x/y", None, "a b"]}
    )
    message = write_batch_files(options, rows.to_batches(), 0, 0)
    commit_batch(options, [message], 0)

    got = sorted_by_id(read_sink(str(path)).select(["id", "service"]))
    assert got.to_pylist() == rows.to_pylist()
    dirs = sorted(p.name for p in path.iterdir() if not p.name.startswith("_"))
    assert dirs == ["service=__HIVE_DEFAULT_PARTITION__", "service=a%20b", "service=x%2Fy"]


def test_stats_let_readers_prune_files(tmp_path):
    path = tmp_path / "t"
    options = DeltaSinkOptions(str(path), APP)
    for batch, (lo, hi) in enumerate([(0, 100), (100, 200)]):
        message = write_batch_files(options, memory_rows(lo, hi).to_batches(), batch, 0)
        commit_batch(options, [message], batch)

    adds = pa.table(DeltaTable(str(path)).get_add_actions(flatten=True)).to_pylist()
    first = min(adds, key=lambda a: a["min.id"])
    assert (first["num_records"], first["min.id"], first["max.id"]) == (100, 0, 99)
    assert first["null_count.service"] == 0
    stats = json.loads(
        next(
            json.loads(line)["add"]["stats"]
            for line in (path / "_delta_log" / "00000000000000000000.json").read_text().splitlines()
            if '"add"' in line
        )
    )
    # row 99 is 99 ms after the base; Delta keeps milliseconds
    assert stats["minValues"]["ts"] == "2024-01-01T00:00:00.000Z"
    assert stats["maxValues"]["ts"] == "2024-01-01T00:00:00.099Z"
    assert len(DeltaTable(str(path)).file_uris(file_pruning_predicate="id >= 150")) == 1


def test_schema_mismatch_is_refused(tmp_path):
    path = str(tmp_path / "t")
    options = DeltaSinkOptions(path, APP)
    commit_batch(options, [write_batch_files(options, memory_rows(0, 10).to_batches(), 0, 0)], 0)
    other = pa.table({"id": pa.array([1], pa.int64()), "extra": ["x"]})
    with pytest.raises(DeltaSchemaMismatch, match="differ from the table"):
        commit_batch(options, [write_batch_files(options, other.to_batches(), 1, 0)], 1)
    assert sink_version(path) == 0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"path": "/abs/t"}, "appId is required"),
        ({"path": "rel/t", "appId": APP}, "absolute"),
        ({"path": "/abs/t", "appId": APP, "commitMetadata": "[1]"}, "JSON object"),
    ],
)
def test_bad_options_are_explained(options, match):
    with pytest.raises(DeltaSinkOptionError, match=match):
        DeltaSinkOptions.from_options(options)


# ----------------------------------------------------------------------------- helpers


def test_merge_insert_missing_inserts_only_missing(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, memory_rows(0, 100))

    result = merge_insert_missing(path, memory_rows(50, 150), key="id", app_id=APP, version=4)
    assert result.inserted == 50
    assert result.version == 1
    assert DeltaTable(path).transaction_version(APP) == 4

    again = merge_insert_missing(path, memory_rows(0, 150), key="id", app_id=APP, version=2)
    assert again.inserted == 0
    assert DeltaTable(path).transaction_version(APP) == 4  # never lowered

    got = sorted_by_id(read_sink(path))
    assert got.equals(memory_rows(0, 150).cast(got.schema))


def test_merge_insert_missing_creates_the_table(tmp_path):
    path = str(tmp_path / "t")
    result = merge_insert_missing(path, memory_rows(0, 10), key="id")
    assert (result.version, result.inserted) == (0, 10)


def test_replace_range_replaces_exactly_the_range_in_one_commit(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, memory_rows(0, 100))
    before = sink_version(path)
    ids = pa.array(range(20, 25), pa.int64())
    new = memory_rows(20, 25).set_column(2, "value", pa.array([-1.0] * 5))
    assert new["id"].combine_chunks().equals(ids)

    version = replace_range(path, new, "id >= 20 AND id < 30")

    assert version == before + 1
    got = sorted_by_id(read_sink(path))
    assert got.num_rows == 95
    kept = got.filter(pc.or_(pc.less(got["id"], 20), pc.greater_equal(got["id"], 30)))
    old = memory_rows(0, 100)
    old_kept = old.filter(pc.or_(pc.less(old["id"], 20), pc.greater_equal(old["id"], 30)))
    assert kept.equals(old_kept.cast(kept.schema))
    replaced = got.filter(pc.and_(pc.greater_equal(got["id"], 20), pc.less(got["id"], 30)))
    assert replaced["id"].to_pylist() == list(range(20, 25))
    assert replaced["value"].to_pylist() == [-1.0] * 5
    # the version before still reads the old range: the replacement was one atomic commit
    assert DeltaTable(path, version=before).to_pyarrow_table().num_rows == 100


def _id_rows(seqs: list[int]) -> pa.Table:
    return pa.table({"_isb_id": pa.array([f"in/0/{s}" for s in seqs]), "v": pa.array(seqs, pa.int64())})


def test_merge_mode_appends_what_the_ledger_proves_new_and_merges_the_rest(tmp_path):
    """mode=merge (a recovery's replay): a batch whose source offsets the table's commits never
    recorded is committed as written (no merge); one overlapping them is merged on _isb_id; either
    way nothing is doubled and nothing lost."""
    path = tmp_path / "raw"
    normal = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    held = list(range(1, 101)) + list(range(151, 201))  # what the sink held at the loss (holes: 101-150)
    commit_batch(normal, [write_batch_files(normal, _id_rows(held).to_batches(), 0, 0)], 0)

    replay = DeltaSinkOptions.from_options({"path": str(path), "appId": APP + "#e1", "mode": "merge"})

    def commit(batch_id: int, seqs: list[int]):
        result = commit_batch(replay, [write_batch_files(replay, _id_rows(seqs).to_batches(), batch_id, 0)],
                              batch_id)
        return result, DeltaTable(str(path)).history(1)[0]

    overlapping, h = commit(0, list(range(91, 161)))  # 91-100 and 151-160 held, 101-150 missing
    assert (overlapping.rows, overlapping.dropped) == (50, 20)
    assert h.get("isb.mergePath") is None and h["isb.operation"] == "merge_insert_missing"
    beyond, h = commit(1, list(range(201, 301)))  # nothing of it held: the ledger fast path
    assert (beyond.rows, beyond.dropped) == (100, 0)
    assert h["isb.mergePath"] == "ledger-append" and h["isb.operation"] == "merge_insert_missing"
    assert json.loads(h["isb.offsets"]) == {"in/0": [[201, 300]]}
    # a row whose id names no source offset: the ledger cannot vouch for it, so the batch merges
    odd = pa.table({"_isb_id": ["in/0/301", "files/x.json#7"], "v": pa.array([301, 0], pa.int64())})
    result = commit_batch(replay, [write_batch_files(replay, odd.to_batches(), 2, 0)], 2)
    assert DeltaTable(str(path)).history(1)[0].get("isb.mergePath") is None and result.rows == 2

    ids = read_sink(str(path)).column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)) == 302
    assert set(ids) == {f"in/0/{s}" for s in range(1, 302)} | {"files/x.json#7"}
    # and the replay's commits record the app transaction like any other
    assert DeltaTable(str(path)).transaction_version(APP + "#e1") == 2


def test_a_large_merge_batch_is_merged_in_chunks_and_a_crash_between_them_doubles_nothing(tmp_path, monkeypatch):
    """mode=merge, a batch of more than MERGE_CHUNK_ROWS rows the ledger cannot prove new (a replay's
    larger batch): merged in chunks, each commit recording its rows' offsets, the app transaction on
    the last; the driver dies after two chunks, the batch runs again: every id once."""
    from isbflow.sinks import delta_commit

    monkeypatch.setattr(delta_commit, "MERGE_CHUNK_ROWS", 40)
    path = tmp_path / "raw"
    normal = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    held = list(range(1, 101)) + list(range(151, 201))
    commit_batch(normal, [write_batch_files(normal, _id_rows(held).to_batches(), 0, 0)], 0)
    replay = DeltaSinkOptions.from_options({"path": str(path), "appId": APP + "#e1", "mode": "merge"})
    seqs = list(range(91, 251))  # 160 rows: 4 chunks of 40, held and missing mixed
    merged_rows = []
    real = delta_commit.merge_insert_missing

    def dies_at_the_third(path, table, **kw):
        merged_rows.append(table.num_rows)
        if len(merged_rows) == 3:
            raise RuntimeError("driver died")
        return real(path, table, **kw)

    monkeypatch.setattr(delta_commit, "merge_insert_missing", dies_at_the_third)
    with pytest.raises(RuntimeError, match="driver died"):
        commit_batch(replay, [write_batch_files(replay, _id_rows(seqs).to_batches(), 0, 0)], 0)
    assert merged_rows == [40, 40, 40]
    t = DeltaTable(str(path))
    assert t.transaction_version(APP + "#e1") is None  # the batch is not committed yet
    for h in t.history(2):  # each chunk's commit names the offsets of the rows it was given
        assert h["isb.operation"] == "merge_insert_missing" and h["isb.rows"] == 40
    assert sorted(json.loads(h["isb.offsets"])["in/0"] for h in t.history(2)) == [[[91, 130]], [[131, 170]]]

    monkeypatch.setattr(delta_commit, "merge_insert_missing", real)
    again = commit_batch(replay, [write_batch_files(replay, _id_rows(seqs).to_batches(), 0, 1)], 0)
    assert (again.rows, again.dropped) == (50, 110)  # 201-250; the first attempt inserted 101-150
    t = DeltaTable(str(path))
    assert t.transaction_version(APP + "#e1") == 0
    assert json.loads(t.history(1)[0]["isb.offsets"]) == {"in/0": [[91, 250]]}  # the batch's, on the last
    ids = read_sink(str(path)).column("_isb_id").to_pylist()
    assert len(ids) == len(set(ids)) == 250
    assert set(ids) == {f"in/0/{s}" for s in range(1, 251)}
    skipped = commit_batch(replay, [write_batch_files(replay, _id_rows(seqs).to_batches(), 0, 2)], 0)
    assert skipped.version is None and read_sink(str(path)).num_rows == 250


def test_batch_offsets_read_the_ids_of_the_batch_files(tmp_path):
    """The Spark writer's offsets: the _isb_id column of the batch's files, over several files, with
    holes, a repeated id and ids that name no offset."""
    ids = [f"in/0/{s}" for s in (1, 2, 3, 5, 9, 3)] + [f"in/1/{s}" for s in range(10, 20)] \
        + ["in/1/12", "files/x.json#7", None, "in/2/x", "in/2/-4", "nopart", "a/b/c/7", "a/b/1/7"]
    files = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(pa.table({"_isb_id": pa.array(ids[:8], pa.string())}), files[0])
    pq.write_table(pa.table({"v": pa.array(range(len(ids) - 8)), "_isb_id": pa.array(ids[8:], pa.string())}),
                   files[1])

    got = batch_offsets(files)

    assert got == {"a/b/1": [[7, 7]], "in/0": [[1, 3], [5, 5], [9, 9]], "in/1": [[10, 19]]}
    assert batch_offsets([]) == {}
