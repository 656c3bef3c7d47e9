"""The scale-to-zero watcher as a detached process, for faces that do not run it in the foreground.

:func:`launch_watcher` starts ``isbflow pipeline scale-to-zero`` for one pipeline in a new
session (no terminal, its own process group), its output in ``<data dir>/logs/zero-<pipeline>.log``,
and returns once the watcher has recorded itself (``<data dir>/zero/<pipeline>.json``, see
:func:`isbflow.ops.zero.watcher_record`); a watcher already running for the pipeline is returned
instead of a second one (``reused``). :func:`stop_watcher` stops it by PID: SIGINT first, which the
watcher takes as "stop" and leaves the pipeline as it is (running, or drained).

The watcher gets the ISB settings through its environment, never its command line
(:func:`isbflow.steps.driver.driver_env`), and passes them to the drivers it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from isbflow.isb.connect import NatsSettings
from isbflow.local.files import tail
from isbflow.local.procs import process_start
from isbflow.ops.zero import ZeroError, watcher_record
from isbflow.spec.models import Pipeline
from isbflow.spec.paths import DataDir
from isbflow.steps.driver import driver_env
from isbflow.steps.launch import stop_process

__all__ = ["WatcherLaunch", "launch_watcher", "stop_watcher"]


@dataclass
class WatcherLaunch:
    """A detached watcher: its PID (with its kernel start time), its log, and whether it was already running."""

    pipeline: str
    pid: int
    proc_start: int | None
    log: str
    state: str | None
    reused: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def launch_watcher(spec_file: Path, p: Pipeline, settings: NatsSettings, data_dir: Path, *,
                   master: str = "local[2]", workdir: Path | None = None, env: dict[str, str] | None = None,
                   timeout: float = 60.0) -> WatcherLaunch:
    """Start the watcher of ``p`` detached (module docstring), or find the running one. ``env`` adds to
    its environment (and so to its drivers'). Raises :class:`~isbflow.ops.zero.ZeroError` naming the
    log when the watcher exits or has not recorded itself within ``timeout`` seconds."""
    data_dir = Path(data_dir).absolute()
    log = DataDir(data_dir).logs / f"zero-{p.name}.log"
    running = watcher_record(data_dir, p.name)
    if running is not None:
        return WatcherLaunch(p.name, int(running["pid"]), running.get("proc_start"), str(log), running.get("state"),
                             reused=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [str(Path(sys.executable).parent / "isbflow"), "pipeline", "scale-to-zero", "-f",
               str(Path(spec_file).absolute()), "--pipeline", p.name, "--data-dir", str(data_dir), "--master", master,
               "--workdir", str(Path(workdir or Path.cwd()).absolute())]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, env=driver_env(settings, data_dir, workdir, base={**os.environ, **(env or {})},
                                                        pipeline=p),
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    while True:
        record = watcher_record(data_dir, p.name)
        if record is not None and int(record["pid"]) == proc.pid:
            return WatcherLaunch(p.name, proc.pid, record.get("proc_start"), str(log), record.get("state"))
        code = proc.poll()
        if code is not None or time.monotonic() > deadline:
            if code is None:
                stop_process(proc.pid, process_start(proc.pid), grace=5)
            raise ZeroError(f"pipeline {p.name!r}: the scale-to-zero watcher "
                            + (f"exited with code {code}" if code is not None else f"did not start in {timeout:.0f}s")
                            + f"; its log {log} ends:\n{tail(log, 10)}")
        time.sleep(0.2)


def stop_watcher(data_dir: Path, pipeline: str, grace: float = 60.0) -> int | None:
    """Stop ``pipeline``'s watcher by PID (SIGINT, then SIGTERM and SIGKILL after ``grace`` s each);
    its PID, or None when none runs. A watcher mid-drain or mid-start finishes that first."""
    record = watcher_record(Path(data_dir), pipeline)
    if record is None:
        return None
    stop_process(int(record["pid"]), record.get("proc_start"), grace=grace)
    return int(record["pid"])
