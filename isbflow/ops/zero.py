"""Scale to zero: a light watcher drains an idle pipeline's driver away and starts it again on new data.

An idle pipeline keeps its Spark driver (about 1 GiB) for ever. For a pipeline whose vertices all
allow ``scale.min: 0`` (:mod:`isbflow.ops.zero_policy` says which, and when it is idle),
:func:`watch` runs a watcher with no Spark and no JVM, on one connection to the ISB service:

- **awake** (the driver runs): every few seconds it looks at every buffer's pending count
  (:func:`isbflow.steps.lag.pipeline_lag`: source streams and edge buffers) and every step's
  heartbeat. Once nothing has been pending for the policy's idle time, it **drains** the
  pipeline as ``isbflow pipeline drain`` and the ``pipeline_drain`` DAG do
  (:func:`isbflow.ops.pipeline.drain_and_wait`: final offsets committed, checkpoints kept), the
  driver exits, and each step's status reads ``sleeping``;
- **asleep** (no driver): it waits for a source stream to grow past what the pipeline committed,
  woken by the stream's own wake subject (:func:`isbflow.isb.wait.wait_for_append`: no polling),
  and peeks at the stream every ``zeroReplicaSleepSeconds`` where it cannot be waited on. On new
  data it **starts** the pipeline as the ``pipeline_start`` DAG does
  (:func:`isbflow.ops.pipeline.start`), and is awake again.

Every decision is an :class:`ZeroEvent` (what, why, and the figures it was taken on), logged and
passed to ``on_event``. Someone else's verbs win: a pipeline drained by hand ends the watch
(statuses ``drained``); one started by hand while asleep makes the watcher awake. One watcher per
pipeline and data dir: the second raises :class:`WatcherBusy` naming the first's PID, recorded
in ``<data dir>/zero/<pipeline>.json`` with its state. When the watcher stops (``stop`` set) it
leaves the pipeline as it is: running, or drained (its steps read ``drained`` again).

Errors: :class:`ZeroError` when watching cannot go on (the pipeline cannot scale to zero, the
driver died on its own, a drain timed out), with what and where.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb import naming
from isbflow.isb.buffers import stream_state, wait_for_append
from isbflow.isb.connect import NatsSettings, session
from isbflow.isb.state import Desired, Observed, StepStatus, all_status, get_desired, put_status
from isbflow.local.procs import process_alive, process_start
from isbflow.ops import pipeline as ops_pipeline
from isbflow.ops.zero_policy import IdleClock, Look, ZeroPolicy, policy
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline
from isbflow.steps.drain import resume_pipeline
from isbflow.steps.lag import pipeline_lag

__all__ = ["SLEEPING", "WatcherBusy", "ZeroError", "ZeroEvent", "look", "watch", "watcher_record"]

log = logging.getLogger(__name__)

#: the state each step's status reads while its pipeline is scaled to zero
SLEEPING = "sleeping"
#: asleep, how often the watcher also checks for someone else's start or drain (seconds)
CONTROL_EVERY = 10.0

Events = Callable[["ZeroEvent"], None]


class ZeroError(Exception):
    """Watching cannot go on; the message names the pipeline, the step or file, and what to do."""


class WatcherBusy(ZeroError):
    """Another watcher already watches this pipeline."""


@dataclass
class ZeroEvent:
    """One decision of the watcher: ``action`` (watching, sleep, asleep, wake, awake, stopped),
    why, and the figures it was taken on."""

    pipeline: str
    action: str
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)
    at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return {"at": round(self.at, 3), "pipeline": self.pipeline, "action": self.action, "reason": self.reason,
                "inputs": self.inputs}

    def line(self) -> str:
        return f"{time.strftime('%H:%M:%S', time.localtime(self.at))} {self.pipeline}: {self.action}: {self.reason}"


def zero_dir(data_dir: Path) -> Path:
    return Path(data_dir) / "zero"


def watcher_record(data_dir: Path, pipeline: str) -> dict[str, Any] | None:
    """The live watcher of ``pipeline`` under ``data_dir`` (pid, state, since, policy), or None."""
    path = zero_dir(data_dir) / f"{pipeline}.json"
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if process_alive(int(rec.get("pid", 0)), rec.get("proc_start")) else None


@contextlib.contextmanager
def _held(data_dir: Path, pipeline: str) -> Iterator[Path]:
    """Hold ``pipeline``'s watcher lock for the block (one watcher per pipeline); yields the record's path."""
    folder = zero_dir(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / f"{pipeline}.json"
    with open(folder / f"{pipeline}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = watcher_record(data_dir, pipeline)
            raise WatcherBusy(f"pipeline {pipeline!r} already has a scale-to-zero watcher"
                              + (f" (pid {other['pid']}, {other.get('state')})" if other else "")
                              + f" under {data_dir}: stop it first") from None
        try:
            yield record
        finally:
            record.unlink(missing_ok=True)
            fcntl.flock(lock, fcntl.LOCK_UN)


async def look(nc: Any, p: Pipeline, at: float | None = None) -> Look:
    """One look at ``p``: each buffer's pending messages (a missing buffer counts as 1: it keeps
    the pipeline awake) and each step's state and last batch."""
    lags = await pipeline_lag(nc, p, sources=True)
    statuses = await all_status(nc, p.name, p.topological_order())
    return Look(time.monotonic() if at is None else at,
                {b.stream: 1 if b.missing else b.lag for b in lags},
                {v: str(s.state) if s is not None else "unknown" for v, s in statuses.items()},
                {v: s.batch_id for v, s in statuses.items() if s is not None})


async def _mark(nc: Any, p: Pipeline, state: str, only: str | None = None) -> None:
    """Set every step's status to ``state`` (only those reading ``only``, when given), other fields kept."""
    for v, s in (await all_status(nc, p.name, p.topological_order())).items():
        s = s or StepStatus(v)
        if only is None or s.state == only:
            s.state = state
            await put_status(nc, p.name, s)


async def _committed_sources(nc: Any, p: Pipeline) -> dict[str, int]:
    """Each source stream -> the last sequence its step committed (what the pipeline has taken)."""
    sources = {naming.source_stream(p, v.name) for v in p.spec.vertices if v.source is not None}
    return {b.stream: b.committed for b in await pipeline_lag(nc, p, sources=True) if b.stream in sources}


class _Watcher:
    """The state machine of :func:`watch` (module docstring)."""

    def __init__(self, spec_file: Path, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path,
                 rule: ZeroPolicy, stop: threading.Event, on_event: Events, record: Path,
                 start_args: dict[str, Any], drain_timeout: float, exit_timeout: float):
        self.spec_file, self.specs, self.p, self.settings, self.data_dir = spec_file, specs, p, settings, data_dir
        self.rule, self.stop, self.on_event, self.record = rule, stop, on_event, record
        self.start_args, self.drain_timeout, self.exit_timeout = start_args, drain_timeout, exit_timeout
        self.asleep = False
        self.proc_start = process_start(os.getpid())

    def event(self, action: str, reason: str, **inputs: Any) -> ZeroEvent:
        e = ZeroEvent(self.p.name, action, reason, inputs)
        log.info("scale to zero: %s %s", e.line(), json.dumps(inputs, default=str))
        self.record.write_text(json.dumps({"pid": os.getpid(), "proc_start": self.proc_start, "state": action,
                                           "since": e.at, "reason": reason, "policy": self.rule.to_json()}))
        self.on_event(e)
        return e

    async def pause(self, seconds: float) -> None:
        """Sleep ``seconds``, or until ``stop`` is set (within a quarter second)."""
        deadline = time.monotonic() + seconds
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(0.25, left))

    def driver_alive(self) -> tuple[bool | None, Any]:
        launch = ops_pipeline.live_launch(self.data_dir, self.p)
        return (launch.alive() if launch is not None else False), launch

    async def run(self) -> None:
        async with session(self.settings, name="isbflow-zero") as nc:
            try:
                awake = await self.first(nc)
                while awake is not None and not self.stop.is_set():
                    awake = await (self.awake(nc) if awake else self.sleep(nc))
            finally:  # stopped, or failed: a pipeline left asleep reads drained, as a drain by hand leaves it
                if self.asleep:
                    with contextlib.suppress(Exception):
                        await _mark(nc, self.p, Observed.DRAINED.value, only=SLEEPING)
            if self.asleep:
                self.event("stopped", "the watcher stopped; the pipeline stays drained (its steps read drained)")
            elif awake is not None:
                self.event("stopped", "the watcher stopped; the pipeline keeps running")

    async def first(self, nc: Any) -> bool:
        """Where the watch begins: awake when a driver runs, else asleep when nothing is pending,
        else woken now."""
        alive, launch = self.driver_alive()
        self.event("watching", "watching the pipeline", policy=self.rule.to_json(),
                   driver_pid=launch.pid if launch is not None and alive is not False else None)
        if alive is not False:
            return True
        now = await look(nc, self.p)
        failed = {v: s for v, s in now.states.items() if s == Observed.FAILED.value}
        if failed:
            raise ZeroError(f"pipeline {self.p.name!r}: step(s) {', '.join(failed)} failed and no driver runs: "
                            "see 'isbflow pipeline status' and the driver's log, fix it, then watch again")
        if any(now.pending.values()):
            return await self.wake(nc, "the driver is not running and buffers hold pending messages", now.to_json())
        await resume_pipeline(nc, self.p)  # meant to run, asleep: a drain by hand from here is told apart
        await _mark(nc, self.p, SLEEPING)
        self.asleep = True
        self.event("asleep", "the driver is not running and nothing is pending", **now.to_json())
        return False

    async def awake(self, nc: Any) -> bool | None:
        """Look until the pipeline has been idle for the policy's time, then drain it: False
        (asleep). None: someone else drained it."""
        clock = IdleClock()
        while not self.stop.is_set():
            alive, launch = self.driver_alive()
            now = await look(nc, self.p)
            if alive is False:
                if all(s == Observed.DRAINED.value for s in now.states.values()):
                    self.event("stopped", "the pipeline was drained by someone else: the watch ends", **now.to_json())
                    return None
                raise ZeroError(f"pipeline {self.p.name!r}: the driver (pid {launch.pid if launch else '?'}) exited "
                                f"while its steps were {now.states}; see its log "
                                f"{launch.log if launch else '(none recorded)'} and 'isbflow pipeline status'")
            idle = clock.feed(now)
            if idle >= self.rule.idle_seconds:
                return await self.drain(nc, idle, now)
            await self.pause(self.rule.look_seconds)
        return True

    async def drain(self, nc: Any, idle: float, now: Look) -> bool:
        self.event("sleep", f"nothing pending for {idle:.1f}s (scaleDownCooldownSeconds {self.rule.idle_seconds:g}): "
                   "draining the driver away", idle_seconds=round(idle, 3), **now.to_json())
        try:
            drained = await asyncio.to_thread(ops_pipeline.drain_and_wait, self.settings, self.p, self.data_dir,
                                              timeout=self.drain_timeout, exit_timeout=self.exit_timeout)
        except ops_pipeline.DrainTimeout as e:
            raise ZeroError(f"{e}; the watcher stops (the driver keeps running)") from None
        pid = drained.launch.pid if drained.launch is not None else None
        if drained.driver_exited is False:  # drained: nothing is lost by stopping it
            await asyncio.to_thread(ops_pipeline.stop_launch, self.data_dir, self.p)
        # the steps are meant to run and sleep: desired back to running (the drain left it draining), so a
        # drain by hand while asleep is seen as one, and the next start finds them as pipeline_start sets them
        await resume_pipeline(nc, self.p)
        await _mark(nc, self.p, SLEEPING)
        self.asleep = True
        self.event("asleep", "drained; the driver exited, checkpoints kept", driver_pid=pid,
                   final_offsets=drained.final_offsets)
        return False

    async def sleep(self, nc: Any) -> bool | None:
        """Wait for a source stream to grow past what the pipeline committed, then start it: True
        (awake). None: someone else drains or stopped the pipeline."""
        base = await _committed_sources(nc, self.p)
        waitable, next_peek = True, time.monotonic() + self.rule.peek_seconds
        while not self.stop.is_set():
            if self.driver_alive()[0] is not False:
                await _mark(nc, self.p, Observed.STARTING.value, only=SLEEPING)
                self.asleep = False
                self.event("awake", "the pipeline was started by someone else")
                return True
            told = {v: (await get_desired(nc, self.p.name, v)).value for v in self.p.topological_order()}
            if any(d != Desired.RUNNING.value for d in told.values()):
                await _mark(nc, self.p, Observed.DRAINED.value, only=SLEEPING)
                self.asleep = False
                self.event("stopped", "someone drains or stopped the pipeline: the watch ends", desired=told)
                return None
            slice_s = max(0.05, min(CONTROL_EVERY, next_peek - time.monotonic()))
            if waitable:
                got = await wait_for_append(nc, base, timeout=slice_s, cancelled=self.stop.is_set)
            else:
                await self.pause(slice_s)
                got = False
            if not got and time.monotonic() < next_peek:
                continue
            next_peek = time.monotonic() + self.rule.peek_seconds
            grown = {}
            for stream, seen in base.items():
                st = await stream_state(nc, stream)
                if st is not None and st.last_seq > seen:
                    grown[stream] = {"committed": seen, "last_seq": st.last_seq}
            if grown:
                return await self.wake(nc, "new data in " + ", ".join(
                    f"{s} (last sequence {g['last_seq']}, committed {g['committed']})" for s, g in grown.items()),
                    {"grown": grown})
            if got:  # the wait returned at once with nothing new: a stream it cannot wait on; peek instead
                waitable = False
        return False

    async def wake(self, nc: Any, reason: str, inputs: dict[str, Any]) -> bool:
        self.event("wake", f"{reason}: starting the pipeline", **inputs)
        began = time.monotonic()
        try:
            started = await asyncio.to_thread(ops_pipeline.start, self.spec_file, self.specs, self.p, self.settings,
                                              self.data_dir, **self.start_args)
        except (ops_pipeline.PipelineError, ops_pipeline.LaunchError) as e:
            raise ZeroError(f"pipeline {self.p.name!r}: could not start it again: {e}") from None
        self.asleep = False
        self.event("awake", f"launched the driver (pid {started.launch.pid}, log {started.launch.log})",
                   driver_pid=started.launch.pid, reused=started.launch.reused,
                   launch_seconds=round(time.monotonic() - began, 3))
        return True


def watch(spec_file: Path, specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path, *,
          stop: threading.Event | None = None, on_event: Events | None = None, master: str = "local[2]",
          workdir: Path | None = None, references_dir: Path | None = None, drain_timeout: float = 300.0,
          exit_timeout: float = 120.0, **start_args: Any) -> None:
    """Watch ``p`` (module docstring) until ``stop`` is set or someone else drains it.

    ``spec_file`` is what a started driver runs (one file holding ``p``); ``master``, ``workdir``,
    ``references_dir`` and ``start_args`` go to :func:`isbflow.ops.pipeline.start` (default
    ``references_dir``: ``<spec dir>/reference``). Raises :class:`ZeroError` (the pipeline cannot
    scale to zero, a drain timed out, the driver died on its own), :class:`WatcherBusy`, and
    :class:`~isbflow.ops.pipeline.IsbUnreachable`.
    """
    try:
        rule = policy(p)
    except ValueError as e:
        raise ZeroError(str(e)) from None
    args = {"master": master, "workdir": workdir, **start_args,
            "references_dir": references_dir or Path(spec_file).parent / ops_pipeline.REFERENCE_DIR}
    with _held(Path(data_dir), p.name) as record:
        watcher = _Watcher(Path(spec_file), specs, p, settings, Path(data_dir), rule, stop or threading.Event(),
                           on_event or (lambda _e: None), record, args, drain_timeout, exit_timeout)
        asyncio.run(watcher.run())
