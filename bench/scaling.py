"""Scale-out: the demo pipeline on a Spark standalone cluster of 1 vs 2 workers (1 core each).

For each worker count, from scratch (a fresh embedded nats-server, a fresh
standalone master + workers from the pyspark wheel on 127.0.0.1, a fresh data
dir): produce N demo events (not timed), then run

    isbflow pipeline run -f <spec> --trigger available-now --master spark://127.0.0.1:<port> --json

as a user would (its own client-mode driver), and time it. ``seconds`` is the
run's own figure (from its runner's start, after the Spark session is up, to
the last step's end: every step of the demo in topological order); the
subprocess wall time including JVM start is reported beside it. The raw sink
must hold every well-formed event (``complete``). records/s = N / seconds. A
configuration that fails with Spark's Python-worker connect-back timeout (seen
on a heavily loaded machine) runs once more from scratch (``attempts``).

The spec is tests/specs/standalone-logs.yaml with buffers and batches sized for
N (``readBatchSize`` = N / 10, at least 1,000; 640 MiB per stream).

On one machine the workers share its cores with the driver, the Python
workers, NATS and each other: the ratio says what a second executor buys
*here*, not on a cluster of separate machines. The JSON describes the machine
and the load average before and after.

    python bench/scaling.py                # 1,000,000 events, 1 and 2 workers
    python bench/scaling.py --quick        # 20,000 events: checks the harness
    nice -n 10 python bench/scaling.py --records 500000 --out /tmp/s.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path[:0] = [str(BENCH), str(ROOT)]

SPEC = ROOT / "tests" / "specs" / "standalone-logs.yaml"
MALFORMED_EVERY = 1000
SEED = 7
#: a configuration failing with Spark's Python-worker connect-back timeout (a loaded machine)
#: runs again from scratch, once; the JSON records the attempts
TRANSIENT = ("Python worker failed to connect back",)
ATTEMPTS = 2


def bench_spec(folder: Path, records: int) -> Path:
    """The standalone spec with buffers and micro-batches sized for ``records``."""
    docs = list(yaml.safe_load_all(SPEC.read_text()))
    docs[0]["spec"]["jetstream"]["bufferConfig"]["stream"]["maxBytes"] = "640MiB"
    docs[1]["spec"]["limits"]["readBatchSize"] = max(1000, records // 10)
    path = folder / "scaling-logs.yaml"
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def good_count(records: int) -> int:
    from isbflow.ops.produce import is_malformed

    return sum(1 for i in range(records) if not is_malformed(i, MALFORMED_EVERY))


def measure(workers: int, records: int, work: Path, memory: str) -> dict:
    """One configuration from scratch: NATS, cluster, produce, run, check, stop."""
    from isbflow.isb import provision, reference
    from isbflow.isb.connect import resolve_settings
    from isbflow.isb.server import start_embedded, stop_embedded
    from isbflow.local.delta import load_table
    from isbflow.ops.produce import produce
    from isbflow.platform.standalone import start_standalone, stop_standalone
    from isbflow.spec import load_specs
    from isbflow.steps.launch import driver_env

    work.mkdir(parents=True)
    spec = bench_spec(work, records)
    specs = load_specs([spec])
    p = specs.only_pipeline()
    nats_dir, data_dir = work / "nats", work / "data"
    start_embedded(nats_dir, max_file_store=20 * 1024**3)
    cluster = None
    try:
        settings = resolve_settings(data_dir=nats_dir)
        asyncio.run(provision.apply(settings, specs))
        rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
        asyncio.run(reference.put(settings, p.name, "services", rows))
        t0 = time.monotonic()
        report = asyncio.run(produce(settings, p, count=records, seed=SEED, malformed_every=MALFORMED_EVERY))
        produce_s = time.monotonic() - t0
        assert report.published == records, report
        cluster = start_standalone(work / "spark", workers=workers, cores=1, memory=memory)
        cmd = [str(Path(sys.executable).parent / "isbflow"), "pipeline", "run", "-f", str(spec),
               "--trigger", "available-now", "--master", cluster.master_url, "--data-dir", str(data_dir), "--json"]
        print(f"  {workers} worker(s): running {records:,} records on {cluster.master_url}", flush=True)
        t0 = time.monotonic()
        proc = subprocess.run(cmd, env=driver_env(settings, data_dir, workdir=ROOT), cwd=ROOT,
                              capture_output=True, text=True)
        wall = time.monotonic() - t0
        if proc.returncode != 0:
            raise RuntimeError(f"pipeline run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        result = json.loads(proc.stdout)
        apps = cluster.master_state().get("completedapps", [])
        raw = load_table(str(data_dir / "sinks" / "logs" / "raw")).to_pyarrow_table(columns=["_isb_id"])
        ids = raw.column("_isb_id")
        expected = good_count(records)
        seconds = float(result["seconds"])
        return {
            "workers": workers, "cores_per_worker": 1, "worker_memory": memory,
            "executor_cores_used": sum(a.get("cores", 0) for a in apps),
            "records": records, "seconds": round(seconds, 3), "wall_seconds_with_startup": round(wall, 3),
            "records_per_s": round(records / seconds, 1),
            "sink_rows": raw.num_rows, "expected_sink_rows": expected,
            "complete": raw.num_rows == expected and len(set(ids.to_pylist())) == expected,
            "produce_records_per_s": round(records / produce_s, 1),
            "steps": {v: {"state": s["state"], "dlq_total": s["dlq_total"]} for v, s in result["steps"].items()},
        }
    finally:
        if cluster is not None:
            stop_standalone(cluster)
        stop_embedded(nats_dir)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20,000 records: checks the harness, not the engine")
    ap.add_argument("--records", type=int, help="events per configuration (default 1,000,000; quick 20,000)")
    ap.add_argument("--workers", default="1,2", help="worker counts to compare (default 1,2)")
    ap.add_argument("--worker-memory", default="1g", help="memory per worker (its one executor's heap)")
    ap.add_argument("--out", default=str(BENCH / "results" / "scaling.json"))
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    records = args.records or (20_000 if args.quick else 1_000_000)
    counts = [int(w) for w in args.workers.split(",")]

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import _common as cm

    cm.stop_on_sigterm()
    out: dict = {"machine": cm.machine(), "load_average_start": list(os.getloadavg()),
                 "config": {"records": records, "workers": counts, "quick": args.quick,
                            "spec": str(SPEC.relative_to(ROOT)), "malformed_every": MALFORMED_EVERY,
                            "trigger": "available-now", "read_batch_size": max(1000, records // 10)},
                 "runs": {}}
    work = Path(tempfile.mkdtemp(prefix="isbflow-scaling-"))
    try:
        for w in counts:
            for attempt in range(1, ATTEMPTS + 1):
                try:
                    r = measure(w, records, work / f"w{w}-{attempt}", args.worker_memory)
                    break
                except RuntimeError as e:
                    if attempt == ATTEMPTS or not any(m in str(e) for m in TRANSIENT):
                        raise
                    print(f"  {w} worker(s): transient failure, again from scratch: "
                          f"{str(e).splitlines()[-1][:200]}", flush=True)
            r["attempts"] = attempt
            out["runs"][str(w)] = r
            print(f"  {w} worker(s): {r['records_per_s']:,.0f} records/s ({r['seconds']:.1f} s), "
                  f"complete={r['complete']}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    out["load_average_end"] = list(os.getloadavg())
    if {"1", "2"} <= set(out["runs"]):
        out["ratio_2_over_1"] = round(out["runs"]["2"]["records_per_s"] / out["runs"]["1"]["records_per_s"], 3)
    out["note"] = ("one machine: workers, driver, Python workers and nats-server share its "
                   f"{out['machine']['cores']} cores; the ratio is what a second executor buys here, not on "
                   "separate machines")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("ratio_2_over_1",) if k in out}), f"-> {args.out}")
    if not all(r["complete"] for r in out["runs"].values()):
        sys.exit("a run's raw sink is incomplete: see the JSON")


if __name__ == "__main__":
    main()
