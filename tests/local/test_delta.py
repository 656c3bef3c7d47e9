"""Delta tables loaded while sink maintenance trims their log (isbflow.local.delta), on real tables."""

from __future__ import annotations

import json
import threading

import pyarrow as pa
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import DeltaError, TableNotFoundError

from isbflow.local import delta
from isbflow.local.delta import load_table, log_file_vanished

#: log files removed at once: what maintenance with a log retention of 0 does
TRIMMED = {"delta.logRetentionDuration": "interval 0 seconds", "delta.enableExpiredLogCleanup": "false"}


def _trim(path: str) -> None:
    at = DeltaTable(path)
    at.create_checkpoint()
    at.cleanup_metadata()


def test_loads_beside_a_writer_that_trims_the_log_never_fail(tmp_path):
    """A thread loads the table over and over while the main thread appends and, every 3 commits,
    checkpoints and removes the log before the checkpoint. Bare ``DeltaTable(path)`` failed 35 of 661
    loads in this race ("File not found", "checkpoint.parquet not found"); :func:`load_table` none."""
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"a": [0]}), configuration=TRIMMED)
    stop, loads, errors = threading.Event(), [], []

    def reader():
        while not stop.is_set():
            try:
                loads.append(load_table(path).version())
            except Exception as e:  # noqa: BLE001 - every failure is the finding
                errors.append(repr(e))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(1, 121):
            write_deltalake(path, pa.table({"a": [i]}), mode="append")
            if i % 3 == 0:
                _trim(path)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not errors, errors[:5]
    assert len(loads) > 50 and loads == sorted(loads)  # a load never goes back in time
    assert load_table(path).to_pyarrow_table().num_rows == 121


def test_what_a_trimmed_log_raises_is_told_apart_and_loaded_again_a_bounded_number_of_times(tmp_path, monkeypatch):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"a": [0]}), configuration=TRIMMED)
    stale = DeltaTable(path)  # a snapshot from before the trim
    write_deltalake(path, pa.table({"a": [1]}), mode="append")
    _trim(path)
    raised = []
    for use in (lambda: stale.transaction_version("app"),  # read lazily: "File not found: .../0.json"
                lambda: write_deltalake(stale, pa.table({"a": [2]}), mode="append")):  # "Invalid table version: 0"
        with pytest.raises(DeltaError) as e:
            use()
        raised.append(e.value)
    assert all(log_file_vanished(e) for e in raised), raised
    assert not log_file_vanished(TableNotFoundError("no table")) and not log_file_vanished(ValueError("not found"))

    tries = []
    real = delta.DeltaTable
    monkeypatch.setattr(delta.time, "sleep", lambda s: None)
    monkeypatch.setattr(delta, "DeltaTable", lambda *a, **k: tries.append(a) or real(*a, **k))
    with pytest.raises(TableNotFoundError):  # a version the log no longer holds: at once
        load_table(path, 0)
    with pytest.raises(TableNotFoundError):  # no table at all: at once
        load_table(str(tmp_path / "none"))
    assert len(tries) == 2

    def vanishing(*a, **k):
        tries.append(a)
        raise raised[1]
    tries.clear()
    monkeypatch.setattr(delta, "DeltaTable", vanishing)
    with pytest.raises(DeltaError, match="Invalid table version"):  # still gone after every attempt: raised
        load_table(path)
    assert len(tries) == delta.LOAD_ATTEMPTS
    monkeypatch.setattr(delta, "DeltaTable", real)
    assert load_table(path).version() == 1


def test_a_kept_table_is_read_forward_and_loaded_anew_when_the_log_it_needs_was_trimmed(tmp_path, monkeypatch):
    """TableCache: the sink's table between its commits. Commits by others are read forward (the same
    object, no new load); after maintenance trimmed the log the kept snapshot read from, the next get
    is still the whole table at its latest version."""
    path = str(tmp_path / "t")
    tables = delta.TableCache(path)
    assert tables.get() is None  # no table yet
    write_deltalake(path, pa.table({"a": [0]}), configuration=TRIMMED)
    first = tables.get()
    assert first.version() == 0
    loads = []
    real = delta.DeltaTable
    monkeypatch.setattr(delta, "DeltaTable", lambda *a, **k: loads.append(a) or real(*a, **k))
    for i in range(1, 4):
        write_deltalake(path, pa.table({"a": [i]}), mode="append",
                        commit_properties=CommitProperties(app_transactions=[Transaction("app", i)]))
        assert tables.get() is first and first.version() == i
    assert loads == []  # read forward only
    assert first.transaction_version("app") == 3

    for i in range(4, 7):
        write_deltalake(path, pa.table({"a": [i]}), mode="append")
    _trim(path)  # the commits after the kept version 3 are folded into a checkpoint and removed
    write_deltalake(path, pa.table({"a": [7]}), mode="append")
    after = tables.get()
    assert after.version() == 7 and after.transaction_version("app") == 3
    assert sorted(after.to_pyarrow_table().column("a").to_pylist()) == list(range(8))

    tables.forget()
    assert tables.get() is not after and len(loads) >= 1  # forgotten: loaded anew


def _commit(path: str, i: int, **kw) -> None:
    """Append row ``i`` in a commit whose metadata names the version it is (``at``) and its offsets."""
    write_deltalake(path, pa.table({"a": [i]}), mode="append" if i else "error", commit_properties=CommitProperties(
        custom_metadata={"at": str(i), "isb.offsets": json.dumps({"in/0": [[i * 10 + 1, i * 10 + 10]]})}), **kw)


def test_a_history_asked_after_a_commit_landed_names_each_commit_by_its_own_version(tmp_path):
    """delta-rs 1.6 lists the commits the log holds when asked and numbers them down from the version
    the table was loaded at (the test_live.py flake). :func:`table_history` gives the table's own
    commits, each under its version, and a limit counts from the table's version."""
    path = str(tmp_path / "t")
    for i in range(3):
        _commit(path, i)
    stale = DeltaTable(path)
    assert stale.version() == 2
    _commit(path, 3)  # a sink's next batch lands after the load
    bare = stale.history()
    assert [(h["version"], h["at"]) for h in bare][:2] == [(2, "3"), (1, "2")]  # what delta-rs does
    assert [(h["version"], h["at"]) for h in delta.table_history(stale)] == [(2, "2"), (1, "1"), (0, "0")]
    assert [(h["version"], h["at"]) for h in delta.table_history(stale, 1)] == [(2, "2")]
    assert {k: v for k, v in delta.table_history(DeltaTable(path), 1)[0].items() if k != "version"} == \
        {k: v for k, v in DeltaTable(path).history(1)[0].items() if k != "version"}  # the same fields
    assert stale.version() == 2


def test_a_history_read_beside_a_writer_is_always_numbered_right(tmp_path):
    """A thread commits over and over while the main thread loads the table, lets a commit land, and
    reads its history: every commit carries its own version, as the newest-first list must."""
    path = str(tmp_path / "t")
    _commit(path, 0)
    stop = threading.Event()

    def writer():
        i = 1
        while not stop.is_set():
            _commit(path, i)
            i += 1

    thread = threading.Thread(target=writer)
    thread.start()
    wrong, reads = [], 0
    try:
        while reads < 40:
            table = load_table(path)
            history = delta.table_history(table, 3)
            reads += 1
            assert history[0]["version"] == table.version()
            wrong += [(h["version"], h["at"]) for h in history if str(h["version"]) != h["at"]]
    finally:
        stop.set()
        thread.join()
    assert reads == 40 and wrong == []


def test_the_ledger_and_the_quality_read_of_a_table_see_no_commit_newer_than_their_version(
        tmp_path, monkeypatch, spark):
    """The quality check's two reads: the table's rows at a version (``read_version``) and the ledger
    ranges its history records up to that version (``delta_history_until``), each from a table loaded
    just before the sink's next commit landed."""
    from isbflow.isb import ledger
    from isbflow.sinks.tables import read_version

    path = str(tmp_path / "t")
    for i in range(3):
        _commit(path, i)
    stale = DeltaTable(path)
    _commit(path, 3)
    monkeypatch.setattr(delta, "load_table", lambda p, version=None: stale)
    assert ledger.delta_history_until(path, 2) == {"in/0": [[1, 30]]}  # not commit 3's 31-40
    df, version, commit = read_version(spark, path)
    assert (version, commit["at"]) == (2, "2")
    assert sorted(r.a for r in df.collect()) == [0, 1, 2]
