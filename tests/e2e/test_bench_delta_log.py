"""bench/delta_log.py, small: a sink's commit timed against the entries of its log, as figures.

Runs the benchmark as a subprocess with two small logs and a few commits each; checks the JSON's
shape, that every point committed its batches and that the log holds what it was padded to (the
point with more files in the table too). No timing is asserted.
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT


def test_delta_log_bench_reports_each_mode_and_log_size(tmp_path):
    out = tmp_path / "delta_log.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "delta_log.py"), "--entries", "20,150",
                           "--batches", "4", "--active-files", "1000", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [(p["mode"], p["entries"], p["active_files"]) for p in r["points"]] == [
        ("append", 20, 0), ("append", 150, 0), ("append", 100, 1000), ("upsert", 20, 0), ("upsert", 150, 0)]
    for p in r["points"]:
        assert p["batches"] == 4 and p["cpu_ms_median"] > 0 and p["wall_ms_median"] > 0, p
        # the padded log, the timed commits (and the commits before them), a checkpoint or two
        assert p["entries"] + 4 <= p["log_files"] <= p["entries"] + 14, p
    assert set(r["us_per_entry"]) == {"append", "upsert"} and r["machine"]
