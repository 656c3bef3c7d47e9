"""A sink's failure policy (:mod:`isbflow.steps.sink_policy`) around a fake ``foreachBatch`` function.

No Spark, no server: the primary is a callable that fails as told, the fallback an in-memory
table, the waits are recorded instead of slept. The proof against real NATS, Spark and
PostgreSQL (the server stopped and started again) is in ``tests/steps/test_postgres_pipeline.py``.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

from isbflow.spec.models import Backoff, OnFailure, RetryStrategy
from isbflow.steps.sink_policy import PolicyTotals, SinkPolicy, SinkRetriesCancelled


class Batch:
    """What the policy uses of a Spark DataFrame."""

    def __init__(self, ids):
        self.table = pa.table({"n": list(range(len(ids))), "_isb_id": [f"in/0/{i}" for i in ids]})
        self.columns = self.table.schema.names

    def toArrow(self) -> pa.Table:  # noqa: N802 - Spark's name
        return self.table

    def count(self) -> int:
        return self.table.num_rows


class Primary:
    """Fails the first ``fail`` calls; refuses the rows whose ``n`` is in ``refuse``."""

    takes_refused = True

    def __init__(self, fail: int = 0, refuse=()):
        self.fail, self.refuse, self.calls, self.written = fail, set(refuse), 0, []

    def __call__(self, df, batch_id, on_refused=None):
        self.calls += 1
        if self.calls <= self.fail:
            raise ConnectionError(f"connection refused (call {self.calls})")
        t = df.toArrow()
        bad = [i for i, n in enumerate(t.column("n").to_pylist()) if n in self.refuse]
        if bad:
            on_refused(t.take(bad), [f"n={t.column('n')[i]} breaks a rule" for i in bad])
        self.written += [x for i, x in enumerate(t.column("_isb_id").to_pylist()) if i not in bad]


class Fallback:
    where = "fallback memory"

    def __init__(self):
        self.batches: dict[int, pa.Table] = {}

    def commit(self, rows, batch_id):
        if batch_id in self.batches:
            return False
        self.batches[batch_id] = rows
        return True

    def held(self, batch_id):
        t = self.batches.get(batch_id)
        return None if t is None else t.column("_isb_id").to_pylist()


def policy(primary, tmp_path, strategy=None, fallback=None, **kw):
    waits: list[float] = []
    letters: list = []
    offsets: list = []
    p = SinkPolicy(primary, where="sink 'out'", app_id="p/out", strategy=strategy, fallback=fallback,
                   dead_letter=lambda rows, why, b: letters.append((b, rows.column("_isb_id").to_pylist(), why))
                   or rows.num_rows,
                   stats_dir=tmp_path, record_offsets=offsets.append, sleep=lambda s: waits.append(s) and False, **kw)
    return p, waits, letters, offsets


def strategy(steps=None, on_failure="retry", **backoff):
    return RetryStrategy(backoff=Backoff(steps=steps, **backoff), onFailure=OnFailure(on_failure))


def test_without_a_retry_strategy_the_first_error_fails_the_batch(tmp_path):
    p, waits, *_ = policy(Primary(fail=1), tmp_path)
    with pytest.raises(ConnectionError):
        p(Batch([1, 2]), 0)
    assert waits == [] and p.totals.retries == 0


def test_retries_wait_by_the_backoff_then_the_batch_goes_on(tmp_path):
    primary = Primary(fail=4)
    p, waits, _, _ = policy(primary, tmp_path, strategy(interval=0.5, factor=2, cap=3))
    p(Batch([1, 2, 3]), 0)
    assert waits == [0.5, 1.0, 2.0, 3.0] and primary.written == ["in/0/1", "in/0/2", "in/0/3"]
    assert p.totals.retries == 4 and p.error is None


def test_retry_on_failure_starts_the_backoff_again(tmp_path):
    p, waits, *_ = policy(Primary(fail=5), tmp_path, strategy(steps=2, interval=1, factor=3))
    p(Batch([1]), 0)
    assert waits == [1, 3, 1, 3, 1]


def test_fallback_takes_the_whole_batch_with_reason_and_attempts_once(tmp_path):
    fb = Fallback()
    primary = Primary(fail=100)
    p, waits, _, offsets = policy(primary, tmp_path, strategy(steps=3, on_failure="fallback"), fb)
    p(Batch([1, 2]), 4)
    rows = fb.batches[4]
    assert rows.column("_isb_id").to_pylist() == ["in/0/1", "in/0/2"] and primary.calls == 3
    assert set(rows.column("_isb_attempts").to_pylist()) == {3} and set(rows.column("_isb_batch").to_pylist()) == {4}
    assert "3 attempts failed, the last: connection refused (call 3)" in rows.column("_isb_error")[0].as_py()
    assert offsets == [{"in/0": [[1, 2]]}]  # recorded for the ledger: recovery must not bring them back
    assert (p.totals.retries, p.totals.fallback) == (3, 2)
    # the replay (checkpoint not committed): the fallback holds the batch whole, the primary is not called
    p(Batch([1, 2]), 4)
    assert primary.calls == 3 and p.totals.fallback == 2


def test_a_batch_the_primary_committed_before_failing_goes_nowhere_else(tmp_path, caplog):
    """A primary that can tell (the Delta sink's ``holds``) is asked before the fallback or a drop:
    an attempt whose commit landed and which failed after it leaves nothing to send elsewhere."""

    class Committing(Primary):
        committed: set[int] = set()

        def __call__(self, df, batch_id, on_refused=None):
            self.committed.add(batch_id)  # the commit lands, then the attempt fails
            raise OSError("connection reset after the commit")

        def holds(self, batch_id):
            return batch_id in self.committed

    for action in ("fallback", "drop"):
        fb = Fallback()
        p, _, _, offsets = policy(Committing(), tmp_path / action, strategy(steps=2, on_failure=action), fb)
        p(Batch([1, 2]), 3)
        assert fb.batches == {} and offsets == [] and (p.totals.fallback, p.totals.dropped) == (0, 0)
        assert p.totals.retries == 2 and p.error is None and "the table holds batch 3" in caplog.text


def test_drop_is_counted_never_silent_and_a_replay_drops_nothing_again(tmp_path, caplog):
    p, *_ = policy(Primary(fail=2), tmp_path, strategy(steps=2, on_failure="drop"))
    p(Batch([1, 2, 3]), 0)
    assert p.totals.dropped == 3 and "batch 0 DROPPED (3 records)" in caplog.text
    p(Batch([1, 2, 3]), 0)
    assert p.totals.dropped == 3
    assert PolicyTotals.read(tmp_path / "sink-policy.json").dropped == 3  # kept for the next driver


def test_refused_rows_go_to_the_fallback_else_to_the_dead_letters(tmp_path):
    fb = Fallback()
    primary = Primary(refuse={1})
    p, _, letters, _ = policy(primary, tmp_path / "a", fallback=fb)
    p(Batch([10, 11, 12]), 0)
    assert fb.batches[0].column("_isb_id").to_pylist() == ["in/0/11"] and primary.written == ["in/0/10", "in/0/12"]
    assert fb.batches[0].column("_isb_error")[0].as_py() == "n=1 breaks a rule" and letters == []
    assert (p.totals.refused, p.totals.fallback, p.totals.dead_lettered) == (1, 1, 0)
    q, _, letters, _ = policy(Primary(refuse={0, 2}), tmp_path / "b")
    q(Batch([10, 11, 12]), 0)
    assert letters == [(0, ["in/0/10", "in/0/12"], ["n=0 breaks a rule", "n=2 breaks a rule"])]
    assert (q.totals.refused, q.totals.dead_lettered) == (2, 2)
    q(Batch([10, 11, 12]), 0)  # a replayed batch is not counted twice
    assert q.totals.dead_lettered == 2


def test_totals_survive_a_new_driver_and_cancel_ends_a_wait(tmp_path):
    p, *_ = policy(Primary(fail=1), tmp_path, strategy(interval=0.01))
    p(Batch([1]), 0)
    again = SinkPolicy(Primary(fail=10**6), where="sink 'out'", app_id="p/out", strategy=strategy(interval=30),
                       stats_dir=tmp_path)
    assert again.totals.retries == 1 and again.totals.last_batch == 0
    again.cancel()
    with pytest.raises(SinkRetriesCancelled):
        again(Batch([2]), 1)
    assert "attempt 1: connection refused" in again.error


def test_the_fallback_is_asked_only_for_a_batch_it_may_hold(tmp_path):
    """A new batch beyond any sent to the fallback skips the question; a crash after the fallback's
    commit (the totals not yet updated) still finds it, from the note written before the commit."""
    class Counting(Fallback):
        asked = 0

        def held(self, batch_id):
            Counting.asked += 1
            return super().held(batch_id)

    fb = Counting()
    p, *_ = policy(Primary(), tmp_path, fallback=fb)
    p(Batch([1]), 0)
    p(Batch([2]), 1)
    assert Counting.asked == 0
    # the driver died after the fallback's commit of batch 2, before the totals were written
    q, *_ = policy(Primary(fail=1), tmp_path, strategy(steps=1, on_failure="fallback"), fb)
    add = q._add

    def dies_at_the_end(counts, new):  # after the fallback's commit, before the batch's totals
        if counts.last_batch >= 0:
            raise SystemExit("the driver dies")
        add(counts, new)

    q._add = dies_at_the_end
    with pytest.raises(SystemExit):
        q(Batch([3, 4]), 2)
    again = Primary()
    r, *_ = policy(again, tmp_path, strategy(steps=1, on_failure="fallback"), fb)
    assert fb.held(2) == ["in/0/3", "in/0/4"]
    Counting.asked = 0
    r(Batch([3, 4]), 2)  # Spark's replay of batch 2
    assert Counting.asked == 1 and again.calls == 0  # found in the fallback: nothing written twice
