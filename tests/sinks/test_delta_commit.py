"""The Delta sink's driver commit (isbflow.sinks.delta_commit): bounded work per commit, exactly once.

Driven without Spark (the executor function writes the files, the driver function commits them),
against real Delta tables.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from isbflow.sinks import delta_commit
from isbflow.sinks.delta import (
    DeltaSinkOptions,
    commit_batch,
    read_sink,
    remove_unreferenced_batch_files,
    sink_app_id,
    write_batch_files,
)
from isbflow.sinks.delta_files import PENDING_DIR

APP = sink_app_id("logs", "out", "events")


def rows(first: int, n: int) -> pa.Table:
    seqs = list(range(first, first + n))
    return pa.table({"_isb_id": [f"in/0/{s}" for s in seqs], "v": pa.array(seqs, pa.int64()),
                     "service": [f"svc-{s % 3}" for s in seqs]})


def parquet_files(table: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), table) for d, _, fs in os.walk(table)
            if "_delta_log" not in d for f in fs if f.endswith(".parquet")}


def referenced(table: Path) -> set[str]:
    return {os.path.relpath(u.removeprefix("file://"), table) for u in DeltaTable(str(table)).file_uris()}


@pytest.mark.parametrize("partition_by", ["", "service"])
def test_commits_find_the_batch_files_without_walking_the_table(tmp_path, partition_by):
    """Many earlier batches and a stray file of another batch in the folder: a commit, a replayed
    batch, an empty batch and an abort touch only their own batch's files."""
    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "partitionBy": partition_by})
    for b in range(5):
        commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b)
    # a failed task attempt of batch 6, still pending: its files must survive batch 5's commit
    stray = write_batch_files(opts, rows(900, 3).to_batches(), 6, 1)
    stray_files = {a.path for a in stray.actions}

    with pytest.MonkeyPatch.context() as m:
        m.setattr(os, "walk", lambda *a, **k: (_ for _ in ()).throw(AssertionError("walked the table")))
        m.setattr(DeltaTable, "file_uris", lambda *a, **k: (_ for _ in ()).throw(AssertionError("listed")))
        failed = write_batch_files(opts, rows(51, 10).to_batches(), 5, 0)  # an attempt whose task failed
        done = commit_batch(opts, [write_batch_files(opts, rows(51, 10).to_batches(), 5, 1)], 5)
        replay = write_batch_files(opts, rows(51, 10).to_batches(), 5, 2)
        skipped = commit_batch(opts, [replay], 5)
        empty = commit_batch(opts, [], 7)
        aborted = remove_unreferenced_batch_files(str(path), APP, 6)

    assert done.version == 5 and done.rows == 10
    assert skipped.version is None and skipped.skipped_reason
    assert empty.skipped_reason == "empty batch"
    assert aborted == len(stray_files)  # the abort of batch 6 removed its failed attempt's files
    on_disk = parquet_files(path)
    assert not ({a.path for a in failed.actions} | {a.path for a in replay.actions} | stray_files) & on_disk
    assert on_disk == referenced(path)
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 61))
    assert os.listdir(path / PENDING_DIR) == []  # every batch's pending folder is gone


def test_a_crash_between_commit_and_clean_up_keeps_the_committed_files(tmp_path):
    """The Delta commit landed, the driver died before cleaning up: the replayed batch is skipped,
    the files the landed commit references stay, the replay's own files go."""
    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    commit_batch(opts, [write_batch_files(opts, rows(1, 10).to_batches(), 0, 0)], 0)
    with pytest.MonkeyPatch.context() as m:  # "crash": no clean-up after the commit of batch 1
        m.setattr(delta_commit, "remove_unreferenced_batch_files", lambda *a, **k: 0)
        landed = commit_batch(opts, [write_batch_files(opts, rows(11, 10).to_batches(), 1, 0)], 1)
    assert landed.version == 1
    assert (path / PENDING_DIR).is_dir() and os.listdir(path / PENDING_DIR)

    replay = write_batch_files(opts, rows(11, 10).to_batches(), 1, 0)
    result = commit_batch(opts, [replay], 1)

    assert result.version is None
    assert not (path / replay.actions[0].path).exists()
    assert parquet_files(path) == referenced(path)
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 21))
    assert os.listdir(path / PENDING_DIR) == []


def test_an_abort_after_a_landed_commit_keeps_its_files(tmp_path):
    """Spark re-runs a batch whose commit landed and a task of the re-run fails: the abort removes
    the re-run's files, never the ones the table references."""
    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    with pytest.MonkeyPatch.context() as m:
        m.setattr(delta_commit, "remove_unreferenced_batch_files", lambda *a, **k: 0)
        commit_batch(opts, [write_batch_files(opts, rows(1, 10).to_batches(), 0, 0)], 0)
    rerun = write_batch_files(opts, rows(1, 10).to_batches(), 0, 1)

    assert remove_unreferenced_batch_files(str(path), APP, 0) == 1

    assert not (path / rerun.actions[0].path).exists()
    assert parquet_files(path) == referenced(path)
    assert read_sink(str(path)).num_rows == 10


def test_a_sink_that_keeps_its_table_loads_it_once_and_reads_it_forward(tmp_path, monkeypatch):
    """The commits of one sink (DeltaBatchWriter's TableCache): the table is loaded for the first commit
    that finds one and read forward after (a load reads the checkpoint and every commit after it); a
    replayed batch is still told apart, and a commit by another writer meanwhile is seen."""
    from deltalake import write_deltalake

    from isbflow.local import delta as local_delta
    from isbflow.local.delta import TableCache

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    tables = TableCache(str(path))
    loads = []
    real = local_delta.DeltaTable
    monkeypatch.setattr(local_delta, "DeltaTable", lambda *a, **k: loads.append(a) or real(*a, **k))
    for b in range(4):
        done = commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
        assert done.version == b
    write_deltalake(str(path), rows(900, 1), mode="append")  # another writer: version 4
    replay = commit_batch(opts, [write_batch_files(opts, rows(31, 10).to_batches(), 3, 0)], 3, tables)
    assert replay.version is None and "already holds batch 3" in replay.skipped_reason
    done = commit_batch(opts, [write_batch_files(opts, rows(41, 10).to_batches(), 4, 0)], 4, tables)
    assert done.version == 5
    assert len(loads) == 2  # the first commit finds no table; its version loads the new one; then read forward
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == [*range(1, 51), 900]


def delta_rs_calls(monkeypatch) -> list[str]:
    """The names of the delta-rs calls that list the whole log (read forward, commit), as they come."""
    calls: list[str] = []
    for name in ("update_incremental", "create_write_transaction"):
        real = getattr(DeltaTable, name)
        monkeypatch.setattr(DeltaTable, name, lambda self, *a, _n=name, _r=real, **k: calls.append(_n) or _r(self, *a, **k))
    return calls


def test_appends_commit_without_listing_the_log_while_the_sink_alone_commits(tmp_path, monkeypatch):
    """A sink that keeps its table (TableCache) appends its batches without reading the table forward
    or committing through delta-rs, each of which lists the whole log (bench/delta_log.py): it writes
    the next commit file itself, with what delta-rs writes (the batch's files, the app transaction,
    isbflow's metadata), and readers see every batch. A commit by another writer lands in the version
    the batch was about to take: the batch commits after it, through delta-rs, and the version is right."""
    from deltalake import write_deltalake

    from isbflow.isb import ledger
    from isbflow.local.delta import TableCache, commit_action, table_history

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    tables = TableCache(str(path))
    calls = delta_rs_calls(monkeypatch)
    for b in range(4):
        done = commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 5).to_batches(), b, 0),
                                   write_batch_files(opts, rows(b * 10 + 6, 5).to_batches(), b, 1)], b, tables)
        assert done.version == b == DeltaTable(str(path)).version() and done.rows == 10
    assert calls == []  # batch 0 created the table; 1-3 were appended by the cache

    log = path / "_delta_log"
    info = commit_action(log, 3, "commitInfo")
    assert info["operation"] == "WRITE" and info["operationParameters"]["mode"] == "Append"
    assert (info["isb.appId"], info["isb.batchId"], info["isb.rows"]) == (APP, 3, 10)
    assert commit_action(log, 3, "txn") == {"appId": APP, "version": 3}
    assert [h["version"] for h in table_history(DeltaTable(str(path)))] == [3, 2, 1, 0]
    assert DeltaTable(str(path)).transaction_version(APP) == 3
    assert ledger.from_delta_history(str(path)) == {"in/0": [[1, 40]]}  # each commit's isb.offsets
    assert parquet_files(path) == referenced(path)
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 41))

    # a replayed batch is told apart without reading the table
    replay = commit_batch(opts, [write_batch_files(opts, rows(31, 10).to_batches(), 3, 0)], 3, tables)
    assert replay.version is None and "already holds batch 3" in replay.skipped_reason and calls == []

    note = delta_commit._note_committing

    def another_writer_first(*a, **k):  # a commit lands in the version this batch was about to take
        note(*a, **k)
        if not [c for c in calls if c == "other"]:
            calls.append("other")
            write_deltalake(str(path), rows(900, 1), mode="append")

    monkeypatch.setattr(delta_commit, "_note_committing", another_writer_first)
    done = commit_batch(opts, [write_batch_files(opts, rows(41, 10).to_batches(), 4, 0)], 4, tables)
    assert done.version == 5 == DeltaTable(str(path)).version()  # version 4 is the other writer's
    assert "create_write_transaction" in calls
    monkeypatch.setattr(delta_commit, "_note_committing", note)
    calls.clear()
    done = commit_batch(opts, [write_batch_files(opts, rows(51, 10).to_batches(), 5, 0)], 5, tables)
    assert done.version == 6 and calls == ["update_incremental"]  # read forward once, then appended
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == [*range(1, 61), 900]
    assert DeltaTable(str(path)).transaction_version(APP) == 5


def test_appends_write_the_checkpoint_delta_rs_would(tmp_path, monkeypatch):
    """Every ``delta.checkpointInterval`` versions (delta-rs' post-commit hook) the appending cache
    writes a checkpoint; a table loaded from it alone holds every row."""
    from isbflow.local import delta as local_delta
    from isbflow.local.delta import TableCache

    monkeypatch.setattr(local_delta, "DEFAULT_CHECKPOINT_INTERVAL", 3)
    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    tables = TableCache(str(path))
    for b in range(8):
        commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
    log = path / "_delta_log"
    assert sorted(f for f in os.listdir(log) if "checkpoint.parquet" in f) == [
        f"{v:020d}.checkpoint.parquet" for v in (3, 6)]
    assert json.loads((log / "_last_checkpoint").read_text())["version"] == 6
    for v in range(6):  # what the checkpoint covers need not be read
        (log / f"{v:020d}.json").unlink()
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 81))
    assert DeltaTable(str(path)).transaction_version(APP) == 7


def test_partitioned_appends_read_back_as_delta_rs_commits_do(tmp_path, monkeypatch):
    """Partition values that need escaping (a space, a slash, a percent sign, non-ASCII, null): the
    cache's own commits name the files as delta-rs does (the same rows and values read back)."""
    from isbflow.local import delta as local_delta
    from isbflow.local.delta import TableCache

    values = ["a b", "c/d", "e%f", "ü=1", None]
    got = {}
    for how in ("delta-rs", "cache"):
        path = tmp_path / how
        opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "partitionBy": "service"})
        tables = TableCache(str(path))
        calls = delta_rs_calls(monkeypatch)
        if how == "delta-rs":  # a table the cache does not append to by itself
            monkeypatch.setattr(local_delta, "appends_plainly", lambda table: False)
        for b in range(3):
            t = pa.table({"_isb_id": [f"in/0/{b * 5 + i}" for i in range(5)], "v": pa.array(range(5), pa.int64()),
                          "service": values})
            commit_batch(opts, [write_batch_files(opts, t.to_batches(), b, 0)], b, tables)
        # batch 0 creates the table either way; 1 and 2 are appended by delta-rs, or by the cache
        assert calls.count("create_write_transaction") == (2 if how == "delta-rs" else 0), (how, calls)
        table = DeltaTable(str(path))
        assert all(Path(u.removeprefix("file://")).exists() for u in table.file_uris())
        read = table.to_pyarrow_table()
        got[how] = sorted(zip(read.column("_isb_id").to_pylist(), read.column("service").to_pylist(), strict=True))
        assert parquet_files(path) == referenced(path)
        monkeypatch.undo()
    assert got["cache"] == got["delta-rs"] and len(got["cache"]) == 15


def test_a_table_that_asks_more_of_a_writer_is_committed_through_delta_rs(tmp_path, monkeypatch):
    """A CHECK constraint (writer version 3): the cache does not append by itself."""
    from isbflow.local.delta import TableCache, appends_plainly

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    commit_batch(opts, [write_batch_files(opts, rows(1, 10).to_batches(), 0, 0)], 0)
    assert appends_plainly(DeltaTable(str(path)))
    DeltaTable(str(path)).alter.add_constraint({"v_positive": "v > 0"})
    assert not appends_plainly(DeltaTable(str(path)))
    tables = TableCache(str(path))
    calls = delta_rs_calls(monkeypatch)
    for b in (1, 2):
        commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
    assert calls.count("create_write_transaction") == 2
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 31))



@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_kept_table_is_not_taken_for_current_when_maintenance_trimmed_the_log_after_it(tmp_path, mode):
    """When maintenance has folded, checkpointed and trimmed the log past the sink's kept table, the
    next version's file is absent though versions have come since; a commit written there would lie
    below the checkpoint, where no reader looks. The
    checkpoint's version tells it: the batch reads the table anew and commits after the checkpoint."""
    from isbflow.local.delta import TableCache
    from isbflow.sinks.delta_log import bound_log

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "mode": mode, "mergeKey": "_isb_id"})
    tables = TableCache(str(path))
    for b in range(3):
        commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
    bound_log(str(path), 0, force=True)  # fold (version 3), checkpoint, the commits before it removed
    log = path / "_delta_log"
    assert json.loads((log / "_last_checkpoint").read_text())["version"] >= 3  # past the kept table's 2
    done = commit_batch(opts, [write_batch_files(opts, rows(31, 10).to_batches(), 3, 0)], 3, tables)
    assert done.version is not None and done.version > 3
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 41))
    assert DeltaTable(str(path)).transaction_version(APP) == 3


def test_a_commit_a_checkpoint_overtook_is_taken_back_and_made_again(tmp_path, monkeypatch):
    """Maintenance folds, checkpoints and trims between the batch's look at the log and its commit:
    the version the batch takes is a hole below the checkpoint. The batch takes its file back and
    commits through delta-rs, after the checkpoint."""
    from isbflow.local.delta import TableCache
    from isbflow.sinks.delta_log import bound_log

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    tables = TableCache(str(path))
    for b in range(3):
        commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
    real_link, trimmed = os.link, []

    def maintenance_first(src, dst, *a, **k):
        if not trimmed and str(dst).endswith(".json"):
            trimmed.append(bound_log(str(path), 0, force=True))
            assert not os.path.exists(dst)  # the version the batch takes: removed by the trim
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(os, "link", maintenance_first)
    done = commit_batch(opts, [write_batch_files(opts, rows(31, 10).to_batches(), 3, 0)], 3, tables)
    assert trimmed and done.version is not None and done.version > 3
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == list(range(1, 41))
    assert DeltaTable(str(path)).transaction_version(APP) == 3
