"""A step's counters from its query's progress (isbflow.steps.progress): pure functions of Spark's
progress reports, here as Spark 4 writes them for a batch that ran and for an idle trigger."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

from isbflow.isb.state import StepStatus
from isbflow.steps.progress import RunningQuery, account_batches


def ran(batch: int, rows: int, rate: float = 10.0) -> dict:
    return {"batchId": batch, "numInputRows": rows, "inputRowsPerSecond": rate, "processedRowsPerSecond": rate,
            "durationMs": {"addBatch": 5, "latestOffset": 1, "triggerExecution": 9}}


def idle(batch: int) -> dict:
    """An idle trigger (an event-driven step's wait for input that ended empty): no addBatch, and the
    id of the batch still to come."""
    return {"batchId": batch, "numInputRows": 0, "inputRowsPerSecond": 0.0, "processedRowsPerSecond": 0.0,
            "durationMs": {"latestOffset": 5000, "triggerExecution": 5000}}


def query(progress: list[dict]) -> RunningQuery:
    q = SimpleNamespace(recentProgress=progress, lastProgress=progress[-1] if progress else None)
    return RunningQuery("parse", "enrich", q, ["isb-logs-in-parse-0"])


def test_idle_triggers_count_for_nothing_and_do_not_hide_the_next_batch():
    status = StepStatus("parse")
    rq = query([ran(0, 40)])
    account_batches(status, [rq])
    assert (status.rows_total, status.batch_id, status.input_rows_per_s) == (40, 0, 10.0)
    rq.query.recentProgress.append(idle(1))
    rq.query.lastProgress = idle(1)
    account_batches(status, [rq])  # the idle trigger: rates, rows and batch time as they were
    assert (status.rows_total, status.batch_id, status.input_rows_per_s, status.batch_seconds) == (40, 0, 10.0, 0.009)
    rq.query.recentProgress.append(ran(1, 7, rate=3.0))
    rq.query.lastProgress = ran(1, 7, rate=3.0)
    account_batches(status, [rq])  # batch 1 runs after the idle trigger that carried its id: counted
    assert (status.rows_total, status.batch_id, status.input_rows_per_s) == (47, 1, 3.0)
    account_batches(status, [rq])  # once
    assert status.rows_total == 47


def test_batches_between_two_looks_are_all_counted():
    status = StepStatus("parse")
    rq = query([ran(0, 1)])
    account_batches(status, [rq])
    rq.query.recentProgress += [ran(1, 10), idle(2), ran(2, 100), ran(3, 1000)]
    rq.query.lastProgress = ran(3, 1000)
    account_batches(status, [rq])
    assert (status.rows_total, status.batch_id) == (1111, 3)


def test_batches_before_the_first_look_are_all_counted():
    status = StepStatus("raw")
    rq = query([ran(4, 1140), idle(5), ran(5, 60)])  # a restarted query: its first batch is not 0
    account_batches(status, [rq])
    assert (status.rows_total, status.batch_id) == (1200, 5)
    account_batches(status, [rq])  # once
    assert status.rows_total == 1200


def test_a_look_asks_each_query_for_its_progress_once():
    """The continuous loop reads a query's ``lastProgress`` once per look for its offsets and its
    counters (each ask is two Py4J calls and a JSON parse)."""
    from isbflow.steps.progress import last_progress, step_committed

    class Counting:
        asks = 0
        recentProgress: list = []

        @property
        def lastProgress(self):
            Counting.asks += 1
            return {**ran(4, 9), "sources": [{"endOffset": '{"isb-logs-in-parse-0": {"seq": 12}}'}]}

    rq = RunningQuery("parse", "enrich", Counting(), ["isb-logs-in-parse-0"])
    status = StepStatus("parse")
    progress = last_progress([rq])
    assert step_committed([rq], progress) == {"isb-logs-in-parse-0": 12}
    account_batches(status, [rq], progress)
    assert (Counting.asks, status.batch_id, status.rows_total) == (1, 4, 9)


def test_a_batch_whose_report_an_idle_trigger_replaced_is_counted():
    """The look came after batch 1 and after the idle trigger that followed it (which carries id 2):
    batch 1 is found among the recent reports."""
    status = StepStatus("parse")
    rq = query([ran(0, 5)])
    account_batches(status, [rq])
    rq.query.recentProgress += [ran(1, 20, rate=4.0), idle(2)]
    rq.query.lastProgress = idle(2)
    account_batches(status, [rq])
    assert (status.rows_total, status.batch_id, status.input_rows_per_s) == (25, 1, 4.0)
    account_batches(status, [rq])  # once
    assert status.rows_total == 25


def test_a_look_asks_spark_only_when_the_checkpoint_holds_a_new_batch(tmp_path, monkeypatch):
    """has_new_batch: the checkpoint's commits/ against the last batch seen (the commit file is
    written before Spark reports the batch: a look in between asks again at the next)."""
    from isbflow.steps.progress import has_new_batch

    rq = query([])
    assert has_new_batch(rq)  # no checkpoint known: ask
    rq.checkpoint = str(tmp_path)
    assert has_new_batch(rq)  # no commits/ yet: ask
    commits = tmp_path / "commits"
    commits.mkdir()
    assert not has_new_batch(rq)  # empty: nothing ran
    for name in ("0", ".0.crc", "1", ".1.crc"):
        (commits / name).write_text("v1\n{}")
    assert has_new_batch(rq)
    rq.seen_batch = 0  # Spark had not reported batch 1 yet
    assert has_new_batch(rq)
    rq.seen_batch = 1
    assert not has_new_batch(rq)
    (commits / "2").write_text("v1\n{}")
    assert has_new_batch(rq)
    rq.seen_batch = 2
    (commits / "0").unlink()  # Spark's clean-up of old batches
    assert not has_new_batch(rq)
    # a directory that has not changed for a while is not listed again
    settled = time.time_ns() - 10**9
    os.utime(commits, ns=(settled, settled))
    listed = []
    real = os.listdir
    monkeypatch.setattr(os, "listdir", lambda p: listed.append(p) or real(p))
    assert [has_new_batch(rq) for _ in range(3)] == [False] * 3
    assert len(listed) == 1
    (commits / "3").write_text("v1\n{}")
    assert has_new_batch(rq) and len(listed) == 2
