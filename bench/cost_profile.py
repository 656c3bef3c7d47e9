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
    if "-m" in args:
        i = args.index("-m")
        return " ".join(args[i + 1:i + 3]).replace("pyspark.", "")
    return "driver python" if any("isbflow" in a for a in args) else Path(args[0]).name if args else "?"


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
