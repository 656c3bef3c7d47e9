"""Is a process we started still running: one answer for the whole package.

A PID alone is not an identity: after a crash or a reboot another process can
hold it. Callers that recorded a process's start time (``process_start``)
pass it to :func:`process_alive`, which then answers for that process only.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) from /proc, or None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[19])


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
    state, start = stat
    if state == "Z":
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)  # our own child: reap it
        return False
    return proc_start is None or start == proc_start
