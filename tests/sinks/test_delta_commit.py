"""The Delta sink's driver commit (isbflow.sinks.delta_commit): bounded work per commit, exactly once.

Driven without Spark (the executor function writes the files, the driver function commits them),
against real Delta tables.
"""

from __future__ import annotations

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


def test_a_commit_names_its_version_without_reading_the_table_forward(tmp_path, monkeypatch):
    """After its commit a batch reads its version off the next commit file (its app transaction in it),
    not by reading the table forward (a listing of the whole log): one read forward per batch, the
    one before its commit. A commit by another writer between the two: the version is still right."""
    from deltalake import write_deltalake

    from isbflow.local.delta import TableCache

    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP})
    tables = TableCache(str(path))
    forward = []
    real = DeltaTable.update_incremental
    monkeypatch.setattr(DeltaTable, "update_incremental", lambda self, *a, **k: forward.append(1) or real(self, *a, **k))
    for b in range(3):
        forward.clear()
        done = commit_batch(opts, [write_batch_files(opts, rows(b * 10 + 1, 10).to_batches(), b, 0)], b, tables)
        assert done.version == b == DeltaTable(str(path)).version()
        assert len(forward) == (0 if b == 0 else 1)  # batch 0 created the table; then one read each
    note = delta_commit._note_committing

    def another_writer_first(*a, **k):  # a commit lands after this batch read the table
        note(*a, **k)
        write_deltalake(str(path), rows(900, 1), mode="append")

    monkeypatch.setattr(delta_commit, "_note_committing", another_writer_first)
    done = commit_batch(opts, [write_batch_files(opts, rows(31, 10).to_batches(), 3, 0)], 3, tables)
    assert done.version == 4 == DeltaTable(str(path)).version()  # version 3 is the other writer's
    assert sorted(read_sink(str(path)).column("v").to_pylist()) == [*range(1, 41), 900]
