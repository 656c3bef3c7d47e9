"""The runner's restart policy for transient Spark failures (a fast unit test: the
query and writer are stand-ins; restarting from a checkpoint itself is Spark's)."""

from __future__ import annotations

from isbflow.isb.state import StepStatus
from isbflow.steps.runner import MAX_RESTARTS, PipelineRunner, RunningQuery, StepRun


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


def test_connect_back_timeouts_restart_the_query_a_bounded_number_of_times(monkeypatch):
    from isbflow.steps import runner as runner_mod

    waits: list[float] = []
    monkeypatch.setattr(runner_mod.time, "sleep", waits.append)
    runner = PipelineRunner.__new__(PipelineRunner)  # no NATS or Spark needed for the policy
    run, rq, writer = _run()
    exc = RuntimeError("[STREAM_FAILED] ... org.apache.spark.SparkException: Python worker failed to connect back.")
    for i in range(MAX_RESTARTS):
        assert runner._restart_if_transient(run, rq, exc)
        assert rq.query == f"query-{i + 1}"
    # each restart waits longer (the failed attempt's Python process is still loading), capped
    assert waits == [min(runner_mod.RESTART_BACKOFF_S * n, runner_mod.RESTART_BACKOFF_MAX_S)
                     for n in range(1, MAX_RESTARTS + 1)]
    assert waits == sorted(waits) and max(waits) <= runner_mod.RESTART_BACKOFF_MAX_S
    assert not runner._restart_if_transient(run, rq, exc)  # out of restarts: the step fails
    assert writer.starts == MAX_RESTARTS and run.status.restarts == MAX_RESTARTS


def test_other_failures_are_not_retried():
    runner = PipelineRunner.__new__(PipelineRunner)
    run, rq, writer = _run()
    assert not runner._restart_if_transient(run, rq, RuntimeError("BufferLost: buffer x lost sequences 1-9"))
    assert writer.starts == 0 and rq.query == "query-0"


def test_a_read_stalled_by_a_cluster_failover_restarts_but_a_bad_frame_does_not(monkeypatch):
    from isbflow.steps import runner as runner_mod

    monkeypatch.setattr(runner_mod.time, "sleep", lambda s: None)
    runner = PipelineRunner.__new__(PipelineRunner)
    run, rq, writer = _run()
    stalled = RuntimeError("[PYTHON_STREAMING_DATA_SOURCE_RUNTIME_ERROR] ... BufferReadError: buffer src-logs-in: "
                           "no delivery for 30s while reading sequences 1-2000")
    assert runner._restart_if_transient(run, rq, stalled) and writer.starts == 1
    bad = RuntimeError("BufferReadError: buffer isb-x-0: message 7 is not an Arrow frame (...)")
    assert not runner._restart_if_transient(run, rq, bad) and writer.starts == 1
