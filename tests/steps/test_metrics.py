"""Prometheus metrics of a running pipeline (isbflow.steps.metrics).

``PipelineMetrics.observe`` is checked on recorded progress reports (no Spark):
every batch counted once however often it is called, idle triggers skipped,
lag and buffer usage from the heartbeat. Then the real thing: ``isbflow
pipeline run --trigger continuous --metrics-port P`` in a subprocess, scraped
over HTTP on 127.0.0.1 until the sink has everything, with every step's series
checked against what was produced; the drain stops it and removes its record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from isbflow.isb.server import free_port
from isbflow.isb.state import StepStatus
from isbflow.spec import load_specs
from isbflow.steps.metrics import PipelineMetrics, buffer_usage, read_targets, series_names
from isbflow.steps.session import DRIVER_JAVA_OPTIONS
from tests.conftest import ROOT
from tests.helpers.scale_env import ISBFLOW, SPEC, DemoRun

P = load_specs([SPEC]).only_pipeline()


def _progress(batch: int, rows: int, ms: int, ts: str, ran: bool = True, out: int | None = None) -> dict:
    durations = {"triggerExecution": ms, **({"addBatch": ms - 1} if ran else {})}
    return {"batchId": batch, "numInputRows": rows, "durationMs": durations, "timestamp": ts,
            "sink": {"numOutputRows": rows if out is None else out}}


def _run(vertex: str, queries: list, status: StepStatus) -> SimpleNamespace:
    return SimpleNamespace(vertex=vertex, queries=queries, status=status)


def _query(to: str | None, progress: list[dict], stats_dir: str | None = None) -> SimpleNamespace:
    edges = [] if to is None else [(to, stats_dir)]
    return SimpleNamespace(to=to, edges=edges, query=SimpleNamespace(recentProgress=progress))


def value(m: PipelineMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"pipeline": "logs", **labels})


def test_a_foreach_batch_sink_counts_the_rows_it_was_handed():
    # Spark reports numOutputRows -1 for a foreachBatch sink (the Delta and PostgreSQL sinks)
    m = PipelineMetrics(P)
    progress = [_progress(0, 40, 300, "2026-01-01T00:00:01.000Z", out=-1),
                _progress(1, 2, 100, "2026-01-01T00:00:02.000Z", out=-1)]
    m.observe(None, _run("raw", [_query(None, progress)], StepStatus("raw", state="running")))  # type: ignore[arg-type]
    assert value(m, "isbflow_step_records_out_total", step="raw", to="delta") == 42
    assert value(m, "isbflow_step_records_in_total", step="raw") == 42


def test_observe_counts_each_batch_once(tmp_path):
    m = PipelineMetrics(P)
    stats = tmp_path / "stats"
    stats.mkdir()
    for b, rows in ((0, 998), (1, 499)):  # what the writer stored anew (dead letters excluded)
        (stats / f"batch-{b}.json").write_text(json.dumps({"batchId": b, "rows": rows}))
    progress = [_progress(0, 1000, 3000, "2026-01-01T00:00:01.000Z"),
                _progress(1, 500, 1000, "2026-01-01T00:00:02.000Z")]
    status = StepStatus("in", state="running", dlq_total=3, unrouted_total=4, lag={"src-logs-in": 7})
    run = _run("in", [_query("parse", progress, str(stats))], status)

    m.observe(None, run)  # type: ignore[arg-type]
    progress.append(_progress(2, 0, 5, "2026-01-01T00:00:12.000Z", ran=False))  # an idle trigger
    m.observe(None, run)  # type: ignore[arg-type]  # again: nothing new is counted twice
    assert value(m, "isbflow_step_unrouted_records_total", step="in") == 4
    run.status = StepStatus("in", state="running", dlq_total=3, unrouted_total=9, lag={"src-logs-in": 7})
    m.observe(None, run)  # type: ignore[arg-type]
    assert value(m, "isbflow_step_unrouted_records_total", step="in") == 9  # only what the total gained
    run.status = status

    assert value(m, "isbflow_step_records_in_total", step="in") == 1500
    assert value(m, "isbflow_step_records_out_total", step="in", to="parse") == 1497
    assert value(m, "isbflow_step_batch_duration_seconds_count", step="in") == 2
    assert value(m, "isbflow_step_batch_duration_seconds_sum", step="in") == 4.0
    assert value(m, "isbflow_step_dead_letters_total", step="in") == 3
    assert value(m, "isbflow_step_lag_messages", step="in", stream="src-logs-in") == 7
    assert value(m, "isbflow_step_state", step="in", state="running") == 1
    assert value(m, "isbflow_step_state", step="in", state="failed") == 0
    assert value(m, "isbflow_step_last_batch_timestamp_seconds", step="in") == 1767225602.0

    # a sink: rows out are what it wrote; buffer usage of its input edge from the lag in frames
    sink_status = StepStatus("raw", state="running", lag={"isb-logs-enrich-raw-0": 120})
    m.observe(None, _run("raw", [_query(None, [_progress(0, 640, 200, "2026-01-01T00:00:03.000Z")])],  # type: ignore[arg-type]
                         sink_status))
    assert value(m, "isbflow_step_records_out_total", step="raw", to="delta") == 640
    # bufferMaxLength 2,000,000 rows = 200 frames of 10,000: 120 frames are 60 %
    assert value(m, "isbflow_buffer_usage_ratio", step="raw", stream="isb-logs-enrich-raw-0") == 0.6
    assert value(m, "isbflow_buffer_usage_limit_ratio", step="raw", stream="isb-logs-enrich-raw-0") == 0.8
    assert value(m, "isbflow_sink_retries_total", step="raw") == 0  # the series exist from the start
    # a sink's failure policy: what its totals gained
    m.observe(None, _run("raw", [], StepStatus("raw", state="running", sink_retries=4, fallback_total=21,  # type: ignore[arg-type]
                                               dropped_total=3, refused_total=1)))
    assert [value(m, f"isbflow_sink_{n}_total", step="raw") for n in
            ("retries", "fallback_records", "dropped_records", "refused_records")] == [4, 21, 3, 1]


def test_buffer_usage_and_series_names():
    assert buffer_usage(0, 2_000_000) == 0.0
    assert buffer_usage(5, 15_000) == 2.5  # capacity ceil(15000 / 10000) = 2 frames
    assert buffer_usage(5, None) == 0.0
    names = series_names(PipelineMetrics(P).registry)
    assert {"isbflow_step_records_in_total", "isbflow_step_records_out_total",
            "isbflow_step_batch_duration_seconds_bucket", "isbflow_step_lag_messages",
            "isbflow_buffer_usage_ratio", "isbflow_step_dead_letters_total",
            "isbflow_step_unrouted_records_total"} <= names


# ---------------------------------------------------------------------------------- a running pipeline

def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """``/metrics`` as {(series name, sorted labels without pipeline): value}."""
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("pipeline", "logs") == "logs"
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def get(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


@pytest.mark.slow
def test_scrape_a_running_pipeline(nats_server, tmp_path):
    count, malformed_every = 1500, 500
    demo = DemoRun(nats_server.settings, tmp_path / "data")
    demo.produce(count, malformed_every)
    good = len(demo.good_ids(count, malformed_every))
    port = free_port()
    log = open(tmp_path / "run.log", "wb")
    proc = subprocess.Popen(demo.command("--metrics-port", str(port), trigger="continuous"), env=demo.env(),
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline, samples = time.monotonic() + 480, {}
        while time.monotonic() < deadline:
            assert proc.poll() is None, Path(log.name).read_text()[-4000:]
            try:
                samples = scrape(url)
            except OSError:
                samples = {}
            if (get(samples, "isbflow_step_records_out_total", step="raw", to="delta") == good
                    and get(samples, "isbflow_step_lag_messages", step="raw", stream="isb-logs-enrich-raw-0") == 0):
                break
            time.sleep(1)
        else:
            pytest.fail(f"the raw sink's metrics never reached {good} rows: {samples}\n"
                        f"{Path(log.name).read_text()[-3000:]}")
        assert read_targets(demo.data_dir, "logs") == [  # a Prometheus file_sd target list
            {"targets": [f"127.0.0.1:{port}"], "labels": {"isbflow_key": "logs", "pid": str(proc.pid)}}]

        flow = {  # step -> (records in, {to: records out})
            "in": (count, {"parse": good}),
            "parse": (good, {"enrich": good}),
            "enrich": (good, {"raw": good, "minutely": good}),
            "raw": (good, {"delta": good}),
        }
        for step, (rows_in, outs) in flow.items():
            assert get(samples, "isbflow_step_records_in_total", step=step) == rows_in, step
            for to, rows in outs.items():
                assert get(samples, "isbflow_step_records_out_total", step=step, to=to) == rows, (step, to)
            assert get(samples, "isbflow_step_batch_duration_seconds_count", step=step) >= 1, step
            assert get(samples, "isbflow_step_state", step=step, state="running") == 1, step
        assert get(samples, "isbflow_step_dead_letters_total", step="in") == count // malformed_every
        assert get(samples, "isbflow_step_dead_letters_total", step="parse") == 0
        assert get(samples, "isbflow_step_lag_messages", step="in", stream="src-logs-in") == 0
        for p in range(2):
            stream = f"isb-logs-in-parse-{p}"
            assert get(samples, "isbflow_buffer_usage_ratio", step="parse", stream=stream) == 0, stream
            assert get(samples, "isbflow_buffer_usage_limit_ratio", step="parse", stream=stream) == 0.8
        assert {s for (n, labels) in samples for k, s in labels if k == "step"} == set(P.topological_order())
        # the driver's JVM runs with the lean options (isbflow.steps.session.driver_conf)
        jvms = [c for c in psutil.Process(proc.pid).children(recursive=True) if c.name() == "java"]
        assert len(jvms) == 1 and set(DRIVER_JAVA_OPTIONS.split()) <= set(jvms[0].cmdline()), [
            c.cmdline() for c in jvms]

        drain = subprocess.run([ISBFLOW, "pipeline", "drain", "-f", str(SPEC), "--data-dir", str(demo.data_dir),
                                "--timeout", "300"], env=demo.env(), capture_output=True, text=True, timeout=400)
        assert drain.returncode == 0, drain.stdout + drain.stderr
        assert proc.wait(timeout=120) == 0
        assert read_targets(demo.data_dir, "logs") is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
