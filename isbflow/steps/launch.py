"""Launching a pipeline's Spark driver as a detached process, and knowing whether it still lives.

A continuous pipeline outlives whatever started it (an Airflow task, a shell),
so :func:`launch_pipeline` starts ``isbflow pipeline run --trigger continuous``
in a **new session** (no controlling terminal, its own process group), with
stdout and stderr in ``<data dir>/logs/<key>-<launch id>.log`` (the newest
:data:`LOGS_KEPT` per key are kept; each rotated by the driver past 16 MiB, keeping one older
part ``.log.1``: :func:`isbflow.steps.driver.cap_own_log`), and records
the launch in ``<data dir>/launches/<key>.json`` (``key`` = the pipeline name,
or ``<pipeline>.<step>`` for a one-step launch)::

    {"launch_id", "pipeline", "steps", "pid", "host", "proc_start", "started_at",
     "spec", "log", "master", "command"}

**One launch at a time.** Like the Spark provider's ``ResumableJobMixin``, a
second call for the same key returns the recorded launch instead of starting
another driver on the same checkpoints, as long as it is *live*: its process
exists on this host (same PID *and* same kernel start time, so a reused PID
does not count) and it has sent a heartbeat within ``heartbeat_timeout``
seconds, or is still within ``startup_grace`` seconds of its start (Spark
takes a while to send the first one). A process that lives but has stopped
sending heartbeats raises :class:`LaunchStalled`: starting a second driver
beside it would corrupt the checkpoints; stop it first (:func:`stop_launch`).

**Secrets.** The ISB service settings reach the driver through its
environment only (``NATS_URL`` without credentials, ``NATS_USER`` /
``NATS_PASSWORD``, ``NATS_TOKEN``, ``NATS_CREDS``, ``NATS_TLS_*``; see
:func:`settings_env`), never its command line or the log. The caller's
``AIRFLOW*`` variables are not passed on (connection URIs) but its PostgreSQL sinks' (:func:`sink_connections`).

**Seam for clusters.** :func:`driver_command` builds the command for a
client-mode driver on the local host (``local[N]`` or a standalone master: Spark
standalone takes no Python application in cluster deploy mode). On Kubernetes
the command would instead come from the Spark provider's
``SparkSubmitHook._build_spark_submit_command`` with ``--deploy-mode cluster``
and the launch id would be the driver pod; :func:`launch` takes any command,
so only that builder and :meth:`LaunchRecord.alive` would change.

:func:`run_foreground` runs the same command in the foreground (the batch
mode, ``--trigger available-now``) and returns its JSON result.

This module does not import Airflow.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.state import Observed, StepStatus, all_status
from isbflow.local.files import ROTATED_SUFFIX, keep_newest, tail
from isbflow.local.procs import group_members, process_alive, process_start
from isbflow.spec import load_specs
from isbflow.spec.paths import DataDir
from isbflow.steps.driver import (  # noqa: F401 - re-exported
    LOG_ENV,
    LaunchError,
    driver_command,
    driver_env,
    settings_env,
)

log = logging.getLogger(__name__)

DEFAULT_HEARTBEAT_TIMEOUT = 60.0
DEFAULT_STARTUP_GRACE = 300.0
#: driver logs kept per launch key (and per batch run name) under ``<data dir>/logs/``; older ones are removed
LOGS_KEPT = 10
LIVE_STATES = (Observed.STARTING, Observed.RUNNING, Observed.DRAINING)


class LaunchStalled(LaunchError):
    """A launched driver still runs but has stopped sending heartbeats."""


@dataclass
class LaunchRecord:
    """One detached driver process, as recorded in ``<data dir>/launches/<key>.json``."""

    launch_id: str
    pipeline: str
    pid: int
    started_at: float
    spec: str
    log: str
    master: str
    steps: list[str] | None = None
    host: str = field(default_factory=socket.gethostname)
    proc_start: int | None = None  # kernel start time of the process (PID reuse guard)
    command: list[str] = field(default_factory=list)
    reused: bool = False  # set on the record returned for an existing live launch

    @property
    def key(self) -> str:
        return launch_key(self.pipeline, self.steps)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LaunchRecord:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def alive(self) -> bool | None:
        """Whether the process still runs; ``None`` when it ran on another host (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        return process_alive(self.pid, self.proc_start)

    def log_tail(self, lines: int = 20) -> str:
        return tail(self.log, lines)


def launch_key(pipeline: str, steps: Sequence[str] | None) -> str:
    return pipeline if not steps else f"{pipeline}.{'+'.join(steps)}"


def launches_dir(data_dir: str | Path) -> Path:
    return DataDir(data_dir).launches


def record_path(data_dir: str | Path, key: str) -> Path:
    return launches_dir(data_dir) / f"{key}.json"


def read_launch(data_dir: str | Path, key: str) -> LaunchRecord | None:
    """The recorded launch for ``key`` (a pipeline name), or ``None``."""
    path = record_path(data_dir, key)
    try:
        return LaunchRecord.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as e:
        raise LaunchError(f"launch record {path} is unreadable ({e}); delete it if no driver runs") from None


def _write_launch(data_dir: str | Path, record: LaunchRecord) -> None:
    path = record_path(data_dir, record.key)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**record.to_json(), "reused": False}, indent=2))
    tmp.replace(path)


# ---------------------------------------------------------------------------------- processes

def prune_logs(logs: Path, stem: str, keep: int | None = None) -> list[Path]:
    """Keep the newest ``keep`` (default :data:`LOGS_KEPT`) logs under ``logs`` whose name is
    ``<stem>.log`` (``stem`` a regular expression: one launch key's, or one batch run's), with
    their rotated parts; the removed. A live launch's log is its key's newest, so it is always kept."""
    pattern = re.compile(rf"^{stem}\.log$")
    removed = keep_newest([p for p in logs.iterdir() if pattern.match(p.name)], LOGS_KEPT if keep is None else keep)
    for p in removed:  # and their rotated older parts
        p.with_name(p.name + ROTATED_SUFFIX).unlink(missing_ok=True)
    return removed


# ---------------------------------------------------------------------------------- launching

@contextlib.contextmanager
def _locked(data_dir: str | Path, key: str) -> Iterator[None]:
    """Serialise check-and-launch for one key (two retried tasks must not both start a driver)."""
    launches_dir(data_dir).mkdir(parents=True, exist_ok=True)
    with open(record_path(data_dir, key).with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def newest_heartbeat(record: LaunchRecord, statuses: dict[str, StepStatus | None]) -> float | None:
    """When this launch last wrote a heartbeat (statuses written by its PID since it started)."""
    times = [s.updated_at for s in statuses.values()
             if s is not None and s.pid == record.pid and s.updated_at >= record.started_at - 1]
    return max(times) if times else None


def check_live(record: LaunchRecord, statuses: dict[str, StepStatus | None] | None,
               heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
               startup_grace: float = DEFAULT_STARTUP_GRACE, now: float | None = None) -> bool:
    """True when ``record`` is a live launch (module docstring); False when its process is gone.

    ``statuses`` are the pipeline's step heartbeats (``None``: not known, the process alone
    decides). Raises :class:`LaunchStalled` when the process runs but its heartbeats stopped.
    """
    if record.alive() is False:
        return False
    if statuses is None:
        return True
    now = time.time() if now is None else now
    beat = newest_heartbeat(record, statuses)
    if beat is not None and now - beat <= heartbeat_timeout:
        return True
    if now - record.started_at <= startup_grace:
        return True  # Spark is still starting: the first heartbeat comes after the queries start
    silent = f"last heartbeat {now - beat:.0f}s ago" if beat else f"no heartbeat in {now - record.started_at:.0f}s"
    raise LaunchStalled(
        f"pipeline {record.pipeline!r}: launch {record.launch_id} (pid {record.pid}) still runs but sends "
        f"no heartbeats ({silent}); see its log {record.log}, then stop it (isbflow.steps.launch.stop_launch "
        f"or kill {record.pid}) before starting it again")


def launch(key: str, pipeline: str, command: Sequence[str], *, data_dir: str | Path, env: dict[str, str],
           spec: str | Path = "", master: str = "", steps: Sequence[str] | None = None,
           workdir: str | Path | None = None,
           statuses: dict[str, StepStatus | None] | None = None,
           heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
           startup_grace: float = DEFAULT_STARTUP_GRACE) -> LaunchRecord:
    """Start ``command`` detached and record it under ``key``, unless a live launch exists.

    ``statuses`` (the step heartbeats) decide liveness with the process (see
    :func:`check_live`); the existing record comes back with ``reused=True``.
    """
    with _locked(data_dir, key):
        existing = read_launch(data_dir, key)
        if existing is not None:
            if check_live(existing, statuses, heartbeat_timeout, startup_grace):
                existing.reused = True
                return existing
            log.info("the previous launch %s of %s (pid %s) has exited; starting a new one (its log: %s)",
                     existing.launch_id, key, existing.pid, existing.log)
        launch_id = uuid.uuid4().hex[:12]
        logs = DataDir(data_dir).logs
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{key}-{launch_id}.log"
        log_path.touch()
        prune_logs(logs, f"{re.escape(key)}-[0-9a-f]{{12}}")
        started_at = time.time()
        with open(log_path, "ab") as out:
            try:
                proc = subprocess.Popen(list(command), env={**env, LOG_ENV: str(log_path)}, cwd=workdir,
                                        stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            except OSError as e:
                raise LaunchError(f"cannot start the driver of pipeline {pipeline!r} ({command[0]}): {e}") from None
        record = LaunchRecord(launch_id=launch_id, pipeline=pipeline, pid=proc.pid, started_at=started_at,
                              spec=str(spec), log=str(log_path), master=master,
                              steps=list(steps) if steps else None, proc_start=process_start(proc.pid),
                              command=list(command))
        _write_launch(data_dir, record)
        return record


def launch_pipeline(spec_file: str | Path, data_dir: str | Path, settings: NatsSettings, *,
                    master: str = "local[2]", pipeline: str | None = None,
                    steps: Sequence[str] | None = None, workdir: str | Path | None = None,
                    heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                    startup_grace: float = DEFAULT_STARTUP_GRACE,
                    extra_env: Mapping[str, str] | None = None, processing_time: str | None = None) -> LaunchRecord:
    """Start the pipeline's steps (all, or one) continuously in a detached driver; see the module doc.

    ``workdir`` is the driver's working directory and is put on its ``PYTHONPATH``
    (where the user's transforms, e.g. ``spark_apps/``, import from); ``extra_env`` adds to its
    environment (the local platform's marker); ``processing_time`` the trigger interval. Reads the
    step heartbeats to judge an existing launch (:class:`~isbflow.isb.connect.IsbUnreachable`: cannot).
    """
    specs = load_specs([Path(spec_file)])
    p = specs.pipelines[pipeline] if pipeline else specs.only_pipeline()
    key = launch_key(p.name, steps)
    existing = read_launch(data_dir, key)
    statuses = None
    if existing is not None and existing.alive() is not False:
        statuses = asyncio.run(read_statuses(settings, p.name, p.topological_order()))
    command = driver_command(spec_file, data_dir=data_dir, trigger="continuous", master=master,
                             pipeline=p.name, steps=steps, processing_time=processing_time)
    env = driver_env(settings, data_dir, workdir, base={**os.environ, **(extra_env or {})}, pipeline=p)
    return launch(key, p.name, command, data_dir=data_dir, env=env,
                  spec=Path(spec_file).absolute(), master=master, steps=steps, workdir=workdir,
                  statuses=statuses, heartbeat_timeout=heartbeat_timeout, startup_grace=startup_grace)


async def read_statuses(settings: NatsSettings, pipeline: str, vertices: list[str]) -> dict[str, StepStatus | None]:
    """Every step's heartbeat (one connection)."""

    async with session(settings, name="isbflow-launch") as nc:
        return await all_status(nc, pipeline, vertices)


@dataclass
class StateCheck:
    """Whether a pipeline's steps have all reached a state, or what stands in the way."""

    done: bool
    problem: str | None  # set when waiting longer cannot help (a step failed, the driver died or hangs)
    steps: dict[str, str]  # vertex -> observed state ('unknown' before its first heartbeat of this launch)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def judge_state(statuses: dict[str, StepStatus | None], target: str, launch: LaunchRecord | None = None,
                alive: bool | None = None, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                startup_grace: float = DEFAULT_STARTUP_GRACE, now: float | None = None) -> StateCheck:
    """Judge the heartbeats ``statuses`` of a pipeline's steps against ``target``.

    With a ``launch``, only heartbeats written by its process count (older ones are from an
    earlier run), and ``alive`` (checked *before* the statuses were read) tells whether its
    process still runs: a driver that exited or stopped sending heartbeats before every step
    reached ``target`` is a problem, as is a step that reports ``failed``.
    """
    def current(s: StepStatus | None) -> bool:
        if s is None:
            return False
        return launch is None or (s.updated_at >= launch.started_at - 1 and s.pid in (None, launch.pid))

    seen = {v: (s.state if current(s) else "unknown") for v, s in statuses.items()}
    failed = [v for v, s in statuses.items() if current(s) and s.state == Observed.FAILED]
    where = f"; last lines of {launch.log}:\n{launch.log_tail()}" if launch is not None else ""
    if failed:
        s = statuses[failed[0]]
        return StateCheck(False, f"step {failed[0]!r} failed: {s.error if s else ''}{where}", seen)
    if all(state == target for state in seen.values()):
        return StateCheck(True, None, seen)
    if launch is None:
        return StateCheck(False, None, seen)
    waiting = ", ".join(f"{v} ({state})" for v, state in seen.items() if state != target)
    if alive is False:
        return StateCheck(False, f"pipeline {launch.pipeline!r}: its driver (launch {launch.launch_id}, "
                                 f"pid {launch.pid}) exited before every step was {target}; waiting for "
                                 f"{waiting}{where}", seen)
    try:
        check_live(launch, statuses, heartbeat_timeout, startup_grace, now)
    except LaunchStalled as e:
        return StateCheck(False, f"{e}; waiting for {waiting}", seen)
    return StateCheck(False, None, seen)


async def observe_state(nc: Any, pipeline: str, vertices: list[str], target: str,
                        launch: LaunchRecord | None = None,
                        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
                        startup_grace: float = DEFAULT_STARTUP_GRACE) -> StateCheck:
    """Read the steps' heartbeats over the client ``nc`` and :func:`judge_state` them."""

    alive = launch.alive() if launch is not None else None
    statuses = await all_status(nc, pipeline, vertices)
    return judge_state(statuses, target, launch, alive, heartbeat_timeout, startup_grace)


def stop_launch(data_dir: str | Path, key: str, grace: float = 30.0) -> LaunchRecord | None:
    """Stop the recorded driver by PID: SIGINT (the runner stops its queries), then SIGTERM and
    SIGKILL to its process group after ``grace`` seconds each. Returns the record (``None``: none)."""
    record = read_launch(data_dir, key)
    if record is None or record.alive() is not True:
        return record
    stop_process(record.pid, record.proc_start, grace)
    return record


def stop_process(pid: int, proc_start: int | None = None, grace: float = 30.0) -> None:
    """Stop a detached process (the leader of its own process group) and everything in its group.

    With ``proc_start`` (its start time as recorded), a PID now held by another process (the
    record outlived a reboot or crash and the PID was reused) is left alone, its group too.
    """
    if proc_start is not None and process_alive(pid, None) and not process_alive(pid, proc_start):
        return
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, grace), (signal.SIGKILL, 10.0)):
        if not process_alive(pid, proc_start):
            break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if sig == signal.SIGINT:
                os.kill(pid, sig)  # the driver only: the JVM is stopped by the driver itself
            else:
                os.killpg(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and process_alive(pid, proc_start):
            time.sleep(0.2)
    # leftovers of the group (a JVM whose driver died): its members, never a group that took the
    # number since (a whole-group kill could reach one once the leader is gone)
    for member in group_members(pid, proc_start):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(member, signal.SIGKILL)


def wait_exit(record: LaunchRecord, timeout: float) -> bool:
    """Wait until the launched process has exited; True when it has."""
    deadline = time.monotonic() + timeout
    while record.alive() is True:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


# ---------------------------------------------------------------------------------- foreground

def run_foreground(spec_file: str | Path, data_dir: str | Path, settings: NatsSettings, *,
                   trigger: str = "available-now", master: str = "local[2]", pipeline: str | None = None,
                   steps: Sequence[str] | None = None, workdir: str | Path | None = None,
                   timeout: float | None = None) -> tuple[dict[str, Any], str]:
    """Run the driver to completion (the batch mode); returns its ``--json`` result and the log path.

    The output goes to a log file under ``<data dir>/logs/`` like a launch's. Raises
    :class:`LaunchError` with the log's last lines when the run fails or times out.
    """
    command = driver_command(spec_file, data_dir=data_dir, trigger=trigger, master=master,
                             pipeline=pipeline, steps=steps, json_out=True)
    logs = DataDir(data_dir).logs
    logs.mkdir(parents=True, exist_ok=True)
    name = f"{pipeline or Path(spec_file).stem}-{trigger}"
    log_path = logs / f"{name}-{uuid.uuid4().hex[:12]}.log"
    log_path.touch()
    prune_logs(logs, f"{re.escape(name)}-[0-9a-f]{{12}}")
    with open(log_path, "ab") as err:
        specs = load_specs([Path(spec_file)])
        p = specs.pipelines[pipeline] if pipeline else specs.only_pipeline()
        env = {**driver_env(settings, data_dir, workdir, pipeline=p), LOG_ENV: str(log_path)}
        proc = subprocess.Popen(command, env=env, cwd=workdir,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_process(proc.pid, grace=10.0)
            proc.wait()
            raise LaunchError(f"{trigger} run of {spec_file} did not finish in {timeout:.0f}s; "
                              f"log {log_path}:\n{tail(log_path)}") from None
    if proc.returncode != 0:
        raise LaunchError(f"{trigger} run of {spec_file} failed (exit {proc.returncode}); "
                          f"log {log_path}:\n{tail(log_path)}")
    try:
        return json.loads(out), str(log_path)
    except ValueError:
        raise LaunchError(f"{trigger} run of {spec_file} printed no JSON result; log {log_path}:\n"
                          f"{tail(log_path)}") from None
