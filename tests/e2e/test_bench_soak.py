"""bench/soak.py --quick runs the demo pipeline continuously, drains it and reports every slope.

Runs the benchmark as a subprocess (its own nats-server and detached driver, both stopped by
PID when it ends); checks the JSON has every metric with its first part, last part and
ratio, that every step committed micro-batches, and that the raw sink came out exact (every
produced event but the dead letters, none twice). No timing or slope is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

METRICS = ("cpu_per_batch_s", "commit_latency_s", "heartbeat_age_s", "files_total", "ledger_bytes",
           "delta_log_bytes", "checkpoint_bytes", "state_bytes", "rss_bytes", "pss_bytes")


def test_quick_soak_reports_every_slope_and_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert set(r["slopes"]) == set(METRICS)
    for key, m in r["slopes"].items():
        assert isinstance(m["first"], (int, float)) and isinstance(m["last"], (int, float)), (key, m)
        if m["ratio"] is None:  # only when it grew from nothing (e.g. no ledger entry in the first part)
            assert m["first"] == 0 < m["last"] and m["flat"] is False, (key, m)
        else:
            assert isinstance(m["ratio"], (int, float)) and m["ratio"] >= 0, (key, m)
            assert m["flat"] is (m["ratio"] <= 1.1), (key, m)  # the verdict follows from the ratio
    steps = r["run"]["batches_per_step"]
    assert set(steps) == {"in", "parse", "enrich", "minutely", "raw", "agg", "errors"}
    assert all(n > 0 for n in steps.values()), steps
    s = r["sink"]
    assert s["exact"] is True, s
    assert s["rows"] == s["expected"] == r["run"]["produced"] - s["dead_letters"] > 0, s
    assert s["dead_letters"] == s["malformed_produced"] > 0, s  # the dead-letter path was exercised
    assert r["series"] and {"cpu_s", "batches", "files", "ledger_bytes", "rss_bytes"} <= set(r["series"][-1])
    assert r["files_final"]["checkpoint_commits"] > 0 and r["files_final"]["sink_raw_log"] > 0
    # each maintenance folded and trimmed every sink's Delta log (accelerated retention 0 h) to a few files
    done = [m[k] for m in r["maintenance"] for k in ("raw", "agg") if not m[k]["skipped"]]
    assert any(d["path"].endswith("raw") for d in done), r["maintenance"]
    assert all(d["folded_through"] is not None and d["log_files_after"] <= 8 for d in done), done
    assert r["machine"]["cores"] and len(r["load_average_end"]) == 3
    assert r["all_flat"] is all(m["flat"] for m in r["slopes"].values())


def _soak():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_soak", ROOT / "bench" / "soak.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_part_in_which_no_batch_committed_is_widened_until_one_did():
    """A quick run's first part can hold no committed batch (4.5 s on a loaded machine): the
    per-batch CPU then has no first value. The window grows towards the middle until one did."""
    soak = _soak()
    # samples every 2 s over 40 s; batches commit from t=8 on, one per 2 s; CPU 0.5 s per batch
    series = [{"t": t, "batches_total": max(0, (t - 6) // 2), "cpu_s": 0.5 * max(0, (t - 6) // 2) + 0.1 * t}
              for t in range(0, 42, 2)]
    m = soak.ends(series, "cpu_per_batch_s", 0, 40, parts=10)
    assert m["first"] is not None and m["last"] is not None, m
    assert m["seconds"][0] == 8 and m["samples"][0] == 5, m  # 0..8: the first sample that saw a batch
    assert m["seconds"][1] == 4 and m["samples"][1] == 3, m  # the last part had batches: unchanged
    # a counter that never moves stays without a figure, rather than a made-up one
    flat = [{**s, "batches_total": 0} for s in series]
    assert soak.ends(flat, "cpu_per_batch_s", 0, 40, parts=10)["first"] is None
    # a level metric keeps its plain parts
    lv = soak.ends([{**s, "rss_bytes": 100} for s in series], "rss_bytes", 0, 40, parts=10)
    assert lv["samples"] == [3, 3] and lv["ratio"] == 1.0, lv


def test_plot_draws_each_metric_of_a_soak_json_as_an_svg_chart(tmp_path):
    """bench/plot.py: one chart per metric, counter pairs drawn as rates, a valid SVG."""
    import xml.etree.ElementTree as ET

    series = [{"t": t, "cpu_s": 0.1 * t, "batches_total": t // 2, "batch_sum_s": 0.05 * t, "batch_count": t // 2,
               "rss_bytes": 2**30 + t, "ledger_bytes": 100} for t in range(0, 600, 10)]
    src = tmp_path / "soak.json"
    src.write_text(json.dumps({"series": series, "run": {"steady_from_s": 50, "steady_seconds": 500}}))
    out = tmp_path / "soak.svg"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(src), "--out", str(out),
                           "--metric", "cpu_per_batch_s", "--metric", "rss_bytes", "--metric", "ledger_bytes"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    svg = ET.fromstring(out.read_text())
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 3
    cpu = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert len({round(y, 3) for _, y in cpu}) == 1  # 0.2 CPU-s a batch throughout: a flat line
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"series": []}))
    assert subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), str(empty), "--out", str(out)],
                          capture_output=True, timeout=60).returncode == 2
