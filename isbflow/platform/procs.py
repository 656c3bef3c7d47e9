"""The platform's processes as the kernel shows them: process groups, sessions, marked processes, memory, stopping.

Everything here reads ``/proc`` (Linux). Each process the platform starts leads its own
session and process group, and carries ``ISBFLOW_PLATFORM=<id of this start>``
(:data:`MARKER_ENV`) in its environment, which the processes it starts inherit.

Contract for signalling: a *recorded* process (anything with ``pid`` and ``proc_start``, the
kernel start time from field 22 of ``/proc/<pid>/stat``) is signalled, its whole group, only
while its PID has not been reused (:func:`reused`): when the live process at that PID started
at another time than recorded, it is someone else's and is left alone. A record without a
start time is trusted by PID alone. A group whose leader has exited is still ours (the
kernel gives no new process a PID still in use as a process group or session id), so its
members are stopped. PIDs found live just now (:func:`marked_processes`,
:func:`session_processes`) are signalled as found.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

from isbflow.ops.processes import process_alive, process_start

#: the environment variable marking every process of one platform start (value: the start's id)
MARKER_ENV = "ISBFLOW_PLATFORM"
CLK_TCK = os.sysconf("SC_CLK_TCK")


class Recorded(Protocol):
    """A process as recorded when it was started: its PID and kernel start time (None: unknown)."""

    pid: int
    proc_start: int | None


def proc_pids() -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()]


def stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name: state, ppid, pgrp, session, ... (None: gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None


def reused(pid: int, proc_start: int | None) -> bool:
    """True when ``pid`` now names another process than the one recorded with ``proc_start``.

    False when no start time was recorded (trust the PID), or no process has that PID now.
    """
    if proc_start is None:
        return False
    start = process_start(pid)
    return start is not None and start != proc_start


def group_members(pgid: int) -> list[int]:
    """PIDs of the live (non-zombie) processes in process group ``pgid``."""
    out = []
    for pid in proc_pids():
        fields = stat_fields(pid)
        if fields is not None and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(pid)
    return out


def group_memory(pgid: int) -> int:
    """Memory of a process group in bytes: the sum of its processes' PSS.

    PSS splits pages shared by forked workers among them, so the sum is what the
    group really costs (RSS would count the shared pages once per worker).
    """
    total = 0
    for pid in group_members(pgid):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            continue
    return total


def group_cpu_seconds(pgid: int) -> float:
    """CPU-seconds a process group has used: its live members' user and system time, plus what
    their reaped children used (a driver's finished Python workers)."""
    ticks = 0
    for pid in group_members(pgid):
        fields = stat_fields(pid)
        if fields is not None:
            ticks += sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return ticks / CLK_TCK


def groups_cpu_percent(pgids: list[int], interval: float = 0.5) -> dict[int, float]:
    """Each group's CPU over the next ``interval`` seconds, in percent of one core (two cores busy: 200)."""
    before = {g: group_cpu_seconds(g) for g in pgids}
    t0 = time.monotonic()
    time.sleep(interval)
    after = {g: group_cpu_seconds(g) for g in pgids}
    wall = time.monotonic() - t0
    # a member exiting between the samples takes its time with it: never below zero
    return {g: round(max(0.0, after[g] - before[g]) / wall * 100, 1) for g in pgids}


def marked_processes(marker: str) -> list[int]:
    """PIDs of the live processes whose environment carries ``ISBFLOW_PLATFORM=<marker>`` (not this one).

    Processes that rewrite their title (Airflow's api-server, executors and task runners use
    setproctitle, which overwrites the environment block) are not found this way:
    :func:`session_processes` finds them by session.
    """
    if not marker:
        return []
    needle = f"{MARKER_ENV}={marker}".encode()
    out = []
    for pid in proc_pids():
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and process_alive(pid):
            out.append(pid)
    return out


def session_processes(roots: Iterable[int], marker: str) -> list[int]:
    """Every live process (but this one) in a session that one of ``roots`` leads, or that a
    process marked with ``marker`` belongs to, and the marked processes themselves."""
    sessions = set(roots)
    marked = set(marked_processes(marker))
    for pid in marked:
        f = stat_fields(pid)
        if f is not None:
            sessions.add(int(f[3]))
    out = []
    for pid in proc_pids():
        f = stat_fields(pid)
        if f is None or f[0] == "Z" or pid == os.getpid():
            continue
        if int(f[3]) in sessions or pid in marked:
            out.append(pid)
    return sorted(out)


def reap(pid: int) -> None:
    """Collect our own exited child, or it lingers as a zombie."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def group_alive(pgid: int) -> bool:
    return process_alive(pgid) or bool(group_members(pgid))


def stop_groups(procs: Sequence[Recorded], grace: float) -> None:
    """SIGTERM the process groups ``procs`` lead, all at once; SIGKILL what is left after ``grace`` s.

    A record whose PID now names another process (:func:`reused`) is skipped, checked before
    each signal.
    """
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        live = []
        for proc in procs:
            if reused(proc.pid, proc.proc_start):
                continue
            try:
                os.killpg(proc.pid, sig)
                live.append(proc)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            for proc in live:
                reap(proc.pid)
            live = [p for p in live if group_alive(p.pid) and not reused(p.pid, p.proc_start)]
            time.sleep(0.2)
        if not live:
            return


def kill_pids(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM each PID found live just now (its whole group when it leads one), then SIGKILL what
    is left after ``grace``."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid and pid != os.getpgid(0):
                    os.killpg(pid, sig)
                else:
                    os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            for pid in pids:
                reap(pid)
            pids = [p for p in pids if process_alive(p)]
            if not pids:
                return
            time.sleep(0.2)
