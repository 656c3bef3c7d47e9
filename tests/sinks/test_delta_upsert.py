"""An upsert sink's commit made by the sink itself (isbflow.sinks.delta_upsert): what a reader sees is
what delta-rs' merge leaves, it reads only the files that may hold a key of the batch, and a crash,
another writer or a table it cannot write fall back as the appends do.

Driven without Spark (the task's files written beforehand, the driver's commit through
:func:`commit_batch` with the sink's kept table), against real Delta tables.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from isbflow.local.delta import TableCache
from isbflow.sinks import delta_commit, delta_upsert
from isbflow.sinks.delta import (
    DeltaSinkOptions,
    commit_batch,
    read_sink,
    sink_app_id,
    write_batch_files,
)

APP = sink_app_id("logs", "minutely", "agg")
T0 = dt.datetime(2026, 11, 28, 12, 0, tzinfo=dt.UTC)
SCHEMA = pa.schema([("window_start", pa.timestamp("us", tz="UTC")), ("service", pa.string()),
                    ("count", pa.int64())])


def windows(minutes: list[int], services: list[str | None], count: int) -> pa.Table:
    """One row per (minute, service): what the per-minute step emits for the windows a batch changed."""
    keys = [(T0 + dt.timedelta(minutes=m), s) for m in minutes for s in services]
    return pa.table({"window_start": [k[0] for k in keys], "service": [k[1] for k in keys],
                     "count": [count] * len(keys)}, schema=SCHEMA)


def options(path: Path) -> DeltaSinkOptions:
    return DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "mode": "upsert",
                                          "mergeKey": "window_start,service"})


def commit(opts: DeltaSinkOptions, table: pa.Table, b: int, tables: TableCache):
    return commit_batch(opts, [write_batch_files(opts, table.to_batches(), b, 0)], b, tables)


def content(path: Path) -> list[tuple]:
    t = read_sink(str(path))
    return sorted(zip(*(t.column(c).to_pylist() for c in SCHEMA.names), strict=True),
                  key=lambda r: (r[0], r[1] or ""))


def parquet_files(table: Path) -> set[str]:
    return {os.path.relpath(os.path.join(d, f), table) for d, _, fs in os.walk(table)
            if "_delta_log" not in d for f in fs if f.endswith(".parquet")}


def referenced(table: Path) -> set[str]:
    return {os.path.relpath(u.removeprefix("file://"), table) for u in DeltaTable(str(table)).file_uris()}


def engines(path: Path) -> list[tuple[str, str]]:
    """(operation, engineInfo) of every commit, oldest first."""
    out = []
    for f in sorted((path / "_delta_log").glob("*.json")):
        info = json.loads(f.read_text().splitlines()[0])["commitInfo"]
        out.append((info["operation"], info.get("engineInfo", "")))
    return out


# batches of a per-minute aggregate: open windows updated again, new ones inserted, a null service
BATCHES = [
    windows([0, 1], ["a", "b"], 1),
    windows([1, 2], ["a", "b", None], 2),      # minute 1 updated, minute 2 new, a null key
    windows([2], [None, "c"], 3),               # the null key updated (nulls equal nulls)
    windows([0, 3], ["a"], 4),                  # a late row for minute 0, far from minute 3
    windows([3, 4], ["a", "b", "c"], 5),
]


def test_an_own_upsert_leaves_what_the_delta_rs_merge_leaves(tmp_path, monkeypatch):
    own, rs = tmp_path / "own", tmp_path / "rs"
    results = {}
    for path in (own, rs):
        with monkeypatch.context() as m:
            if path == rs:
                m.setattr(delta_commit, "own_upsert", lambda *a, **k: None)
            opts, tables = options(path), TableCache(str(path))
            results[path] = [commit(opts, t, b, tables) for b, t in enumerate(BATCHES)]
    assert content(own) == content(rs)
    assert len(content(own)) == 4 + 4 + 1 + 1 + 5  # every key once: each batch's new keys
    assert [(c.version, c.rows, c.dropped) for c in results[own]] == \
        [(c.version, c.rows, c.dropped) for c in results[rs]]
    # the first batch creates the table through delta-rs; every later one is the sink's own MERGE
    assert engines(own)[1:] == [("MERGE", "isbflow")] * 4, engines(own)
    assert all(e.startswith("delta-rs") for _, e in engines(rs)), engines(rs)
    table = DeltaTable(str(own))
    assert table.transaction_version(APP) == 4 and table.version() == 4
    assert parquet_files(own) >= referenced(own)  # every file the log holds is on disk
    history = table.history()
    assert history[0]["operation"] == "MERGE" and history[0]["isb.key"] == "window_start,service"
    # the metrics delta-rs' merge reports, for the last batch: (3, a) updated, five keys inserted
    metrics = history[0]["operationMetrics"]
    assert (metrics["num_target_rows_updated"], metrics["num_target_rows_inserted"]) == (1, 5), metrics
    assert metrics["num_source_rows"] == 6 and metrics["num_target_files_removed"] == 1, metrics


def test_an_own_upsert_reads_only_the_files_its_keys_may_be_in(tmp_path, monkeypatch):
    """A window closes and is not changed again: its rows go to a file of their own (once they are
    KEEP_APART_ROWS), which no later batch reads (the files' window_start stats lie before the batch's)
    or writes again."""
    monkeypatch.setattr(delta_upsert, "KEEP_APART_ROWS", 3)
    read = []
    real = delta_upsert._read
    monkeypatch.setattr(delta_upsert, "_read", lambda root, paths, schema: read.append(paths) or real(root, paths, schema))
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b in range(12):  # minute b opens and minute b-1 gets its last update
        commit(opts, windows([b - 1, b] if b else [0], ["a", "b", "c"], b), b, tables)
    per_batch = []
    for b in range(12, 16):
        read.clear()
        commit(opts, windows([b - 1, b], ["a", "b", "c"], b), b, tables)
        per_batch.append(len(read[-1]))
    assert max(per_batch) <= 2, per_batch  # the files of the last batch or two, never the whole table
    assert len(DeltaTable(str(path)).file_uris()) >= 5  # closed windows stayed in files of their own
    rows = content(path)
    # minute m was last changed by batch m + 1 (the last one's by its own batch)
    assert len(rows) == 16 * 3 and all(r[2] == min(m + 1, 15) for m in range(16) for r in rows
                                       if r[0] == T0 + dt.timedelta(minutes=m)), rows


def test_a_crash_between_an_own_upsert_and_its_clean_up_keeps_the_files_it_committed(tmp_path, monkeypatch):
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b in range(2):
        commit(opts, BATCHES[b], b, tables)

    def die(*a, **k):
        raise SystemExit("the driver died after the commit")

    with monkeypatch.context() as m:
        m.setattr(delta_commit, "_clean_up", die)
        with pytest.raises(SystemExit):
            commit(opts, BATCHES[2], 2, tables)
    assert engines(path)[-1] == ("MERGE", "isbflow")
    again = commit(opts, BATCHES[2], 2, TableCache(str(path)))  # the batch run again after the restart
    assert again.version is None and again.skipped_reason
    assert referenced(path) <= parquet_files(path)  # the clean-up of the replay kept the committed files
    want = tmp_path / "want"
    wopts, wtables = options(want), TableCache(str(want))
    for b in range(3):
        commit(wopts, BATCHES[b], b, wtables)
    assert content(path) == content(want)


def test_an_own_upsert_that_loses_its_version_merges_through_delta_rs(tmp_path, monkeypatch):
    """Another writer (maintenance) commits between the sink's look at the log and its link: nothing of
    the sink's own commit stays, the batch merges through delta-rs on the table loaded anew."""
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b in range(2):
        commit(opts, BATCHES[b], b, tables)
    real_link, taken = os.link, []

    def another_writer_first(src, dst, *a, **k):
        if not taken and str(dst).endswith(".json"):  # maintenance sets a table property: version 2
            taken.append(DeltaTable(str(path)).alter.set_table_properties({"delta.checkpointInterval": "100"}))
        return real_link(src, dst, *a, **k)

    monkeypatch.setattr(os, "link", another_writer_first)
    done = commit(opts, BATCHES[2], 2, tables)
    assert taken and done.version == 3
    assert len(engines(path)) == 4 and engines(path)[-1][0] == "MERGE" and engines(path)[-1][1].startswith("delta-rs")
    # nothing of the sink's own attempt stays: its files were the batch's pending ones
    assert not [p for p in parquet_files(path) if p.startswith(f"part-2-{delta_upsert.UPSERT_TASK}-")]
    want = tmp_path / "want"
    wopts, wtables = options(want), TableCache(str(want))
    for b in range(3):
        commit(wopts, BATCHES[b], b, wtables)
    assert content(path) == content(want)


def test_a_partitioned_upsert_sink_merges_through_delta_rs(tmp_path):
    path = tmp_path / "t"
    opts = DeltaSinkOptions.from_options({"path": str(path), "appId": APP, "mode": "upsert",
                                          "mergeKey": "window_start,service", "partitionBy": "service"})
    tables = TableCache(str(path))
    for b in range(3):
        commit(opts, BATCHES[b].filter(pa.compute.is_valid(BATCHES[b].column("service"))), b, tables)
    assert all(e.startswith("delta-rs") for _, e in engines(path)), engines(path)
    assert len(content(path)) == 7


def test_keys_pyarrow_cannot_join_on_merge_through_delta_rs(tmp_path, monkeypatch):
    """A key type the sink's hash join does not take (pyarrow raises): the batch merges through
    delta-rs instead of failing the step."""
    def cannot(*a, **k):
        raise pa.ArrowNotImplementedError("hash join on this key type")

    monkeypatch.setattr(delta_upsert, "_match_table", cannot)
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b in range(3):
        commit(opts, BATCHES[b], b, tables)
    assert all(e.startswith("delta-rs") for _, e in engines(path)), engines(path)
    assert len(content(path)) == 9
    assert not [p for p in parquet_files(path) if f"-{delta_upsert.UPSERT_TASK}-" in p]


@pytest.mark.parametrize("fallback", [1, 2])
def test_a_batch_merged_through_delta_rs_in_between_leaves_the_next_own_upsert_right(tmp_path, monkeypatch,
                                                                                     fallback):
    """The sink's own upsert gives up after it listed the table's files (here: a file it cannot read as
    the table's columns) and batch ``fallback`` merges through delta-rs. Batch 1: the merge moves the
    kept table, and the next batch's own upsert must start from the files of that version, not the
    listing before (fails without TableCache.files' version check). Batch 2: the sink's own commit of
    batch 1 is ahead of the kept table, which delta-rs must not commit on unread (it failed with "a
    concurrent transaction added new data")."""
    real, calls = delta_upsert._read, []

    def unreadable_once(root, paths, schema):
        calls.append(paths)
        return None if len(calls) == fallback else real(root, paths, schema)

    monkeypatch.setattr(delta_upsert, "_read", unreadable_once)
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b, t in enumerate(BATCHES):
        commit(opts, t, b, tables)
    kinds = [e.startswith("delta-rs") for _, e in engines(path)]
    assert kinds == [True] + [b == fallback for b in range(1, len(BATCHES))], engines(path)
    want = tmp_path / "want"
    with monkeypatch.context() as m:
        m.setattr(delta_commit, "own_upsert", lambda *a, **k: None)
        wopts, wtables = options(want), TableCache(str(want))
        for b, t in enumerate(BATCHES):
            commit(wopts, t, b, wtables)
    assert content(path) == content(want)
