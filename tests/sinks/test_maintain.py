"""Delta sink maintenance (isbflow.sinks.maintain) on real tables: compaction beside a stream's commits,
vacuum's retention floor, and the ledger's proofs after both."""

from __future__ import annotations

import os

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from isbflow.isb import ledger
from isbflow.quality.verify import verify_table
from isbflow.sinks.delta import (
    DeltaSinkOptions,
    commit_batch,
    read_sink,
    sink_app_id,
    write_batch_files,
)
from isbflow.sinks.maintain import (
    DEFAULT_RETENTION_HOURS,
    MaintenanceError,
    compact_table,
    maintain_table,
    vacuum_table,
)

APP = sink_app_id("logs", "out", "events")


def ids(first: int, n: int) -> pa.Table:
    seqs = list(range(first, first + n))
    return pa.table({"_isb_id": [f"in/0/{s}" for s in seqs], "v": pa.array(seqs, pa.int64())})


def commit(opts: DeltaSinkOptions, batch: int, first: int, n: int):
    """One micro-batch of ``n`` rows from offset ``first``, written by two tasks (two files)."""
    half = n // 2
    return commit_batch(opts, [write_batch_files(opts, ids(first, half).to_batches(), batch, 0),
                               write_batch_files(opts, ids(first + half, n - half).to_batches(), batch, 1)], batch)


def data_files(path) -> set[str]:
    return {os.path.join(d, f) for d, _, fs in os.walk(path) if "_delta_log" not in d
            for f in fs if f.endswith(".parquet")}


def test_compaction_beside_a_stream_commit_keeps_rows_ledger_and_proofs(tmp_path):
    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(6):
        commit(opts, b, b * 10 + 1, 10)
    before = ledger.from_delta_history(path)
    stale = DeltaTable(path)  # the maintenance job loaded version 5 ...
    commit(opts, 6, 61, 10)  # ... the stream appends batch 6 meanwhile ...
    files_before = len(DeltaTable(path).file_uris())
    metrics = compact_table(stale)  # ... and the compaction commits on top of it

    table = DeltaTable(path)
    assert metrics["numFilesRemoved"] >= 12 and metrics["numFilesAdded"] >= 1
    assert table.history(1)[0]["operation"] == "OPTIMIZE"
    assert len(table.file_uris()) < files_before
    got = read_sink(path).column("v").to_pylist()
    assert sorted(got) == list(range(1, 71))  # every row once, batch 6 included
    assert table.transaction_version(APP) == 6
    assert commit(opts, 6, 61, 10).version is None  # a replayed batch is still recognised
    assert ledger.from_delta_history(path) == ledger.union(before, {"in/0": [[61, 70]]}) == {"in/0": [[1, 70]]}
    proof = verify_table(path)
    assert proof.ok, proof.problems()
    assert proof.proven == {"in/0": [[1, 70]]}

    commit(opts, 7, 71, 10)  # the stream goes on after the compaction
    pending = write_batch_files(opts, ids(81, 5).to_batches(), 8, 0)  # written, not yet committed
    removed_by_log = data_files(path) - {u.removeprefix("file://") for u in DeltaTable(path).file_uris()}
    removed_by_log -= {os.path.join(path, a.path) for a in pending.actions}
    deleted = vacuum_table(DeltaTable(path), 0, dry_run=False, force=True)

    assert len(deleted) == len(removed_by_log) >= 12
    assert all(os.path.exists(os.path.join(path, a.path)) for a in pending.actions)  # in-flight files stay
    assert commit_batch(opts, [pending], 8).rows == 5
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(1, 86))
    proof = verify_table(path)
    assert proof.ok, proof.problems()
    assert proof.proven == {"in/0": [[1, 85]]}
    assert ledger.from_delta_history(path) == {"in/0": [[1, 85]]}


def test_vacuum_retention_has_a_floor_and_dry_run_changes_nothing(tmp_path):
    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(3):
        commit(opts, b, b * 10 + 1, 10)
    assert DEFAULT_RETENTION_HOURS >= 7 * 24

    with pytest.raises(MaintenanceError, match="below the floor"):
        maintain_table(path, 24)
    assert DeltaTable(path).version() == 2  # refused before anything ran

    dry = maintain_table(path, 0, dry_run=True, force=True)
    assert (dry.version_before, dry.version_after, dry.vacuumed) == (2, 2, [])
    assert dry.files_before == dry.files_after == 6

    done = maintain_table(path)  # default retention: compacts, deletes nothing yet
    assert done.files_after == 1 and done.vacuumed == []
    assert done.version_after > done.version_before
    assert len(data_files(path)) == 7  # the compacted-away files are kept for readers
    assert maintain_table(str(tmp_path / "none")).skipped
