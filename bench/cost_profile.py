"""Where a micro-batch's time goes (issue #15 item 2), for ``bench/cost.py --profile``.

- :func:`progress_conf_dir` writes a Spark conf dir whose ``log4j2.properties`` logs the streaming
  package at INFO (WARN elsewhere): the driver's log then holds every query's progress JSON
  (``Streaming query made progress: {...}``) with Spark's ``durationMs`` per phase. Used only by
  the profile run (logging that much costs CPU itself: the cost windows run without it).
- :func:`progress_from_log` reads those reports back; :func:`phase_means` averages each phase
  over the batches that ran (``addBatch`` present) per query.
- :func:`pyspy_top` samples processes with ``py-spy record --format raw`` for some seconds and
  names the functions seen most (inclusive: every frame of a sampled stack counts once), per kind
  of process (the command line's module, e.g. ``python_streaming_source_runner``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from datetime import datetime
from pathlib import Path

LOG4J = """rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
logger.streaming.name = org.apache.spark.sql.execution.streaming
logger.streaming.level = info
"""
MARK = "Streaming query made progress: "
PHASES = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "triggerExecution")


def progress_conf_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="isbflow-bench-sparkconf-"))
    (d / "log4j2.properties").write_text(LOG4J)
    return d


def progress_from_log(path: str | Path, t0: float, t1: float) -> list[dict]:
    """Every progress report in the driver's log whose ``timestamp`` (the trigger's start) is in [t0, t1]."""
    text = Path(path).read_text(errors="replace")
    dec = json.JSONDecoder()
    out = []
    for m in re.finditer(re.escape(MARK), text):
        try:
            prog, _ = dec.raw_decode(text, m.end())
        except ValueError:
            continue
        ts = datetime.fromisoformat(prog["timestamp"].replace("Z", "+00:00")).timestamp()
        if t0 <= ts <= t1:
            out.append(prog)
    return out


def phase_means(progress: list[dict]) -> dict:
    """Per query (its name) and over all: batches that ran, mean ms per phase, mean input rows."""
    per: dict[str, list[dict]] = {}
    for p in progress:
        if "addBatch" in (p.get("durationMs") or {}):
            per.setdefault(p.get("name") or p["id"], []).append(p)
    out = {}
    every = [p for ps in per.values() for p in ps]
    for name, ps in [*sorted(per.items()), ("all", every)]:
        if ps:
            out[name] = {"batches": len(ps), "rows_mean": round(sum(p["numInputRows"] for p in ps) / len(ps), 1),
                         **{k: round(sum(p["durationMs"].get(k, 0) for p in ps) / len(ps), 1) for k in PHASES}}
    return out


def process_kind(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "gone"
    args = [a.decode(errors="replace") for a in argv if a]
    if args and args[0].endswith("java"):
        return "jvm"
    if "isbflow.steps.zygote_server" in args:  # the zygote, or a child it forked (named for its module)
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            return "gone"
        return {"isbflow-source": "source runners", "isbflow-daemon": "daemons and workers"}.get(comm, "zygote")
    if any(a.endswith("launch.py") for a in args):
        return "launchers"
    if "-m" in args:
        i = args.index("-m")
        return " ".join(args[i + 1:i + 3]).replace("pyspark.", "")
    return "driver python" if any("isbflow" in a for a in args) else Path(args[0]).name if args else "?"


#: JVM threads by what they do, from their ``comm`` (Linux keeps a thread name's first 15 bytes)
JVM_THREADS = (("C2 CompilerThre", "jit"), ("C1 CompilerThre", "jit"), ("VM Thread", "gc and safepoints"),
               ("stream executio", "stream threads"), ("Executor task", "tasks"),
               ("dag-scheduler-e", "scheduler"), ("task-result-get", "scheduler"),
               ("spark-listener-", "listener bus"), ("element-trackin", "listener bus"),
               ("Thread-", "py4j calls"), ("broadcast-excha", "broadcast"),
               ("dispatcher-", "rpc"), ("rpc-", "rpc"), ("netty-", "rpc"), ("shuffle-", "rpc"))


def thread_group(comm: str) -> str:
    return next((group for prefix, group in JVM_THREADS if comm.startswith(prefix)), "other threads")


def cpu_snapshot(pids: list[int], driver: int | None = None) -> dict:
    """For :func:`cpu_split`: each process's kind and CPU seconds (its own and its reaped children's),
    and each thread's of the JVM, from ``/proc``; ``driver``: the pid that is the driver's Python
    (the floors' driver is the bench's child process)."""
    tick = os.sysconf("SC_CLK_TCK")

    def stat_cpu(path: str) -> tuple[str, float, float] | None:
        try:
            stat = Path(path).read_text()
        except OSError:
            return None
        f = stat[stat.rfind(")") + 2:].split()
        return stat[stat.find("(") + 1:stat.rfind(")")], (int(f[11]) + int(f[12])) / tick, (int(f[13]) + int(f[14])) / tick

    procs, threads = {}, {}
    for pid in pids:
        st = stat_cpu(f"/proc/{pid}/stat")
        if st is None:
            continue
        kind = "driver python" if pid == driver else process_kind(pid)
        procs[pid] = (kind, st[1] + st[2])
        if kind == "jvm":
            for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
                t = stat_cpu(f"/proc/{pid}/task/{tid}/stat")
                if t is not None:
                    threads[int(tid)] = (thread_group(t[0]), t[1])
    return {"procs": procs, "threads": threads}


def cpu_split(before: dict, after: dict, batches: int, less: dict[str, float] | None = None) -> dict:
    """CPU ms per micro-batch between two :func:`cpu_snapshot`: by kind of process (alive at the end; a
    process that started in between counts whole), and the JVM's by kind of thread. A thread that
    ended in between (Spark's task threads end with their tasks) is in ``ended threads``: the JVM's
    growth less its live threads'. ``less``: CPU seconds of a kind that were not the work measured
    (the bench's own sampler in the floors' driver)."""
    per = max(1, batches) / 1000.0
    kinds: dict[str, float] = {}
    for pid, (kind, cpu) in after["procs"].items():
        kinds[kind] = kinds.get(kind, 0.0) + cpu - before["procs"].get(pid, (kind, 0.0))[1]
    for kind, cpu in (less or {}).items():
        kinds[kind] = kinds.get(kind, 0.0) - cpu
    groups: dict[str, float] = {}
    for tid, (group, cpu) in after["threads"].items():
        groups[group] = groups.get(group, 0.0) + cpu - before["threads"].get(tid, (group, 0.0))[1]
    jvm = kinds.get("jvm", 0.0)
    groups["ended threads"] = max(0.0, jvm - sum(groups.values()))
    return {"process_ms_per_batch": {k: round(v / per, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "jvm_ms_per_batch": {k: round(v / per, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}}


def pyspy_top(pids: list[int], seconds: float, top: int = 12) -> dict:
    """py-spy each Python process of ``pids`` for ``seconds`` (in parallel); per process kind: processes,
    samples seen (non-idle), and the ``top`` functions by inclusive share of those samples."""
    exe = shutil.which("py-spy") or str(Path(__file__).resolve().parents[1] / ".venv" / "bin" / "py-spy")
    if not Path(exe).exists():
        return {"error": "py-spy not installed (uv pip install py-spy)"}
    kinds = {p: process_kind(p) for p in pids}
    procs = {}
    tmp = Path(tempfile.mkdtemp(prefix="isbflow-bench-pyspy-"))
    for p, kind in kinds.items():
        if kind in ("jvm", "gone", "?"):
            continue
        procs[p] = (subprocess.Popen([exe, "record", "-p", str(p), "-d", str(int(seconds)), "-r", "50", "--nonblocking",
                                      "-f", "raw", "-o", str(tmp / f"{p}.txt")], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL), kind)
    out: dict[str, dict] = {}
    for p, (proc, kind) in procs.items():
        try:
            proc.wait(seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
        k = out.setdefault(kind, {"processes": 0, "samples": 0, "functions": Counter()})
        k["processes"] += 1
        f = tmp / f"{p}.txt"
        for line in (f.read_text().splitlines() if f.exists() else []):
            stack, _, n = line.rpartition(" ")
            if not n.isdigit():
                continue
            k["samples"] += int(n)
            for frame in set(stack.split(";")[1:]):  # the first is the thread
                k["functions"][re.sub(r":\d+\)$", ")", frame)] += int(n)
    shutil.rmtree(tmp, ignore_errors=True)
    for k in out.values():
        k["top"] = [{"function": fn, "share": round(c / k["samples"], 3)}
                    for fn, c in k.pop("functions").most_common(top)] if k["samples"] else []
        k["seconds_sampled_at_50hz"] = round(k["samples"] / 50, 1)
    return out
