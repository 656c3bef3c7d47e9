"""Opt-in per-test cost recorder: where the suite's CPU goes.

Enabled by ``ISBFLOW_TEST_CPU=<file.tsv>`` (tests/conftest.py registers it then; off otherwise;
under pytest-xdist each worker writes its own ``<file>.<worker>.tsv``).
For every test phase (setup, call, teardown) one row: the wall seconds, the pytest process's own
CPU seconds, the CPU seconds of its reaped children (``os.times``), the CPU seconds of every
process of the test's process tree seen while it ran (a sampler thread, every 0.5 s: the pytest
process's descendants plus any process whose command line names the run's base temp dir, which
catches detached drivers re-parented to init; a process's CPU is counted from its first sample,
so what a process spends in its last half second before it dies is missed), and how many JVMs,
Airflow processes, nats-servers, Chromium and other Python processes were started in it.

At the end of the session the terminal summary lists the 25 costliest phases by tree CPU and the
totals per test file. Measuring costs ~1-2% of a core (one ``/proc`` scan per 0.5 s).
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from pathlib import Path

import psutil
import pytest

ENV = "ISBFLOW_TEST_CPU"
KINDS = ("jvm", "airflow", "nats", "chromium", "python")


def kind_of(cmdline: list[str]) -> str | None:
    """What a new process is, from its command line (None: not counted, e.g. a shell)."""
    if not cmdline:
        return None
    exe = os.path.basename(cmdline[0])
    text = " ".join(cmdline[:6])
    if exe == "java" or exe.endswith("/java"):
        return "jvm"
    if "nats-server" in exe:
        return "nats"
    if "chrom" in exe:
        return "chromium"
    if "airflow" in text:
        return "airflow"
    if exe.startswith("python") or exe in ("isbflow",) or text.endswith("isbflow"):
        return "python"
    return None


class Sampler(threading.Thread):
    """Polls the process tree; accumulates per-phase tree CPU and process starts."""

    def __init__(self, marker: str, every: float = 0.5):
        super().__init__(name="cpu-recorder", daemon=True)
        self.marker = marker
        self.every = every
        self.me = os.getpid()
        self.lock = threading.Lock()
        self.seen: dict[tuple[int, float], float] = {}  # (pid, create_time) -> last CPU seconds
        self.cpu = 0.0
        self.starts: dict[str, int] = defaultdict(int)
        self.stop_event = threading.Event()

    def take(self) -> tuple[float, dict[str, int]]:
        """What accumulated since the last take (the phase that just ended)."""
        self.sample()
        with self.lock:
            cpu, starts = self.cpu, dict(self.starts)
            self.cpu = 0.0
            self.starts.clear()
        return cpu, starts

    def ours(self) -> list[psutil.Process]:
        procs = {p.pid: p for p in psutil.process_iter(["pid", "ppid", "cmdline", "create_time"])}
        children: dict[int, list[int]] = defaultdict(list)
        roots = {self.me}
        for p in procs.values():
            children[p.info["ppid"]].append(p.pid)
            if self.marker and any(self.marker in a for a in (p.info["cmdline"] or [])):
                roots.add(p.pid)
        out, todo = set(), list(roots)
        while todo:
            pid = todo.pop()
            if pid in out:
                continue
            out.add(pid)
            todo.extend(children.get(pid, ()))
        out.discard(self.me)
        return [procs[p] for p in out if p in procs]

    def sample(self) -> None:
        with self.lock:
            for p in self.ours():
                try:
                    t = p.cpu_times()
                except psutil.Error:
                    continue
                now = t.user + t.system
                key = (p.pid, p.info["create_time"])
                before = self.seen.get(key)
                if before is None:
                    kind = kind_of(p.info["cmdline"] or [])
                    if kind:
                        self.starts[kind] += 1
                    before = 0.0
                self.cpu += max(0.0, now - before)
                self.seen[key] = now

    def run(self) -> None:
        while not self.stop_event.wait(self.every):
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a measuring aid must never fail the suite
                pass


class Recorder:
    def __init__(self, path: Path):
        self.path = path
        self.rows: list[tuple] = []
        self.sampler: Sampler | None = None

    def pytest_sessionstart(self, session):
        marker = str(session.config.option.basetemp or "")
        self.sampler = Sampler(marker)
        self.sampler.start()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:
            f.write("\t".join(["nodeid", "phase", "wall_s", "self_cpu_s", "reaped_cpu_s", "tree_cpu_s", *KINDS])
                    + "\n")

    def measure(self, item, phase: str):
        t0, w0 = os.times(), time.monotonic()
        self.sampler.take()  # what happened between phases belongs to none
        try:
            return (yield)
        finally:
            self.record(item, phase, t0, w0)

    def record(self, item, phase: str, t0, w0: float) -> None:
        t1, wall = os.times(), time.monotonic() - w0
        tree, starts = self.sampler.take()
        own = (t1.user - t0.user) + (t1.system - t0.system)
        reaped = (t1.children_user - t0.children_user) + (t1.children_system - t0.children_system)
        row = (item.nodeid, phase, wall, own, reaped, tree, *(starts.get(k, 0) for k in KINDS))
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write("\t".join(str(round(v, 2)) if isinstance(v, float) else str(v) for v in row) + "\n")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item):
        yield from self.measure(item, "setup")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        yield from self.measure(item, "call")

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item):
        yield from self.measure(item, "teardown")

    def pytest_terminal_summary(self, terminalreporter):
        if self.sampler:
            self.sampler.stop_event.set()
        tr = terminalreporter
        cost = lambda r: r[3] + r[5]  # noqa: E731 - own CPU + tree CPU
        tr.write_sep("=", f"CPU per test phase ({self.path})")
        tr.write_line(f"{'own+tree cpu':>12} {'wall':>7}  " + " ".join(f"{k:>8}" for k in KINDS) + "  test")
        for r in sorted(self.rows, key=cost, reverse=True)[:25]:
            tr.write_line(f"{cost(r):12.1f} {r[2]:7.1f}  " + " ".join(f"{n:8d}" for n in r[6:]) + f"  {r[1]} {r[0]}")
        per_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0, 0])
        for r in self.rows:
            agg = per_file[r[0].split("::")[0]]
            agg[0] += cost(r)
            agg[1] += r[2]
            agg[2] += r[6]
            agg[3] += r[7]
        tr.write_sep("-", "per file: own+tree CPU s, wall s, JVMs, Airflow processes")
        for name, (c, w, j, a) in sorted(per_file.items(), key=lambda kv: kv[1][0], reverse=True):
            tr.write_line(f"{c:9.1f} {w:8.1f} {j:5d} {a:5d}  {name}")
        total = sum(cost(r) for r in self.rows)
        tr.write_line(f"total own+tree CPU {total:.1f} s over {sum(r[2] for r in self.rows):.1f} s of test wall")


def register(config) -> None:
    """Called from tests/conftest.py: registers the recorder when ``ISBFLOW_TEST_CPU`` names a file."""
    path = os.environ.get(ENV)
    if not path or getattr(config.option, "numprocesses", None) and not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # off, or the xdist controller (its workers record, each to its own file)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # <file>.gw0.tsv, <file>.gw1.tsv: one per pytest-xdist worker
        p = Path(path)
        path = str(p.with_name(f"{p.stem}.{worker}{p.suffix}"))
    config.pluginmanager.register(Recorder(Path(path)), "isbflow-cpu-recorder")
