"""bench/throughput.py --stores: the names it takes, without starting a store or Spark.

Each check runs Python as a subprocess (importing the bench sets its paths and environment for
Spark's workers); the measurement itself is bench/stores.py's, run by hand (bench/README.md).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import ROOT

BENCH = ROOT / "bench"


def test_store_names_map_to_the_stores_bench_kinds_with_plain_jetstream_first():
    code = ("import json, throughput as tp; cfg = tp.Config(1000, 0, 0, 0, 0, '1 second', 0, 100); "
            "print(json.dumps([tp.store_kinds(n, cfg) for n in ('encrypted,jetstream', 'aes', 'chachapoly,plain')]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == [["plain", "chachapoly"], ["plain", "aes"], ["plain", "chachapoly"]]


def test_an_unknown_or_repeated_store_is_refused_before_anything_starts(tmp_path):
    for names in ("jetstream,mongo", "encrypted,chachapoly"):
        proc = subprocess.run([sys.executable, str(BENCH / "throughput.py"), "--stores", names,
                               "--out", str(tmp_path / "t.json")], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert proc.returncode == 2, (names, proc.stderr[-2000:])
        assert f"--stores {names}: name each of jetstream, redis, encrypted" in proc.stderr
        assert not (tmp_path / "t.json").exists()
