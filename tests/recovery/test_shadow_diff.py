"""The diff of a shadow reprocess (isbflow.recovery.shadow_diff): pure Arrow, no Spark."""

from __future__ import annotations

import json
from datetime import datetime

import pyarrow as pa

from isbflow.recovery.shadow_diff import diff_rows, summary_line


def test_added_removed_changed_per_column_with_samples_in_key_order():
    old = pa.table({"_isb_id": ["in/0/4", "in/0/1", "in/0/2", "in/0/3"], "v": [None, 1, 2, 3],
                    "s": ["w", "x", "y", "z"], "l": [[4], [1], [2], [3]], "t": [datetime(2025, 1, 1)] * 4})
    new = pa.table({"_isb_id": ["in/0/5", "in/0/3", "in/0/2", "in/0/4"], "v": [9, 3, 20, None],
                    "s": ["q", "z", "y", "W"], "l": [[1], [3], [2], [5]], "t": [datetime(2025, 1, 1)] * 4})
    d = diff_rows(old, new, ["_isb_id"])
    assert (d["rows_before"], d["rows_after"], d["added"], d["removed"], d["changed"], d["unchanged"]) == \
        (4, 4, 1, 1, 2, 1)
    assert d["columns"] == {"v": 1, "s": 1, "l": 1, "t": 0}  # null == null; lists compared too
    assert d["samples"]["added"] == [{"_isb_id": "in/0/5", "v": 9, "s": "q", "l": [1], "t": "2025-01-01T00:00:00"}]
    assert [r["_isb_id"] for r in d["samples"]["removed"]] == ["in/0/1"]
    assert d["samples"]["changed"] == [
        {"key": {"_isb_id": "in/0/2"}, "changes": {"v": [2, 20]}},
        {"key": {"_isb_id": "in/0/4"}, "changes": {"s": ["w", "W"], "l": [[4], [5]]}}]
    json.dumps(d)  # plain JSON
    assert summary_line(d) == "+1 added, -1 removed, ~2 changed, 1 unchanged (changed columns: v 1, s 1, l 1)"
    # the same inputs in another row order give the same report
    assert diff_rows(old.take([3, 2, 1, 0]), new.take([1, 3, 0, 2]), ["_isb_id"]) == d


def test_composite_keys_with_nulls_a_column_one_side_lacks_and_empty_tables():
    old = pa.table({"w": [1, 1, 2], "s": ["a", None, None], "c": [1, 2, 3]})
    new = pa.table({"w": [1, 2], "s": [None, None], "c": [2, 4], "extra": ["e", None]})
    d = diff_rows(old, new, ["w", "s"])
    assert (d["added"], d["removed"], d["changed"], d["unchanged"]) == (0, 1, 2, 0)
    assert d["columns"] == {"c": 1, "extra": 1}  # a new column counts where it holds a value
    assert d["samples"]["changed"] == [{"key": {"w": 1, "s": None}, "changes": {"extra": [None, "e"]}},
                                       {"key": {"w": 2, "s": None}, "changes": {"c": [3, 4]}}]
    assert d["samples"]["removed"] == [{"w": 1, "s": "a", "c": 1}]
    empty = diff_rows(old.slice(0, 0), new.slice(0, 0), ["w", "s"])
    assert (empty["added"], empty["removed"], empty["changed"], empty["unchanged"]) == (0, 0, 0, 0)
    assert diff_rows(old.slice(0, 0), new, ["w", "s"])["added"] == 2
    assert diff_rows(old, new.slice(0, 0), ["w", "s"])["removed"] == 3


def test_a_new_shadow_run_keeps_only_the_newest_runs(tmp_path):
    from datetime import UTC, datetime, timedelta

    from isbflow.recovery.shadow import RUNS_KEPT, new_run_id, run_dir

    t0 = datetime(2026, 11, 25, 10, 0, tzinfo=UTC)
    runs = [new_run_id(tmp_path, "logs", t0 + timedelta(seconds=i)) for i in range(RUNS_KEPT + 2)]
    runs += [new_run_id(tmp_path, "logs", t0 + timedelta(seconds=RUNS_KEPT + 1)) for _ in range(9)]  # -2 .. -10
    assert runs[-1] == "reprocess-20261125T100011Z-10"
    left = sorted(p.name for p in run_dir(tmp_path, "logs", runs[0]).parent.iterdir())
    # the ten newest are the ten of the last second, -10 after -9 (not by text)
    assert left == sorted(runs[-10:]) and len(left) == RUNS_KEPT
    new_run_id(tmp_path, "logs", t0 + timedelta(seconds=RUNS_KEPT + 1))  # -11: the bare stamp is the oldest now
    left = {p.name for p in run_dir(tmp_path, "logs", runs[0]).parent.iterdir()}
    assert "reprocess-20261125T100011Z" not in left and "reprocess-20261125T100011Z-11" in left
    assert new_run_id(tmp_path, "other", t0) == "reprocess-20261125T100000Z"  # per pipeline
