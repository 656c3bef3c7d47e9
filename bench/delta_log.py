"""What a Delta sink's commit costs as its log grows: the driver's CPU per micro-batch against the
number of entries in ``_delta_log``.

A sink commits one Delta version per micro-batch and keeps its log for the maintenance's log
retention (168 h, ``isbflow sink maintain``; the daily DAG), so a sink that commits every 5 s holds
up to ~138,000 log entries (8 days). Each commit is measured as a step makes it
(:func:`isbflow.sinks.delta_commit.commit_batch` with the sink's kept
:class:`~isbflow.local.delta.TableCache`; the task's Parquet written beforehand and not counted),
for a table whose log holds ``N`` entries: its first commit made by the sink, then ``N`` commits
of no files (a ``commitInfo`` each, as a real log's old commits are to a reader that starts at the
checkpoint) and a checkpoint at the last, then ``--batches`` micro-batches timed.

Modes: ``append`` (the raw and errors sinks: written-through files committed as they are) and
``upsert`` (the agg sink: its keys' rows replaced, :mod:`isbflow.sinks.delta_upsert`). ``--active-files``: append points whose
table holds that many more files (what a sink adds between two compactions).

    .venv/bin/python bench/delta_log.py                   # N = 100, 10,000, 50,000, 140,000; 20,000 files
    .venv/bin/python bench/delta_log.py --entries 100,20000 --batches 10 --out /tmp/d.json

Writes ``bench/results/delta_log.json``: per mode and N, the driver CPU ms per commit (median and
mean of the timed batches), wall ms, and the slope (CPU microseconds per log entry).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import _common as cm  # noqa: E402
from deltalake.transaction import AddAction  # noqa: E402

from isbflow.local.delta import TableCache, load_table  # noqa: E402
from isbflow.sinks.delta_commit import commit_batch  # noqa: E402
from isbflow.sinks.delta_files import DeltaSinkOptions, write_batch_files  # noqa: E402

ROWS = 500  # a micro-batch of the demo at 100 events/s and a 5 s budget
KEYS = 20  # the upsert sink's keys touched per batch (windows x services)


def batch(mode: str, b: int) -> pa.Table:
    first = b * ROWS + 1
    seqs = list(range(first, first + ROWS))
    t = {"_isb_id": [f"in/0/{s}" for s in seqs], "v": pa.array(seqs, pa.int64()),
         "service": [f"svc-{s % KEYS}" for s in seqs]}
    if mode == "upsert":  # one row per key, as the update step emits them
        t = {"service": [f"svc-{k}" for k in range(KEYS)], "v": pa.array([b] * KEYS, pa.int64())}
    return pa.table(t)


def options(path: Path, mode: str) -> DeltaSinkOptions:
    o = {"path": str(path), "appId": f"bench/{mode}"}
    if mode == "upsert":
        o.update(mode="upsert", mergeKey="service")
    return DeltaSinkOptions.from_options(o)


def pad(path: Path, entries: int) -> None:
    """Commits of no files up to version ``entries`` - 1, then a checkpoint there."""
    log_dir = path / "_delta_log"
    first = load_table(str(path)).version() + 1
    info = json.dumps({"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "WRITE",
                                      "operationParameters": {"mode": "Append"}}}) + "\n"
    for v in range(first, entries):
        (log_dir / f"{v:020d}.json").write_text(info)
    load_table(str(path)).create_checkpoint()


def add_files(path: Path, files: int, per_commit: int = 500) -> None:
    """``files`` more files in the table (add actions of new names, in commits of ``per_commit``, then
    a checkpoint): the files a sink adds between two compactions. Nothing reads them: an append's
    commit never opens the table's files."""
    table = load_table(str(path))
    size = table.get_add_actions(flatten=True).column("size_bytes")[0].as_py()
    now = int(time.time() * 1000)
    for k in range(files // per_commit):
        table.create_write_transaction([AddAction(f"padding-{k}-{i}.parquet", size, {}, now, True, "{}")
                                        for i in range(per_commit)], "append", table.schema())
    load_table(str(path)).create_checkpoint()


def measure(work: Path, mode: str, entries: int, batches: int, files: int = 0) -> dict:
    path = work / f"{mode}-{entries}-{files}"
    shutil.rmtree(path, ignore_errors=True)
    opts = options(path, mode)
    commit_batch(opts, [write_batch_files(opts, batch(mode, 0).to_batches(), 0, 0)], 0)
    if files:
        add_files(path, files)
    pad(path, entries)
    tables = TableCache(str(path))
    cpu, wall = [], []
    for b in range(1, batches + 3):
        msg = write_batch_files(opts, batch(mode, b).to_batches(), b, 0)  # the task's part
        c0, w0 = time.process_time(), time.perf_counter()
        done = commit_batch(opts, [msg], b, tables)
        c1, w1 = time.process_time(), time.perf_counter()
        if done.version is None:
            raise RuntimeError(f"{mode} batch {b} did not commit: {done.skipped_reason}")
        if b > 2:  # the first two load the table and warm up
            cpu.append(1000 * (c1 - c0))
            wall.append(1000 * (w1 - w0))
    listed = len(os.listdir(path / "_delta_log"))
    shutil.rmtree(path, ignore_errors=True)
    return {"mode": mode, "entries": entries, "active_files": files, "log_files": listed, "batches": len(cpu),
            "cpu_ms_median": round(statistics.median(cpu), 2), "cpu_ms_mean": round(statistics.mean(cpu), 2),
            "wall_ms_median": round(statistics.median(wall), 2)}


def slope(points: list[dict]) -> float | None:
    """CPU microseconds per log entry, least squares over the points of one mode."""
    if len(points) < 2:
        return None
    xs = [p["log_files"] for p in points]
    ys = [p["cpu_ms_median"] for p in points]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return round(1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den, 3) if den else None


def print_table(r: dict) -> None:
    print(f"\n  {'mode':7} {'log entries':>12} {'more files':>11} {'CPU ms/commit':>14} {'mean':>8} {'wall ms':>8}")
    for p in r["points"]:
        print(f"  {p['mode']:7} {p['log_files']:>12,} {p['active_files']:>11,} {p['cpu_ms_median']:>14} "
              f"{p['cpu_ms_mean']:>8} {p['wall_ms_median']:>8}")
    for mode, s in r["us_per_entry"].items():
        print(f"  {mode}: {s} us of CPU per log entry per commit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", default="100,10000,50000,140000",
                    help="log entries before the timed commits, comma-separated")
    ap.add_argument("--modes", default="append,upsert")
    ap.add_argument("--active-files", default="20000",
                    help="append only: points with this many more files in the table (comma-separated; "
                         "a log of 100 entries): the files a sink adds between compactions")
    ap.add_argument("--batches", type=int, default=100,
                    help="timed commits per point (100: the mean holds one checkpoint, as a sink's run does)")
    ap.add_argument("--out", default=str(BENCH / "results" / "delta_log.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="isbflow-bench-deltalog-"))
    points = []
    try:
        measure(work, "append", 10, 5)  # the process's first commits (imports, first calls): not reported
        for mode in args.modes.split(","):
            for n in (int(x) for x in args.entries.split(",")):
                cm.log(f"{mode}: {n:,} log entries")
                points.append(measure(work, mode, n, args.batches))
                cm.log(f"  {points[-1]['cpu_ms_median']} CPU ms a commit (median; mean {points[-1]['cpu_ms_mean']})")
            for f in (int(x) for x in args.active_files.split(",") if x.strip() and mode == "append"):
                cm.log(f"{mode}: {f:,} more files in the table")
                points.append(measure(work, mode, 100, args.batches, files=f))
                cm.log(f"  {points[-1]['cpu_ms_median']} CPU ms a commit (median; mean {points[-1]['cpu_ms_mean']})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {"machine": cm.machine(), "command": " ".join(sys.argv), "rows_per_batch": ROWS,
              "points": points,
              "us_per_entry": {m: slope([p for p in points if p["mode"] == m and not p["active_files"]])
                               for m in args.modes.split(",")}}
    cm.write_result(result, args.out, print_table)


if __name__ == "__main__":
    main()
