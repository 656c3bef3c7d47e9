"""Where a command's CPU goes, by kind of process: ``python bench/procwatch.py OUT -- cmd ...``.

Runs ``cmd``, samples every process that starts on the host while it runs (every
``--every`` seconds, default 0.1; a process that lives shorter than that may be missed),
and writes one line per kind to ``OUT``: how many processes, their CPU seconds, the kind
(``py -m <module>`` for Python modules, the executable otherwise). A forked child keeps
its parent's command line, so it is counted under its parent's kind. It watches the whole
machine: run it with nothing else running. Exits with the command's exit code.

    python bench/procwatch.py /tmp/routing.txt -- .venv/bin/python -m pytest -q tests/steps/test_routing.py
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import time

import psutil


def kind(cmdline: list[str]) -> str:
    if not cmdline:
        return "?"
    exe = cmdline[0].rsplit("/", 1)[-1]
    if exe.startswith("python") or exe in ("isbflow", "airflow"):
        if "-m" in cmdline:
            i = cmdline.index("-m")
            return "py -m " + " ".join(cmdline[i + 1:i + 3])
        return "py " + " ".join(c.rsplit("/", 1)[-1] for c in cmdline[1:4])
    return exe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--every", type=float, default=0.1)
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    t0 = time.time()
    proc = subprocess.Popen(cmd)
    seen: dict[tuple[int, float], list] = {}
    while proc.poll() is None:
        for q in psutil.process_iter(["pid", "create_time", "cmdline"]):
            if q.info["create_time"] < t0 - 0.5:
                continue
            try:
                t = q.cpu_times()
            except psutil.Error:
                continue
            key = (q.info["pid"], q.info["create_time"])
            if key not in seen:
                seen[key] = [kind(q.info["cmdline"] or []), 0.0]
            seen[key][1] = t.user + t.system
        time.sleep(a.every)
    agg: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for k, cpu in seen.values():
        agg[k][0] += 1
        agg[k][1] += cpu
    with open(a.out, "w") as f:
        for k, (n, cpu) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
            f.write(f"{n:5d} {cpu:8.1f}  {k}\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
