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
    # and each second of window costs ~3 cores (the demo and both floors) out of the suite's budget
    out = tmp_path / "cost.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cost.py"), "--quick", "--window", "10", "--warmup", "4",
                           "--idle", "5", "--out", str(out)],
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
