"""What the benchmarks share: the demo records, an in-memory source, machine facts, RSS, metrics.

Contract:

- :func:`records` ``(start, end)`` is pure: row ``i`` is the demo event
  ``log_event(SEED, i % BASE_ROWS)`` (:mod:`isbflow.ops.produce`) with
  ``_isb_id = "in/0/<i + 1>"``, as Arrow in :data:`RECORD_ARROW` (the schema of
  the demo's parse step output). Every measurement reading "the records" reads
  exactly these rows, whether from frames, JSON files or memory.
- ``format("isb-bench-memory")`` (:class:`BenchMemorySource`, options ``rows``,
  ``batchRows``, ``partitions``) streams those rows as Arrow batches built in
  the Python workers: the engine's ceiling (no broker, no parsing).
- :class:`RssSampler` samples, every ``interval`` seconds, the resident memory
  of the bench process plus the Spark driver JVM and all its descendants (the
  Python daemon and workers), and keeps the peak per labelled phase.
- :func:`progress_rates` turns a query's ``recentProgress`` into whole-run and
  steady-state (batches >= 1) figures.

This file is imported by Spark's Python workers (the memory source), so the
module level imports only pyarrow and the standard library.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

SEED = 7
BASE_ROWS = 10_000
#: The demo parse step's output (pipelines/logs.yaml source schema + _isb_id).
RECORD_FIELDS = (("ts", "TIMESTAMP"), ("service", "STRING"), ("level", "STRING"), ("host", "STRING"),
                 ("latency_ms", "DOUBLE"), ("status", "INT"), ("msg", "STRING"))
#: the benchmarks' ISB service: embedded, file storage, unlimited buffers (one YAML document and
#: its separator, to put before a pipeline's)
ISB_SERVICE_YAML = """apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata:
  name: default
spec:
  jetstream:
    url: embedded
    replicas: 1
    persistence: true
    settings:
      max_payload: 8MiB
    bufferConfig:
      stream:
        retention: Limits
        maxMsgs: -1
        maxBytes: -1
        maxAge: 72h
        storage: file
        replicas: 1
        duplicates: 2m
---
"""
SOURCE_DDL = ", ".join(f"{n} {t}" for n, t in RECORD_FIELDS)
RECORD_DDL = SOURCE_DDL + ", _isb_id STRING"
RECORD_ARROW = pa.schema([
    pa.field("ts", pa.timestamp("us", tz="UTC")), pa.field("service", pa.string()),
    pa.field("level", pa.string()), pa.field("host", pa.string()),
    pa.field("latency_ms", pa.float64()), pa.field("status", pa.int32()),
    pa.field("msg", pa.string()), pa.field("_isb_id", pa.string()),
])


def record_struct():
    """:data:`RECORD_ARROW` as a Spark StructType (no session needed)."""
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(RECORD_ARROW)


@lru_cache(maxsize=1)
def _base() -> tuple[pa.Table, list[str]]:
    """The BASE_ROWS distinct events as Arrow (no id) and as JSON-object prefixes (no closing brace)."""
    from isbflow.ops.produce import log_event, payload

    evs = [log_event(SEED, i) for i in range(BASE_ROWS)]
    cols = {n: [e[n] for e in evs] for n, _ in RECORD_FIELDS}
    table = pa.table({
        "ts": pa.array(cols["ts"], pa.string()).cast(pa.timestamp("us", "UTC")),
        "service": pa.array(cols["service"], pa.string()),
        "level": pa.array(cols["level"], pa.string()),
        "host": pa.array(cols["host"], pa.string()),
        "latency_ms": pa.array(cols["latency_ms"], pa.float64()),
        "status": pa.array(cols["status"], pa.int32()),
        "msg": pa.array(cols["msg"], pa.string()),
    })
    prefixes = [payload(SEED, i).decode()[:-1] for i in range(BASE_ROWS)]
    return table, prefixes


def records(start: int, end: int) -> pa.Table:
    """Rows ``start <= i < end`` (see the module docstring)."""
    import numpy as np

    base, _ = _base()
    pieces, i = [], start
    while i < end:  # zero-copy slices of the base, then one contiguous copy
        off = i % BASE_ROWS
        n = min(BASE_ROWS - off, end - i)
        pieces.append(base.slice(off, n))
        i += n
    rows = pa.concat_tables(pieces).combine_chunks() if pieces else base.slice(0, 0)
    ids = pc.binary_join_element_wise("in/0/", pa.array(np.arange(start + 1, end + 1)).cast(pa.string()), "")
    return rows.append_column(RECORD_ARROW.field("_isb_id"), ids).cast(RECORD_ARROW)


def write_json_lines(directory: Path, total: int, files: int) -> list[Path]:
    """The same rows as JSON lines, ``files`` files of consecutive rows (for Spark's JSON source)."""
    _, prefixes = _base()
    directory.mkdir(parents=True, exist_ok=True)
    per = -(-total // files)
    out = []
    for f in range(files):
        lo, hi = f * per, min(total, (f + 1) * per)
        if lo >= hi:
            break
        path = directory / f"part-{f:05d}.json"
        with open(path, "w") as fh:
            fh.write("".join(f'{prefixes[i % BASE_ROWS]},"_isb_id":"in/0/{i + 1}"}}\n' for i in range(lo, hi)))
        out.append(path)
    return out


# ------------------------------------------------------------------ the in-memory source

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition  # noqa: E402
from pyspark.sql.streaming.datasource import (  # noqa: E402
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)


@dataclass
class _Rows(InputPartition):
    start: int
    end: int


class _MemoryReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: dict[str, str]):
        self.rows = int(options.get("rows", 1000))
        self.batch_rows = int(options["batchRows"]) if options.get("batchRows") else None
        self.parts = max(1, int(options.get("partitions", 2)))

    def initialOffset(self) -> dict:
        return {"row": 0}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.batch_rows) if self.batch_rows else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        pass

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        end = self.rows
        if isinstance(limit, ReadMaxRows):
            end = min(end, start["row"] + limit.max_rows)
        return {"row": max(start["row"], end)}

    def partitions(self, start: dict, end: dict) -> list[_Rows]:
        lo, hi = start["row"], end["row"]
        step = -(-(hi - lo) // self.parts) if hi > lo else 1
        return [_Rows(s, min(s + step, hi)) for s in range(lo, hi, step)]

    def read(self, partition: _Rows) -> Iterator[pa.RecordBatch]:
        for s in range(partition.start, partition.end, 65536):
            yield from records(s, min(s + 65536, partition.end)).to_batches()

    def commit(self, end: dict) -> None:
        pass


class BenchMemorySource(DataSource):
    """``spark.readStream.format("isb-bench-memory")``: :func:`records` as a stream."""

    @classmethod
    def name(cls) -> str:
        return "isb-bench-memory"

    def schema(self):
        return record_struct()

    def streamReader(self, schema) -> _MemoryReader:
        return _MemoryReader(self.options)


# ------------------------------------------------------------------ machine and memory


def machine() -> dict:
    """Cores, memory and versions of what is measured."""
    import platform
    import subprocess
    import sys
    from importlib.metadata import version

    mem = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("MemTotal", "MemAvailable"):
            mem[k] = int(v.split()[0]) * 1024
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    from isbflow.isb.server import nats_server_binary

    nats_v = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True).stdout.strip()
    java_v = subprocess.run(["java", "-version"], capture_output=True, text=True).stderr.splitlines()[:1]
    return {
        "cores": os.cpu_count(), "cpu": cpu, "memory_bytes": mem.get("MemTotal"),
        "memory_available_bytes": mem.get("MemAvailable"), "platform": platform.platform(),
        "python": sys.version.split()[0], "pyspark": version("pyspark"), "deltalake": version("deltalake"),
        "pyarrow": version("pyarrow"), "nats-py": version("nats-py"), "nats-server": nats_v,
        "java": java_v[0] if java_v else None,
    }


def status_bytes(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return 0


def _cmd(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in argv if a)[-120:]


def descendants(root: int) -> list[int]:
    """``root`` and every process below it (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        out.append(p)
        kids = children.get(p, [])
        if kids and (exe := _exe(p)) and os.path.basename(exe) == "java":
            # A child of the JVM running the JVM's own binary is a fork that has not yet run its
            # exec (Hadoop runs chmod as a process for every file it writes): until then /proc shows
            # the JVM's whole memory under the child's pid too. Counting it doubled the JVM in a
            # sample (measured: a 1.29 GB "process" beside a 1.29 GB JVM in a throughput peak).
            kids = [k for k in kids if _exe(k) != exe]
        todo.extend(kids)
    return out


def _exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def tree_memory(pids: list[int]) -> dict[str, int]:
    """RSS and PSS summed over ``pids`` (e.g. :func:`descendants` of a driver)."""
    return {"rss_bytes": sum(status_bytes(p, "VmRSS") for p in pids), "pss_bytes": sum(pss_bytes(p) for p in pids)}


class RssSampler:
    """Samples RSS (and PSS) of the bench process + the JVM tree every ``interval`` s, in a thread."""

    def __init__(self, jvm_pid: int, interval: float = 0.5):
        self.jvm_pid, self.interval = jvm_pid, interval
        self.phase = "setup"
        self.peaks: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> dict:
        tree = descendants(self.jvm_pid)
        pids = [os.getpid(), *tree]
        rss = {p: status_bytes(p, "VmRSS") for p in pids}
        return {"rss_bytes": sum(rss.values()), "pss_bytes": sum(pss_bytes(p) for p in pids), "by_process": rss,
                "bench_rss_bytes": rss[os.getpid()], "jvm_rss_bytes": rss.get(self.jvm_pid, 0),
                "python_workers_rss_bytes": sum(v for p, v in rss.items() if p not in (os.getpid(), self.jvm_pid)),
                "processes": len(pids)}

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.sample()
            for key in (self.phase, "all"):
                peak = self.peaks.get(key)
                if peak is None or s["rss_bytes"] > peak["rss_bytes"]:
                    self.peaks[key] = s
            if self.peaks["all"] is s:  # a new overall peak: name its processes
                s["by_process"] = {f"{p} {_cmd(p)}": v for p, v in s["by_process"].items()}
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------------ metrics


def progress_rates(progress: list[dict], records: int, seconds: float) -> dict:
    """Whole run (``records / seconds``) and steady state (batches >= 1, from Spark's progress)."""
    batches = sorted({p["batchId"]: p for p in progress}.values(), key=lambda p: p["batchId"])
    steady = [p for p in batches if p["batchId"] >= 1]
    rows = sum(p["numInputRows"] for p in steady)
    ms = sum(p["durationMs"].get("triggerExecution", 0) for p in steady)
    stages: dict[str, int] = {}
    for p in steady:
        for k, v in p["durationMs"].items():
            stages[k] = stages.get(k, 0) + v
    return {
        "records": records,
        "seconds": round(seconds, 3),
        "records_per_s": round(records / seconds, 1) if seconds > 0 else None,
        "steady_records_per_s": round(rows * 1000 / ms, 1) if ms > 0 and rows else None,
        "steady_records": rows,
        "steady_seconds": round(ms / 1000, 3),
        "batches": [{"id": p["batchId"], "rows": p["numInputRows"],
                     "ms": p["durationMs"].get("triggerExecution"),
                     "addBatch_ms": p["durationMs"].get("addBatch"),
                     "latestOffset_ms": p["durationMs"].get("latestOffset")} for p in batches],
        "steady_stage_ms": stages,
    }


def percentile(sorted_values, q: float) -> float | None:
    """``q`` in [0, 1] of an already sorted sequence (nearest rank)."""
    n = len(sorted_values)
    if not n:
        return None
    return float(sorted_values[min(n - 1, max(0, int(round(q * n + 0.5)) - 1))])


def delta_commits(table: str) -> list[dict]:
    """Each commit of a Delta table: version, file mtime (when it became visible), commitInfo
    timestamp, and its added files."""
    log_dir = Path(table) / "_delta_log"
    out = []
    for f in sorted(log_dir.glob("*.json")):
        adds, ts = [], None
        for line in f.read_text().splitlines():
            action = json.loads(line)
            if "add" in action:
                adds.append(action["add"]["path"])
            elif "commitInfo" in action:
                ts = action["commitInfo"].get("timestamp")
        out.append({"version": int(f.stem), "visible_s": f.stat().st_mtime,
                    "commit_ts_s": ts / 1000 if ts else None, "adds": adds})
    return out


def sink_rows(table: str) -> int:
    """Rows in a Delta table (from the add actions' statistics)."""
    from isbflow.local.delta import load_table  # lazy: delta-rs loads a native library

    try:
        dt = load_table(table)
    except Exception:  # no table (nothing committed)
        return 0
    return int(pc.sum(pa.table(dt.get_add_actions(flatten=True)).column("num_records")).as_py() or 0)


def raw_sink_check(table: str, expected: set[str]) -> dict:
    """Whether a raw sink holds exactly ``expected`` ``_isb_id`` s, none twice (the recovery tests'
    ``assert_raw_exact``, as figures): rows, expected, duplicates, missing, unexpected, exact."""
    from isbflow.local.delta import load_table  # lazy: delta-rs loads a native library

    ids = load_table(table).to_pyarrow_table(columns=["_isb_id"]).column("_isb_id").to_pylist()
    seen = set(ids)
    out = {"rows": len(ids), "expected": len(expected), "duplicates": len(ids) - len(seen),
           "missing": len(expected - seen), "unexpected": len(seen - expected),
           "missing_examples": sorted(expected - seen)[:5], "unexpected_examples": sorted(seen - expected)[:5]}
    out["exact"] = out["duplicates"] == out["missing"] == out["unexpected"] == 0
    return out


def undo_all(steps) -> None:
    """Run each ``(what, undo)`` clean-up in order (``undo`` falsy: nothing to undo), each whatever
    the one before it raised; a failure is logged naming ``what``."""
    for what, undo in steps:
        try:
            if undo:
                undo()
        except Exception as e:  # noqa: BLE001 - go on to the next
            log(f"stopping the {what}: {e!r}")


def log(msg: str) -> None:
    """A timestamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stop_on_sigterm() -> None:
    """SIGTERM (``kill``, a CI timeout) ends a bench as Ctrl-C does: its ``finally`` blocks stop the
    driver, producer, nats-server and Spark it started. The default action ended the bench alone and
    left them running (seen: ``kill`` of ``cost.py`` orphaned its driver and nats-server)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def write_result(result: dict, out: str | Path, print_table) -> None:
    """Add the command line to ``result``, write it as JSON to ``out``, print its table."""
    result["command"] = " ".join([Path(sys.executable).name, *sys.argv])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print_table(result)
    print(f"wrote {out}")


def now() -> float:
    return time.perf_counter()
