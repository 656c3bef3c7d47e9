"""bench/throughput.py --quick runs end to end and writes every figure the issue asks for.

Runs the benchmark as a subprocess (its own nats-server and SparkSession, both
stopped by PID when it ends); checks the JSON's shape and that every measured
query moved all its records into its sink. No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

#: smaller than --quick's own sizes (40,000 records, 20,000 events, 15 s live): each section still
#: runs its five micro-batches and every figure is measured; the sizes are not what is tested here
THROUGHPUT_SIZES = ["--records", "10000", "--events", "5000", "--live-seconds", "6", "--live-rate", "1000"]
#: 8,000 events in 1,000-row batches: the buffer is lost half-way, eight batches in
RECOVERY_SIZES = ["--count", "8000"]
TOP_KEYS = ("a_over_b", "a_over_h", "a_over_c", "e_over_d", "replay_over_first",
            "latency_p50_s", "latency_p99_s", "peak_rss_bytes")


def test_quick_benchmark_writes_all_figures(tmp_path):
    out = tmp_path / "throughput.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "throughput.py"), "--quick", *THROUGHPUT_SIZES,
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert (r["config"]["records"], r["config"]["events"]) == (10_000, 5_000)
    for key in TOP_KEYS:
        assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r[key])
    for section in ("A", "B", "C", "E", "H"):
        assert r[section]["complete"], (section, r[section]["sink_rows"], r[section]["records"])
        assert r[section]["records_per_s"] > 0 and r[section]["steady_records_per_s"] > 0
        assert len(r[section]["batches"]) >= 2, section  # several micro-batches: a steady state exists
    assert r["G"]["replay"]["complete"]
    assert r["D"]["records"] == r["config"]["events"]
    f = r["F"]
    assert f["publisher"]["acked"] == f["publisher"]["published"] == f["records_visible"]
    assert f["latency_p50_s"] <= f["latency_p99_s"]
    m = r["machine"]
    assert m["cores"] and m["memory_bytes"] and m["pyspark"] and m["deltalake"] and "v2." in m["nats-server"]
    assert len(r["load_average_start"]) == 3 and len(r["load_average_end"]) == 3
    assert {t["key"] for t in r["targets"]} == set(TOP_KEYS)
    # each target's verdict follows from its value and goal, and the printed table says the same
    for t in r["targets"]:
        expected = r[t["key"]] >= t["bound"] if t["op"] == ">=" else r[t["key"]] <= t["bound"]
        assert t["met"] is expected, t
        [row] = [ln for ln in proc.stdout.splitlines() if ln.startswith(t["label"])]
        assert row.endswith("met" if expected else "MISSED"), row


def test_quick_recovery_benchmark_recovers_and_reports_its_figures(tmp_path):
    """bench/recovery.py --quick: a buffer lost half-way, recovered; the JSON has both ratios and
    the sinks came out complete. No timing is asserted."""
    out = tmp_path / "recovery.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "recovery.py"), "--quick", *RECOVERY_SIZES,
                           "--out", str(out)], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["complete"] is True, r["sink"]
    assert r["config"]["count"] == 8_000
    assert r["sink"]["rows"] == r["config"]["count"] and r["sink"]["duplicates"] == 0
    assert 0 < r["loss"]["rows_in_sink"] < r["config"]["count"]
    assert r["replay"]["records"] > 0 and r["replay"]["low_offset"] >= 1
    for key in ("replay_over_normal", "recovery_overhead"):
        assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r[key])
    assert {t["key"] for t in r["targets"]} == {"replay_over_normal", "recovery_overhead"}
    assert {"detect", "recreate", "rewind", "replay", "verify"} <= set(r["phases"])
    assert r["machine"]["cores"] and len(r["load_average_end"]) == 3
