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
