"""The sink's own Delta commits keep the protocol: what they must refuse, and what they must never do.

Each case drives the sink's driver commit (isbflow.sinks.delta_commit, isbflow.local.delta.TableCache)
against a real table, with another writer (delta-rs) acting where a race would put it.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from isbflow.local import delta as local_delta
from isbflow.local.delta import TableCache, commit_file
from isbflow.sinks.delta import (
    DeltaSinkError,
    DeltaSinkOptionError,
    DeltaSinkOptions,
    commit_batch,
    sink_app_id,
    write_batch_files,
)

APP = sink_app_id("p", "s", "t")


def rows(first: int, n: int) -> pa.Table:
    return pa.table({"k": pa.array(range(first, first + n), pa.int64()),
                     "v": pa.array([f"v{i}" for i in range(first, first + n)])})


def options(path: Path, **extra: str) -> DeltaSinkOptions:
    return DeltaSinkOptions.from_options({"path": str(path), "appId": APP, **extra})


def commit(opts: DeltaSinkOptions, table: pa.Table, batch: int, tables: TableCache):
    return commit_batch(opts, [write_batch_files(opts, table.to_batches(), batch, 0)], batch, tables)


def versions(path: Path) -> list[int]:
    return sorted(int(f[:20]) for f in os.listdir(path / "_delta_log") if f.endswith(".json") and f[0] != ".")


def test_a_commit_a_checkpoint_was_written_on_top_of_is_never_removed(tmp_path, monkeypatch):
    """Another process checkpoints the table right after the sink linked its commit: the commit is
    published (the checkpoint holds it), so it stays, and the batch counts as committed once."""
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    commit(opts, rows(0, 5), 0, tables)
    link = os.link

    def link_then_checkpoint(src, dst, *a, **k):
        link(src, dst, *a, **k)
        if str(dst).endswith(commit_file(1)):
            DeltaTable(str(path)).create_checkpoint()  # another writer, on top of version 1

    monkeypatch.setattr(local_delta.os, "link", link_then_checkpoint)
    done = commit(opts, rows(5, 5), 1, tables)

    assert done.version == 1
    assert (path / "_delta_log" / commit_file(1)).exists()
    assert DeltaTable(str(path)).transaction_version(APP) == 1
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("k").to_pylist()) == list(range(10))


def test_a_table_made_again_under_the_sink_gets_no_commit_after_a_gap(tmp_path):
    """The table is deleted and created anew while the sink keeps its old version: the next commit
    goes on from the new table's last version, never after a gap."""
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b in range(4):
        commit(opts, rows(b * 5, 5), b, tables)
    shutil.rmtree(path)
    write_deltalake(str(path), rows(100, 1))

    done = commit(opts, rows(20, 5), 4, tables)

    assert versions(path) == [0, 1] and done.version == 1
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("k").to_pylist()) == [20, 21, 22, 23, 24, 100]


def test_an_unreadable_checkpoint_hint_takes_no_shortcut(tmp_path):
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    commit(opts, rows(0, 5), 0, tables)
    (path / "_delta_log" / "_last_checkpoint").write_text('{"version": ')  # half written

    assert local_delta.last_checkpoint(path / "_delta_log") is None
    assert tables.kept(APP) is None


def test_an_upsert_into_an_append_only_table_writes_no_remove(tmp_path):
    """delta.appendOnly: no commit may remove data. The sink's own upsert would; it hands the batch
    to delta-rs, which refuses it."""
    path = tmp_path / "t"
    write_deltalake(str(path), rows(0, 5), configuration={"delta.appendOnly": "true"})
    opts, tables = options(path, mode="upsert", mergeKey="k"), TableCache(str(path))

    with pytest.raises(Exception, match="(?i)append"):
        commit(opts, rows(3, 5), 0, tables)  # keys 3 and 4 are in the table

    for v in versions(path):
        log = (path / "_delta_log" / commit_file(v)).read_text()
        assert '"remove"' not in log
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("k").to_pylist()) == list(range(5))


def test_commit_metadata_that_strict_json_cannot_carry_is_refused():
    for bad in ('{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}'):
        with pytest.raises(DeltaSinkOptionError, match="commitMetadata"):
            DeltaSinkOptions.from_options({"path": "/tmp/t", "appId": APP, "commitMetadata": bad})


def test_a_crashed_writers_aside_commit_files_are_removed_when_the_sink_starts(tmp_path):
    path = tmp_path / "t"
    write_deltalake(str(path), rows(0, 1))
    stale = path / "_delta_log" / f".{commit_file(1)}.{'a' * 32}.tmp"
    fresh = path / "_delta_log" / f".{commit_file(1)}.{'b' * 32}.tmp"  # a live writer's, about to link
    stale.write_text("{}")
    fresh.write_text("{}")
    old = time.time() - 3600
    os.utime(stale, (old, old))

    TableCache(str(path)).get()

    assert not stale.exists() and fresh.exists()


def test_a_file_system_without_hard_links_commits_through_delta_rs(tmp_path, monkeypatch):
    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    commit(opts, rows(0, 5), 0, tables)

    def no_links(*a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(local_delta.os, "link", no_links)
    for b in (1, 2):
        assert commit(opts, rows(b * 5, 5), b, tables).version == b

    assert not tables.plain()  # the sink stopped trying
    assert sorted(DeltaTable(str(path)).to_pyarrow_table().column("k").to_pylist()) == list(range(15))


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_null_in_a_not_null_column_is_refused_and_nothing_committed(tmp_path, mode):
    path = tmp_path / "t"
    schema = pa.schema([pa.field("k", pa.int64(), nullable=False), pa.field("v", pa.string(), nullable=False)])
    write_deltalake(str(path), pa.table({"k": [1], "v": ["a"]}, schema=schema))
    extra = {"mode": "upsert", "mergeKey": "k"} if mode == "upsert" else {}
    opts, tables = options(path, **extra), TableCache(str(path))
    bad = pa.table({"k": pa.array([2, 3], pa.int64()), "v": pa.array(["b", None])})

    with pytest.raises(DeltaSinkError, match="'v' is NOT NULL"):
        commit(opts, bad, 0, tables)

    assert versions(path) == [0]
    assert DeltaTable(str(path)).to_pyarrow_table().num_rows == 1


def test_zoned_timestamp_partition_values_are_iso_8601_utc(tmp_path):
    path = tmp_path / "t"
    ts = pa.array([0, 1_500_000], pa.timestamp("us", tz="Europe/Paris"))
    opts = options(path, partitionBy="at")
    commit(opts, pa.table({"at": ts, "v": [1, 2]}), 0, TableCache(str(path)))

    adds = [json.loads(line)["add"] for v in versions(path)
            for line in (path / "_delta_log" / commit_file(v)).read_text().splitlines() if '"add"' in line]
    assert sorted(a["partitionValues"]["at"] for a in adds) == ["1970-01-01T00:00:00.000000Z",
                                                               "1970-01-01T00:00:01.500000Z"]
    back = DeltaTable(str(path)).to_pyarrow_table().sort_by("v")
    assert back.column("at").cast(pa.int64()).to_pylist() == [0, 1_500_000]


def test_a_commit_whose_stats_hold_a_line_separator_is_read_whole(tmp_path):
    """Commit files are JSON lines cut at "\\n" only: a string value holding U+2028 or U+0085 (raw
    UTF-8 in the stats) does not split its action."""
    from isbflow.sinks.delta_log import log_actions

    path = tmp_path / "t"
    opts, tables = options(path), TableCache(str(path))
    for b, text in enumerate(["a\u2028b", "c\x85d"]):
        commit(opts, pa.table({"k": pa.array([b], pa.int64()), "v": [text]}), b, tables)
    for v in versions(path):
        added, removed = log_actions(path, v)
        assert len(added) == 1 and not removed, (v, added)
