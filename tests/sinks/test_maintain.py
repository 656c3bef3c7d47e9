"""Delta sink maintenance (isbflow.sinks.maintain) on real tables: compaction beside a stream's commits,
vacuum's retention floor, and the ledger's proofs after both."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError

from isbflow.isb import ledger
from isbflow.quality.verify import verify_table
from isbflow.sinks import delta_commit
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


def _answers(path: str) -> tuple:
    """What every reader of the history says: the ledger rebuilt from the table, the quality basis at
    the current version, and verify's proof (less what maintenance itself changes: versions, commits)."""
    proof = verify_table(path).to_json()
    for k in ("version", "commits"):
        proof.pop(k)
    return ledger.from_delta_history(path), ledger.delta_history_until(path, DeltaTable(path).version()), proof


def _log(path: str) -> list[str]:
    return sorted(os.listdir(os.path.join(path, "_delta_log")))


@pytest.mark.parametrize("beside", [False, True], ids=["fold-in-the-log", "fold-beside-the-log"])
def test_a_bounded_log_keeps_what_the_ledger_basis_and_verify_read(tmp_path, monkeypatch, beside):
    """``beside``: the fold's offsets and claims are kept in a file beside the log (what a sink fed by a
    filtering edge needs: one range per record), here forced by a threshold of 0 bytes."""
    from deltalake import CommitProperties, write_deltalake

    from isbflow.local import delta_sidecar

    monkeypatch.setattr(delta_sidecar, "INLINE_BYTES", 0 if beside else 10**9)
    monkeypatch.setattr(delta_sidecar, "PRUNE_AGE_S", 0.0)

    from isbflow.sinks.delta_log import FOLD_CLAIMED_KEY, LogRetentionError, bound_log
    from isbflow.sinks.delta_merge import replace_keys

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(30):  # 9 of every 10 offsets: a hole (a dead letter, say) per batch
        commit(opts, b, b * 10 + 1, 9)
    # a reprocess of 51..60 whose new code drops 55, and a commit made outside isbflow
    old = ids(51, 9).select(["_isb_id"])
    new = ids(51, 9).filter(pa.compute.not_equal(ids(51, 9).column("v"), 55))
    replace_keys(path, new, old,
                 metadata={ledger.OFFSETS_KEY: ledger.to_metadata({"in/0": [[51, 59]]})})
    write_deltalake(path, ids(1000, 3), mode="append", commit_properties=CommitProperties(custom_metadata={}))
    before = _answers(path)
    assert before[0]["in/0"][:2] == [[1, 9], [11, 19]] and [51, 59] in before[0]["in/0"]
    assert before[2]["claimed"]["in/0"][5:7] == [[51, 54], [56, 59]]  # the reprocess' claim
    assert [c["version"] for c in before[2]["foreign_commits"]] == [31] and not before[2]["ok"]
    assert len(_log(path)) == 32  # versions 0..31
    assert DeltaTable(path).metadata().configuration["delta.enableExpiredLogCleanup"] == "false"

    with pytest.raises(MaintenanceError, match="log retention 1 h is below the floor"):
        maintain_table(path, log_retention_hours=1)
    with pytest.raises(LogRetentionError):
        bound_log(path, -1, force=True)
    done = maintain_table(path, 0, force=True, log_retention_hours=0)  # explicit: remove every old entry
    # left: the fold (33; 32 set the log properties) with its checkpoint, and the compaction (a vacuum commits nothing)
    assert done.log_files_before == 32 and done.log_files_after == len(_log(path)) == 4, _log(path)
    assert done.folded_through == 32 and _log(path)[:2] == [f"{33:020d}.checkpoint.parquet", f"{33:020d}.json"]
    assert _answers(path) == before  # the same answers from a log of a few files
    folds = tmp_path / "t" / delta_sidecar.FOLDER
    assert sorted(os.listdir(folds)) == ["32.json"] if beside else not folds.exists()

    for b in range(30, 40):  # the stream goes on; the next maintenance folds on top of the first fold
        commit(opts, b, b * 10 + 1, 9)
    expected = ledger.union(before[0], {"in/0": [[b * 10 + 1, b * 10 + 9] for b in range(30, 40)]})
    assert ledger.from_delta_history(path) == expected
    maintain_table(path, 0, force=True, log_retention_hours=0)
    after = _answers(path)
    assert after[0] == after[1] == expected
    assert after[2]["claimed"] == ledger.union(before[2]["claimed"], {"in/0": expected["in/0"][-10:]})
    assert after[2]["foreign_commits"] == before[2]["foreign_commits"]  # still named, though its entry is gone
    assert len(_log(path)) == 4  # bounded: the same few files after each maintenance
    fold = DeltaTable(path).history()[-1]  # the oldest commit left: the second fold, no files
    assert fold["operation"] == "WRITE" and fold["version"] == 45
    assert (FOLD_CLAIMED_KEY not in fold and fold[delta_sidecar.FILE_KEY] == "_isb_fold/44.json") if beside \
        else FOLD_CLAIMED_KEY in fold
    if beside:  # the first fold's file went with its commit; the second's is read back in
        assert sorted(os.listdir(folds)) == ["44.json"]
        assert len((tmp_path / "t" / "_delta_log" / f"{45:020d}.json").read_bytes()) < 2000
    assert commit(opts, 39, 391, 9).version is None  # a replayed batch is still recognised

    with pytest.raises(ledger.LogTruncated, match="read a newer version"):
        ledger.delta_history_until(path, done.version_before)  # a version whose history is gone: loud
    if beside:  # a fold whose file is gone: loud, never an answer without it
        (folds / "44.json").unlink()
        with pytest.raises(delta_sidecar.SidecarMissing, match="44.json.*the fold of version 45"):
            ledger.from_delta_history(path)


def test_a_stream_commit_goes_on_when_maintenance_changes_the_table_properties_meanwhile(tmp_path, monkeypatch):
    from isbflow.local import delta as local_delta
    from isbflow.sinks.delta_log import TABLE_CONFIGURATION, retention_properties

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    commit(opts, 0, 1, 10)
    assert DeltaTable(path).metadata().configuration == TABLE_CONFIGURATION  # the default's: nothing to change

    calls = []

    def stale(p, version=None):  # the batch's commit reads the table, then maintenance sets another log
        table = DeltaTable(p)    # retention (once)
        if not calls:
            DeltaTable(p).alter.set_table_properties(retention_properties(0))
        calls.append(p)
        return table

    monkeypatch.setattr(local_delta, "load_table", stale)  # what the commit's TableCache loads with
    done = commit(opts, 1, 11, 10)
    assert done.rows == 10 and done.version == 2  # 1: the properties; its first attempt failed, "Metadata changed"
    assert len(calls) == 2  # the whole commit again, from reading the table
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(1, 21))
    assert DeltaTable(path).transaction_version(APP) == 1


def test_a_log_cleaned_outside_maintenance_is_reported_and_then_folded_as_it_is(tmp_path):
    from deltalake import CommitProperties, write_deltalake

    from isbflow.quality.verify import VerifyError

    path = str(tmp_path / "t")
    for i in range(101):  # delta-rs' own clean-up at its checkpoint of version 100 (retention 0 s here)
        write_deltalake(path, ids(i * 10 + 1, 10), mode="append",
                        configuration={"delta.logRetentionDuration": "interval 0 seconds"},
                        commit_properties=CommitProperties(custom_metadata={
                            ledger.OFFSETS_KEY: ledger.to_metadata({"in/0": [[i * 10 + 1, i * 10 + 10]]})}))
    assert len(_log(path)) < 10  # the offsets of versions 0..98 are gone with their entries
    with pytest.raises(ledger.LogTruncated, match="no fold covers"):
        ledger.from_delta_history(path)  # loud, not a partial answer
    with pytest.raises(VerifyError, match="no fold covers"):
        verify_table(path)
    maintain_table(path, 0, force=True, log_retention_hours=0)  # folds what is left, from then on bounded
    assert ledger.from_delta_history(path) == {"in/0": [[991, 1010]]}
    assert DeltaTable(path).metadata().configuration["delta.enableExpiredLogCleanup"] == "false"


def test_an_upsert_commit_goes_on_when_maintenance_changes_the_table_properties_meanwhile(tmp_path, monkeypatch):
    from isbflow.local import delta as local_delta
    from isbflow.sinks.delta_log import retention_properties

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP, "mode": "upsert", "mergeKey": "_isb_id"})
    commit(opts, 0, 1, 10)
    calls = []

    def stale(p, version=None):  # the batch reads the table it merges into, then maintenance sets another
        table = DeltaTable(p)    # log retention (first call only)
        if not calls:
            DeltaTable(p).alter.set_table_properties(retention_properties(0))
        calls.append(p)
        return table

    monkeypatch.setattr(local_delta, "load_table", stale)
    # the merge through delta-rs (the sink's own commit finds the version taken and loads the table
    # anew: tests/sinks/test_delta_upsert.py)
    monkeypatch.setattr(delta_commit, "own_upsert", lambda *a, **k: None)
    done = commit(opts, 1, 6, 10)  # 6..10 updated, 11..15 inserted
    assert done.rows == 10 and len(calls) >= 2  # read again after "Metadata changed"
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(1, 16))
    assert DeltaTable(path).transaction_version(APP) == 1


@pytest.mark.parametrize("mode", ["append", "upsert"])
def test_a_stream_commit_goes_on_when_maintenance_trims_the_log_under_it(tmp_path, monkeypatch, mode):
    """An upsert step's commit must go on (not fail with "Invalid table version: 4") when its
    snapshot is older than the checkpoint the maintenance has just written, and the commits after
    that snapshot, which the conflict check reads, were folded and removed (log retention 0)."""
    from isbflow.local import delta as local_delta
    from isbflow.sinks.delta_log import bound_log

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP, "mode": mode, "mergeKey": "_isb_id"})
    commit(opts, 0, 1, 10)
    calls = []

    def stale(p, version=None):  # the batch's commit reads the table, then maintenance folds and trims
        table = DeltaTable(p)    # the log (once)
        if not calls:
            bound_log(p, 0, force=True)
            assert not os.path.exists(os.path.join(p, "_delta_log", f"{table.version():020d}.json"))
        calls.append(p)
        return table

    # the commit's table comes from its TableCache, an upsert's merge too
    monkeypatch.setattr(local_delta, "load_table", stale)
    done = commit(opts, 1, 6, 10)
    assert done.rows == 10 and len(calls) >= 2  # the table read again after the trim
    want = list(range(1, 16)) if mode == "upsert" else list(range(1, 11)) + list(range(6, 16))
    assert sorted(read_sink(path).column("v").to_pylist()) == sorted(want)
    assert DeltaTable(path).transaction_version(APP) == 1
    assert ledger.from_delta_history(path) == {"in/0": [[1, 15]]}


def test_compaction_conflicting_with_a_concurrent_rewrite_runs_again_on_the_new_snapshot(tmp_path):
    """An upsert sink's micro-batch removes files a compaction read (what failed a quick soak:
    "a concurrent transaction deleted data this operation read"): the compaction runs again."""
    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(6):
        commit(opts, b, b * 10 + 1, 10)
    stale = DeltaTable(path)  # the maintenance job loaded this snapshot ...
    DeltaTable(path).delete("v <= 5")  # ... and a concurrent commit rewrote a file it reads
    waits: list[float] = []
    metrics = compact_table(stale, sleep=waits.append)
    assert waits == [0.5]  # one conflict, then a clean attempt on the new snapshot
    assert metrics["numFilesRemoved"] >= 2 and DeltaTable(path).history(1)[0]["operation"] == "OPTIMIZE"
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(6, 61))

    for b in range(6, 9):
        commit(opts, b, b * 10 + 1, 10)
    stale = DeltaTable(path)
    DeltaTable(path).delete("v >= 81")
    with pytest.raises(MaintenanceError, match="failed 1 times on concurrent commits"):
        compact_table(stale, attempts=1, sleep=waits.append)


def test_a_vacuum_beside_a_concurrent_rewrite_deletes_what_the_log_removed_and_commits_nothing(tmp_path):
    """delta-rs' own vacuum commits a VACUUM START and END, and the END failed against an upsert sink's
    micro-batch that removed files meanwhile ("a concurrent transaction deleted data this operation
    read"; five attempts in a row beside a 200 ms upsert sink). A local table's vacuum lists what the
    log removed through delta-rs and deletes it, with no commit to conflict."""
    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(4):
        commit(opts, b, b * 10 + 1, 10)
    compact_table(DeltaTable(path))  # files the log removed: what a vacuum deletes
    stale = DeltaTable(path)
    DeltaTable(path).delete("v <= 5")  # a concurrent commit removed a file the vacuum's snapshot reads
    version = DeltaTable(path).version()
    waits: list[float] = []

    gone = vacuum_table(stale, 0, dry_run=False, force=True, sleep=waits.append)

    assert len(gone) == 8 and waits == [], (gone, waits)  # the files the compaction replaced
    assert not any((Path(path) / g).exists() for g in gone)
    assert DeltaTable(path).version() == version  # no VACUUM START / END commit
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(6, 41))
    assert len(vacuum_table(DeltaTable(path), 0, dry_run=False, force=True)) == 1  # the file the delete removed
    assert vacuum_table(DeltaTable(path), 0, dry_run=False, force=True) == []  # nothing left


def test_a_fold_meeting_a_concurrent_rewrite_folds_again(tmp_path, monkeypatch):
    """What failed a quick soak in CI: an upsert sink's micro-batch removed files between the log
    fold's read and its commit ("a concurrent transaction deleted data this operation read"). The
    fold changes no data, so it reads the newer table and folds again."""
    from isbflow.sinks import delta_log

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    for b in range(3):
        commit(opts, b, b * 10 + 1, 10)
    delta_log.fold_log(path, 0, force=True)  # sets the log retention first: its own commit
    real, real_delete = DeltaTable.create_write_transaction, DeltaTable.delete
    read_at: list[int] = []

    def racing(self, *args, **kwargs):
        if not read_at:  # a live writer rewrites a file after the fold has read the table
            DeltaTable(path).delete("v <= 5")
        read_at.append(self.version())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(DeltaTable, "create_write_transaction", racing)
    through = delta_log.fold_log(path, 0, force=True)
    # the fold covers what it read (through), and its commit lands after the concurrent one
    assert len(read_at) == 2 and read_at[1] == read_at[0] + 1 and through == read_at[0], (read_at, through)
    assert DeltaTable(path).history(1)[0][delta_log.MAINTENANCE_KEY] == "fold"
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(6, 31))
    delta_log.trim_log(path, through)
    assert ledger.from_delta_history(path) == {"in/0": [[1, 30]]}  # the log trimmed, the offsets whole

    read_at.clear()  # with one attempt the conflict is delta-rs' own refusal
    monkeypatch.setattr(delta_log, "FOLD_ATTEMPTS", 1)
    monkeypatch.setattr(DeltaTable, "delete", lambda self, predicate: real_delete(self, "v >= 26"))
    with pytest.raises(CommitFailedError, match="concurrent"):
        delta_log.fold_log(path, 0, force=True)


def _tombstones(path: str) -> int:
    import pyarrow.parquet as pq

    log = os.path.join(path, "_delta_log")
    newest = sorted(f for f in os.listdir(log) if f.endswith(".checkpoint.parquet"))[-1]
    return pq.read_table(os.path.join(log, newest), columns=["remove"]).column("remove").drop_null().__len__()


def test_tombstones_expire_after_the_vacuum_and_log_retentions(tmp_path):
    """A checkpoint keeps a removed file's tombstone for ``delta.deletedFileRetentionDuration``: Delta's
    default (7 days) made every maintenance run's checkpoint bigger than the one before on a sink compacted
    every few minutes. Maintenance sets it to the vacuum retention plus the log retention."""
    import time

    from isbflow.sinks.delta_log import TABLE_CONFIGURATION, retention_properties, tombstone_hours

    path = str(tmp_path / "t")
    opts = DeltaSinkOptions.from_options({"path": path, "appId": APP})
    assert tombstone_hours(DEFAULT_RETENTION_HOURS, 168) == 336
    first = 1
    for batch in range(5):
        commit(opts, batch, first, 10)
        first += 10
    assert DeltaTable(path).metadata().configuration == TABLE_CONFIGURATION
    maintain_table(path)  # the defaults: the removed files' tombstones are kept (336 h)
    DeltaTable(path).create_checkpoint()  # as the sink's next automatic checkpoint would
    assert _tombstones(path) == 10
    counts = []
    for run in range(3):
        for batch in range(5 + 5 * run, 10 + 5 * run):
            commit(opts, batch, first, 10)
            first += 10
        maintain_table(path, 0, force=True, log_retention_hours=0)
        time.sleep(1.1)  # the tombstones' age, at a retention of 0 h
        DeltaTable(path).create_checkpoint()
        counts.append(_tombstones(path))
    assert counts == [0, 0, 0]  # 10 or 11 files compacted away by each run, none of them kept in a checkpoint
    assert DeltaTable(path).metadata().configuration["delta.deletedFileRetentionDuration"] == \
        retention_properties(0, 0)["delta.deletedFileRetentionDuration"] == "interval 0 seconds"
    assert len(data_files(path)) == 1
    assert sorted(read_sink(path).column("v").to_pylist()) == list(range(1, first))
