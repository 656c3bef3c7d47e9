"""The runner's restart policy for transient Spark failures (a fast unit test: the
query and writer are stand-ins; restarting from a checkpoint itself is Spark's)."""

from __future__ import annotations

from isbflow.isb.state import StepStatus
from isbflow.steps.runner import (
    DEFAULT_RESTARTS,
    PipelineRunner,
    RestartPolicy,
    RunningQuery,
    StepRun,
)


class _Writer:
    def __init__(self):
        self.starts = 0

    def start(self):
        self.starts += 1
        return f"query-{self.starts}"


def _run():
    writer = _Writer()
    rq = RunningQuery("raw", None, "query-0", [], writer=writer)
    return StepRun("raw", [rq], StepStatus("raw")), rq, writer


def _runner(policy: RestartPolicy = DEFAULT_RESTARTS) -> PipelineRunner:
    runner = PipelineRunner.__new__(PipelineRunner)  # no NATS or Spark needed for the policy
    runner.restarts = policy
    return runner


def test_connect_back_timeouts_restart_the_query_a_bounded_number_of_times(monkeypatch):
    from isbflow.steps import runner as runner_mod

    waits: list[float] = []
    monkeypatch.setattr(runner_mod.time, "sleep", waits.append)
    runner = _runner()
    run, rq, writer = _run()
    exc = RuntimeError("[STREAM_FAILED] ... org.apache.spark.SparkException: Python worker failed to connect back.")
    n = DEFAULT_RESTARTS.max_restarts
    for i in range(n):
        assert runner._restart_if_transient(run, rq, exc)
        assert rq.query == f"query-{i + 1}"
    # each restart waits longer (the failed attempt's Python process is still loading), capped
    assert waits == [2.0, 4.0, 6.0, 8.0, 10.0] == [DEFAULT_RESTARTS.wait_before(k) for k in range(1, n + 1)]
    assert not runner._restart_if_transient(run, rq, exc)  # out of restarts: the step fails
    assert writer.starts == n and run.status.restarts == n


def test_the_policy_is_the_runners_argument(monkeypatch):
    """A runner given another policy follows it (how a deployment would tune it)."""
    from isbflow.steps import runner as runner_mod

    waits: list[float] = []
    monkeypatch.setattr(runner_mod.time, "sleep", waits.append)
    runner = _runner(RestartPolicy(max_restarts=2, backoff_s=1.0, backoff_max_s=1.5))
    run, rq, writer = _run()
    exc = RuntimeError("Python worker failed to connect back.")
    assert runner._restart_if_transient(run, rq, exc) and runner._restart_if_transient(run, rq, exc)
    assert not runner._restart_if_transient(run, rq, exc)
    assert waits == [1.0, 1.5] and writer.starts == 2


def test_other_failures_are_not_retried():
    runner = _runner()
    run, rq, writer = _run()
    assert not runner._restart_if_transient(run, rq, RuntimeError("BufferLost: buffer x lost sequences 1-9"))
    assert writer.starts == 0 and rq.query == "query-0"


def test_a_read_stalled_by_a_cluster_failover_restarts_but_a_bad_frame_does_not(monkeypatch):
    from isbflow.steps import runner as runner_mod

    monkeypatch.setattr(runner_mod.time, "sleep", lambda s: None)
    runner = _runner()
    run, rq, writer = _run()
    stalled = RuntimeError("[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] ... BufferReadError: buffer src-logs-in: "
                           "no delivery for 30s while reading sequences 1-2000")
    assert runner._restart_if_transient(run, rq, stalled) and writer.starts == 1
    bad = RuntimeError("BufferReadError: buffer isb-x-0: message 7 is not an Arrow frame (...)")
    assert not runner._restart_if_transient(run, rq, bad) and writer.starts == 1


def test_batch_actions_run_again_on_the_same_policy():
    """reprocess's range reads and the window recomputes (isbflow.steps.restart.retry_transient):
    a transient failure runs the action again after the policy's wait; anything else, or one
    failure too many, is raised as it is."""
    from isbflow.steps.restart import retry_transient

    waits: list[float] = []
    calls = iter([RuntimeError("org.apache.spark.SparkException: Python worker failed to connect back."),
                  RuntimeError("BufferReadError: the ISB service did not answer STREAM.INFO of s"), 42])

    def action():
        r = next(calls)
        if isinstance(r, Exception):
            raise r
        return r

    assert retry_transient(action, "reading s", sleep=waits.append) == 42
    assert waits == [DEFAULT_RESTARTS.wait_before(1), DEFAULT_RESTARTS.wait_before(2)]

    def bad():
        raise ValueError("a data error, not the plumbing")

    waits.clear()
    try:
        retry_transient(bad, "reading s", sleep=waits.append)
        raise AssertionError("a data error must not be retried")
    except ValueError:
        assert waits == []

    def always():
        raise RuntimeError("Python worker failed to connect back")

    policy = RestartPolicy(max_restarts=2, backoff_s=1, backoff_max_s=1)
    try:
        retry_transient(always, "reading s", policy, sleep=waits.append)
        raise AssertionError("out of attempts must raise")
    except RuntimeError:
        assert waits == [1, 1]


def test_a_delta_log_entry_trimmed_under_a_commit_is_transient():
    from isbflow.steps.restart import is_transient

    gone = RuntimeError("DeltaError: Kernel error: File not found: /d/sinks/logs/raw/_delta_log/00000000000000000013.json")
    assert is_transient(gone)
    assert not is_transient(RuntimeError("DeltaError: Kernel error: File not found: /d/sinks/logs/raw/part-0.parquet"))
