"""Is a process we started still running: one answer for the whole package.

A PID alone is not an identity: after a crash or a reboot another process can
hold it. Callers that recorded a process's start time (``process_start``)
pass it to :func:`process_alive`, which then answers for that process only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _proc_stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state letter, start time in clock ticks, process group) from /proc, or None when there is no
    such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[19]), int(fields[2])


def group_members(pgid: int, since: int | None = None) -> list[int]:
    """The live processes of process group ``pgid`` (from /proc; empty without it) that started at
    or after ``since`` (clock ticks since boot): with the start of the group's leader as recorded,
    a group that took the same number after the leader's had ended (its members started before
    the record could not be the record's, and a new group's leader would not match) is told apart."""
    out = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
        if entry.name.isdigit() and (stat := _proc_stat(entry.name)) is not None:
            state, start, group = stat
            if group == pgid and state != "Z" and (since is None or start >= since):
                out.append(int(entry.name))
    return out


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (None: no such process, or no /proc)."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def process_alive(pid: int, proc_start: int | None = None) -> bool:
    """The process exists, is not a zombie, and (when known) started at ``proc_start``."""
    if pid <= 0:
        return False
    if not Path("/proc/self/stat").exists():  # not Linux: existence only
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    stat = _proc_stat(pid)
    if stat is None:
        return False
    state, start, _ = stat
    if state == "Z":
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        return False
    return proc_start is None or start == proc_start
