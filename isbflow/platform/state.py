"""The platform's record on disk, ``<data dir>/platform.json``, and the vocabulary its modules share.

Contract: :func:`write_state` replaces the record atomically (write, then rename);
:func:`read_state` reads it back (None when there is none), ignoring fields it does not
know and defaulting those an older record lacks. The record names every process the
platform started as a :class:`ProcessState`: its PID **and** its kernel start time
(``proc_start``, field 22 of ``/proc/<pid>/stat``), and the same for the supervisor (the
foreground ``platform up``). A process counts as alive, and is signalled when the platform
stops (:mod:`isbflow.platform.procs`), only while the live process at that PID started at
the recorded time: a PID the kernel has given to another process is left alone. A record
without a start time (written before they were recorded) is trusted by PID alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import isbflow
from isbflow.ops.processes import process_alive, process_start
from isbflow.platform.procs import group_memory

#: every platform process binds this address only
HOST = "127.0.0.1"
STATE_FILE = "platform.json"
#: 100 events/s: the demo's events are 10 ms of event time apart, so event time keeps pace
#: with the clock (the producer starts at "now": freshness checks see live data)
DEFAULT_RATE = 100.0
DEFAULT_PRODUCER_COUNT = 10_000_000  # 28 hours at 100 events/s

#: told each step of a long start or stop (a spinner's text)
Progress = Callable[[str], None]


def quiet(_m: str) -> None:
    """The :data:`Progress` that says nothing."""


class PlatformError(Exception):
    """The platform could not start, be found or be stopped; the message says why and what to do."""


def repo_root() -> Path:
    """The checkout holding ``isbflow/`` (the project is installed editable)."""
    return Path(isbflow.__file__).resolve().parents[1]


@dataclass
class ProcessState:
    """One process the platform started (it leads its own session and process group)."""

    name: str
    pid: int
    log: str
    proc_start: int | None = None  # kernel start time (a reused PID does not count as ours)

    def alive(self) -> bool:
        return process_alive(self.pid, self.proc_start)


@dataclass
class PipelineOptions:
    """What runs on the platform besides NATS and Airflow: one pipeline and a producer feeding it."""

    spec: str  # the spec file (absolute)
    rate: float = DEFAULT_RATE  # producer events/s; 0 = no producer
    count: int = DEFAULT_PRODUCER_COUNT  # events the producer publishes before it ends
    master: str = "local[2]"
    wait: float = 240.0  # seconds to wait for every step to run (0: do not wait)
    restarts: int = 2  # driver restarts allowed while waiting (a step failed while starting)
    processing_time: str | None = None  # every step's trigger interval; None: the spec's readTimeout


@dataclass
class PlatformState:
    data_dir: str
    airflow_home: str
    api_port: int
    dags_folder: str
    supervisor_pid: int  # the foreground 'platform up' that stops everything on Ctrl-C; 0: none
    nats_started: bool
    processes: list[ProcessState] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    marker: str = ""
    pipeline: PipelineOptions | None = None
    producer: ProcessState | None = None
    supervisor_start: int | None = None  # the supervisor's kernel start time (None: trust the PID)
    redis: bool = False  # the pipeline's buffers are in its spec's native redis-server under the data dir
    redis_started: bool = False  # this platform started that redis-server (it stops it)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.api_port}"

    def supervised(self) -> bool:
        """Another live process (the recorded one, not a reuse of its PID) supervises the platform."""
        return (self.supervisor_pid > 0 and self.supervisor_pid != os.getpid()
                and process_alive(self.supervisor_pid, self.supervisor_start))

    def to_json(self) -> dict:
        d = asdict(self)
        d["url"] = self.url
        for p, proc in zip(d["processes"], self.processes, strict=True):
            p["alive"] = proc.alive()
            p["pss_mb"] = round(group_memory(proc.pid) / 2**20, 1)
        return d


def read_state(data_dir: Path) -> PlatformState | None:
    path = Path(data_dir) / STATE_FILE
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    d.pop("url", None)

    def process(p: dict) -> ProcessState:
        return ProcessState(**{k: v for k, v in p.items() if k in ProcessState.__dataclass_fields__})

    procs = [process(p) for p in d.pop("processes")]
    producer = d.pop("producer", None)
    pipeline = d.pop("pipeline", None)
    known = {k: v for k, v in d.items() if k in PlatformState.__dataclass_fields__}
    return PlatformState(**known, processes=procs,
                         producer=process(producer) if producer else None,
                         pipeline=PipelineOptions(**pipeline) if pipeline else None)


def write_state(state: PlatformState) -> None:
    path = Path(state.data_dir) / STATE_FILE
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(state), indent=2))
    tmp.replace(path)


def adopt(state: PlatformState, pid: int | None = None) -> None:
    """Make ``pid`` (default: this process) the platform's supervisor, the one that stops it on Ctrl-C."""
    state.supervisor_pid = os.getpid() if pid is None else pid
    state.supervisor_start = process_start(state.supervisor_pid) if state.supervisor_pid > 0 else None
    write_state(state)


def running(data_dir: Path) -> PlatformState | None:
    """The recorded platform when any of its processes (or its supervisor) is still alive."""
    state = read_state(data_dir)
    if state is None:
        return None
    if state.supervised() or any(p.alive() for p in state.processes):
        return state
    return None


def venv_bin(name: str) -> str:
    """The console script ``name`` of this installation (``airflow``, ``isbflow``) beside its python."""
    cand = Path(sys.executable).parent / name
    if not cand.exists():
        raise PlatformError(f"{name} not found next to {sys.executable}: install the project ('uv sync')")
    return str(cand)
