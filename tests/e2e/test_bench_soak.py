"""bench/soak.py --quick runs the demo pipeline continuously, drains it and reports every slope.

Runs the benchmark as a subprocess (its own nats-server and detached driver, both stopped by
PID when it ends); checks the JSON has every metric with its first tenth, last tenth and
ratio, that every step committed micro-batches, and that the raw sink came out exact (every
produced event but the dead letters, none twice). No timing or slope is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

METRICS = ("cpu_per_batch_s", "commit_latency_s", "heartbeat_age_s", "files_total", "ledger_bytes",
           "rss_bytes", "pss_bytes")


def test_quick_soak_reports_every_slope_and_loses_nothing(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "soak.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert set(r["slopes"]) == set(METRICS)
    for key, m in r["slopes"].items():
        assert isinstance(m["first"], (int, float)) and isinstance(m["last"], (int, float)), (key, m)
        if m["ratio"] is None:  # only when it grew from nothing (e.g. no ledger entry in the first tenth)
            assert m["first"] == 0 < m["last"] and m["flat"] is False, (key, m)
        else:
            assert isinstance(m["ratio"], (int, float)) and m["ratio"] >= 0, (key, m)
            assert m["flat"] is (m["ratio"] <= 1.1), (key, m)  # the verdict follows from the ratio
    steps = r["run"]["batches_per_step"]
    assert set(steps) == {"in", "parse", "enrich", "minutely", "raw", "agg"}
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
