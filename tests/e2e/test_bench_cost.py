"""bench/cost.py --quick: the demo pipeline at one low rate against the two floors, as figures.

Runs the benchmark as a subprocess (its own nats-server, detached driver and floors' child, all
stopped by PID when it ends); checks the JSON's shape and that the figures are positive and
consistent with each other (CPU per batch and per 1,000 events from the same window's counters,
peak memory at least the mean, p99 at least p50). No timing is asserted, nor any target's verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

WINDOW = ("seconds", "events", "batches", "cpu_s", "cores", "cpu_s_per_1000_events", "cpu_ms_per_batch",
          "pss_mean_bytes", "pss_peak_bytes", "rss_mean_bytes", "rss_peak_bytes", "load_average_mean")


def check_window(w: dict, what: str) -> None:
    assert set(WINDOW) <= set(w), (what, sorted(w))
    assert w["seconds"] > 0 and w["events"] > 0 and w["batches"] > 0 and w["cpu_s"] > 0, (what, w)
    assert w["cores"] == pytest.approx(w["cpu_s"] / w["seconds"], rel=0.01, abs=1e-3), (what, w)
    assert w["cpu_s_per_1000_events"] == pytest.approx(w["cpu_s"] * 1000 / w["events"], rel=0.01), (what, w)
    assert w["cpu_ms_per_batch"] == pytest.approx(w["cpu_s"] * 1000 / w["batches"], rel=0.01), (what, w)
    assert 0 < w["pss_mean_bytes"] <= w["pss_peak_bytes"] and 0 < w["rss_mean_bytes"] <= w["rss_peak_bytes"], w
    assert w["pss_mean_bytes"] <= w["rss_peak_bytes"] and w["load_average_mean"] >= 0, (what, w)


def test_quick_cost_reports_the_demo_and_both_floors(tmp_path):
    # windows shorter than --quick's own (20 s + 8 s of warm-up): the harness is what is checked here,
    # and each second of window costs ~3 cores (the demo and both floors) out of the suite's budget;
    # the idle window 2 s after the pause, not 30 (a worker of the suite waiting, not measuring)
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cost.py"), "--quick", "--window", "10", "--warmup", "4",
                           "--idle", "5", "--idle-quiet", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["machine"]["cores"] and len(r["load_average_start"]) == len(r["load_average_end"]) == 3
    assert r["queries"] == 7  # the demo's six steps: one query per out edge and per sink
    [x] = r["rates"]
    assert x["rate"] == 100
    d = x["demo"]
    for who in ("demo", "floor_rate", "floor_python"):
        check_window(x[who], who)
    assert d["queries"] == 7 and set(d["batches_per_query"].values()) and sum(d["batches_per_query"].values()) == \
        d["batches"], d
    assert d["latency_rows"] > 0 and 0 < d["latency_p50_s"] <= d["latency_p99_s"], d
    assert 0 < d["sink_rows"] and d["kept_up"] is (d["sink_rows"] >= 0.9 * d["events"]), d
    assert x["floor_python"]["duration_ms_per_batch"].get("latestOffset") is not None, x["floor_python"]
    # where the demo's CPU went, by kind of process and the JVM's by kind of thread (from /proc)
    split = d["where_cpu_goes"]
    assert split["process_ms_per_batch"]["jvm"] > 0 and split["process_ms_per_batch"]["driver python"] > 0, split
    assert {"jit", "gc and safepoints", "stream threads"} <= set(split["jvm_ms_per_batch"]), split
    assert sum(split["jvm_ms_per_batch"].values()) == pytest.approx(split["process_ms_per_batch"]["jvm"], abs=1), split
    for floor in ("floor_rate", "floor_python"):  # the same split for the floors, to set beside the demo's
        assert {"jvm", "driver python"} <= set(x[floor]["where_cpu_goes"]["process_ms_per_batch"]), x[floor]
        # the floors' sampler runs in the tree they measure: what it spent is counted, then taken out
        assert x[floor]["sampler_cpu_s"] > 0, x[floor]
    for key in ("cpu_ms_per_batch", "cores"):
        for kind in ("rate", "python"):
            ratio = x["ratios"][f"{key}_over_{kind}"]
            assert ratio == pytest.approx(d[key] / x[f"floor_{kind}"][key], rel=0.02), (key, kind, x["ratios"])
    assert {t["verdict"] for t in x["targets"]} <= {"met", "missed", "n/a"} and len(x["targets"]) == 6
    i = r["idle"]  # the producer paused, then the driver tree with nothing to do
    assert i["seconds"] > 0 and i["cpu_s"] > 0 and i["cores"] == pytest.approx(i["cpu_s"] / i["seconds"], rel=0.01), i
    assert 0 < i["pss_mean_bytes"] <= i["pss_peak_bytes"] and i["target"]["verdict"] in ("met", "missed"), i
    h = r["harness_cpu_s"]
    assert h["total"] == pytest.approx(h["drivers"] + h["floors_child"] + h["bench"], abs=0.2) and h["drivers"] > 0


def test_a_bench_ended_by_sigterm_stops_what_it_started(tmp_path):
    """``kill`` of a bench (or a CI timeout) ends it as Ctrl-C does (bench/_common.stop_on_sigterm): its
    driver and nats-server stop with it, and its JSON says how it ended. Before, SIGTERM ended the bench
    alone and both ran on."""
    import os
    import re
    import signal
    import time

    out = tmp_path / "cost.json"
    proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "cost.py"), "--quick", "--no-floors",
                             "--out", str(out)], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            cwd=ROOT)
    work = None
    try:
        for line in proc.stderr:  # the bench logs to stderr; the driver's line names its work folder
            m = re.search(r"driver pid (\d+).* log (/\S+?)/logs/", line)
            if m:
                driver, work = int(m.group(1)), m.group(2)
                break
        assert work is not None, "the bench never launched its driver"
        started = [p for p in os.listdir("/proc") if p.isdigit() and work.encode() in _cmdline(p)]
        assert len(started) >= 2, started  # nats-server and the driver (its launcher names the work folder)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    deadline = time.monotonic() + 60
    while (left := [p for p in started if os.path.exists(f"/proc/{p}")]) and time.monotonic() < deadline:
        time.sleep(0.5)
    named = [(p, _cmdline(p)[:200]) for p in left]
    for p in left:  # a failing run still cleans up what the bench left: each one's process group
        try:        # (the driver runs in its own session, with its JVM and Python workers)
            group = os.getpgid(int(p))
            if group != os.getpgrp():
                os.killpg(group, signal.SIGKILL)
            else:
                os.kill(int(p), signal.SIGKILL)
        except OSError:
            pass
    assert not left, named
    assert not os.path.exists(f"/proc/{driver}")
    assert "SystemExit: 143" in json.loads(out.read_text())["error"]


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_python_io_floor_reads_and_writes_through_python(tmp_path):
    """The ``python_io`` floor (``--floors``; not in ``--quick``): the trivial Python source into the
    trivial Python sink, run by the floors' child as ``bench/cost.py`` runs it, two queries, a short
    window. Every row the counter made reaches the sink's tasks (Spark counts them in), the sink's
    Python workers ran (``daemons and workers`` in its split), and the figures are those of a window."""
    out = tmp_path / "floors.json"
    cfg = {"rates": [100.0], "queries": 2, "kinds": ["python_io"], "trigger": "1 second", "warmup": 1.0,
           "settle": 0.0, "window": 6.0, "sample_every": 1.0}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cost.py"), "--floors-child", json.dumps(cfg),
                           "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert set(r["100.0"]) == {"python_io"}, r
    w = r["100.0"]["python_io"]
    check_window(w, "python_io")
    assert w["restarts"] == 0 and w["rows_per_query_per_s"] > 50, w
    assert "python.PythonTable" in w["sink"], w["sink"]  # a Python data source sink, not noop
    assert w["duration_ms_per_batch"].get("addBatch", 0) > 0, w
    assert w["where_cpu_goes"]["process_ms_per_batch"].get("daemons and workers", 0) > 0, w["where_cpu_goes"]


def test_the_floors_are_named_on_the_command_line():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cost.py"), "--floors", "rate,pyhton"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "unknown floor(s) pyhton" in proc.stderr, proc.stderr[-2000:]
