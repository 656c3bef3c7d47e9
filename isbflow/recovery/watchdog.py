"""The watchdog: is a running pipeline healthy? Stalls, growing lag and buffer loss, judged from outside.

:func:`watch` looks at one pipeline over the ISB service and returns a
:class:`WatchReport`. A pipeline is *watched* when a step's heartbeat says it
is ``starting``, ``running``, ``draining`` or ``failed``; a pipeline with no
such step (never started, drained, batch runs finished) is ``idle`` and
nothing is judged. For a watched pipeline the findings are:

- ``stale-heartbeat``: a live step whose heartbeat is older than
  ``heartbeat_timeout`` seconds (``startup_grace`` for a step still
  ``starting``): its driver hangs or died;
- ``driver-exited``: the pipeline's recorded launch
  (:mod:`isbflow.steps.launch`) is no longer a process on this host while its
  steps' heartbeats still say they run (known at once, before they go stale);
- ``step-failed``: a step reports ``failed`` (with its error);
- ``lag-growing``: a running step's lag (messages behind, summed over its
  inputs) grew at each of the last ``lag_growth_runs`` watchdog runs;
- ``buffer-lost``: :func:`isbflow.isb.loss.detect_loss` finds a
  stream missing, recreated, or trimmed past what its reader has read.

The lag trend needs the previous runs: each run keeps, in the pipeline's
status bucket under key ``watchdog`` (JSON), the time and each step's recent
lag samples. Samples older than ``HISTORY_MAX_GAP_S`` are dropped, so a
watchdog paused for an hour does not compare against stale numbers.

While a recovery runs (status key ``recovery`` with state ``running``,
published by recover after each phase, and its process alive:
:func:`isbflow.recovery.status.is_running`), the report says so in
``recovery_running``: the caller should not start a second one. A recover
process killed midway leaves that key at ``running``; it does not count, so the
watchdog can start the recovery again.

This module does not import Airflow.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb import naming
from isbflow.isb.connect import NatsSettings, connect
from isbflow.isb.control import kv as open_kv
from isbflow.isb.loss import detect_loss
from isbflow.isb.state import Observed, StepStatus, all_status
from isbflow.isb.store import BucketMissing
from isbflow.recovery.status import is_running
from isbflow.spec.models import Pipeline
from isbflow.steps.launch import DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_STARTUP_GRACE, LaunchRecord

log = logging.getLogger(__name__)

WATCHDOG_KEY = "watchdog"
RECOVERY_KEY = "recovery"
DEFAULT_LAG_GROWTH_RUNS = 3
HISTORY_MAX_GAP_S = 600.0
LIVE = (Observed.STARTING.value, Observed.RUNNING.value, Observed.DRAINING.value)
WATCHED = (*LIVE, Observed.FAILED.value)


@dataclass
class Finding:
    """One thing the watchdog saw that needs a person (or a recovery)."""

    kind: str  # stale-heartbeat | driver-exited | step-failed | lag-growing | buffer-lost
    message: str
    step: str | None = None
    stream: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class WatchReport:
    pipeline: str
    state: str = "idle"  # idle | healthy | unhealthy
    steps: dict[str, dict[str, Any]] = field(default_factory=dict)  # vertex -> state, age_s, lag
    findings: list[Finding] = field(default_factory=list)
    recovery_running: bool = False
    at: float = field(default_factory=time.time)

    @property
    def healthy(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["healthy"] = self.healthy
        return d

    def summary(self) -> str:
        """One paragraph for the task log: what was seen, each finding on its own line."""
        if self.state == "idle":
            return f"pipeline {self.pipeline}: no step is running (nothing to watch)"
        live = {v: s for v, s in self.steps.items() if s["state"] in LIVE}
        ages = [s["age_s"] for s in live.values()]
        head = (f"pipeline {self.pipeline}: {len(live)} live step(s)"
                + (f", heartbeats {min(ages):.0f}-{max(ages):.0f}s old" if ages else "")
                + f", total lag {sum(s['lag'] for s in live.values()):,}")
        if self.healthy:
            return head + ", no buffer lost: healthy"
        return head + f"; {len(self.findings)} problem(s):\n" + "\n".join(f"- {f.message}" for f in self.findings)


# ------------------------------------------------------------------ pure judgement


def judge(pipeline: str, statuses: dict[str, StepStatus | None], now: float, *,
          history: dict[str, list[int]] | None = None, lost: list[Any] = (),
          launch: LaunchRecord | None = None, launch_alive: bool | None = None,
          heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, startup_grace: float = DEFAULT_STARTUP_GRACE,
          lag_growth_runs: int = DEFAULT_LAG_GROWTH_RUNS) -> WatchReport:
    """Judge one look at a pipeline (no I/O). ``history``: each step's previous lag samples, oldest
    first, *including* this run's; ``lost``: :class:`~isbflow.recovery.recover.DetectedLoss` items."""
    report = WatchReport(pipeline, at=now)
    for v, s in statuses.items():
        if s is not None:
            report.steps[v] = {"state": str(s.state), "age_s": round(s.age(now), 1), "lag": sum(s.lag.values()),
                               "lag_by_stream": dict(s.lag), "error": s.error}
    watched = {v: s for v, s in statuses.items() if s is not None and str(s.state) in WATCHED}
    if not watched:
        return report
    for v, s in watched.items():
        state, age = str(s.state), s.age(now)
        if state == Observed.FAILED.value:
            report.findings.append(Finding("step-failed", f"step {v}: reports failed: {s.error or 'no error text'}",
                                           step=v, detail={"error": s.error}))
            continue
        limit = startup_grace if state == Observed.STARTING.value else heartbeat_timeout
        if age > limit:
            report.findings.append(Finding(
                "stale-heartbeat", f"step {v}: last heartbeat {age:.0f}s ago (state {state}, batch {s.batch_id}; "
                                   f"threshold {limit:.0f}s): its driver hangs or died",
                step=v, detail={"age_s": round(age, 1), "threshold_s": limit, "state": state}))
    if launch is not None and launch_alive is False:
        mine = sorted(v for v, s in watched.items() if s.pid == launch.pid and str(s.state) in LIVE)
        if mine:
            report.findings.append(Finding(
                "driver-exited", f"driver of launch {launch.launch_id} (pid {launch.pid}) has exited while steps "
                                 f"{', '.join(mine)} still report running; its log: {launch.log}",
                detail={"launch": launch.launch_id, "pid": launch.pid, "log": launch.log, "steps": mine}))
    for v, samples in sorted((history or {}).items()):
        recent = samples[-(lag_growth_runs + 1):]
        if (v in watched and len(recent) == lag_growth_runs + 1
                and all(b > a for a, b in zip(recent, recent[1:], strict=False))):
            trend = " -> ".join(f"{x:,}" for x in recent)
            report.findings.append(Finding(
                "lag-growing", f"step {v}: lag grew at each of the last {lag_growth_runs} checks ({trend} "
                               "messages behind): it cannot keep up", step=v, detail={"lag_trend": recent}))
    for b in lost:
        rng = ("" if b.first is None else f", sequences {b.first}" + (f"-{b.last}" if b.last else " on"))
        report.findings.append(Finding("buffer-lost", f"buffer {b.stream} lost{rng}: {b.reason}", stream=b.stream,
                                       detail={"first": b.first, "last": b.last, "reason": b.reason}))
    report.state = "healthy" if report.healthy else "unhealthy"
    return report


def next_history(previous: dict[str, Any] | None, statuses: dict[str, StepStatus | None], now: float,
                 keep: int) -> dict[str, list[int]]:
    """Each live step's lag samples with this run's appended (at most ``keep``, oldest first)."""
    old = (previous or {}).get("lag", {}) if previous and now - float(previous.get("at", 0)) <= HISTORY_MAX_GAP_S \
        else {}
    out = {}
    for v, s in statuses.items():
        if s is not None and str(s.state) == Observed.RUNNING.value:
            out[v] = [*[int(x) for x in old.get(v, [])], sum(s.lag.values())][-keep:]
    return out


# ------------------------------------------------------------------ I/O


async def _get_json(kv, key: str) -> dict[str, Any] | None:
    raw = await kv.get(key)
    try:
        value = json.loads(raw or b"null")
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def watch(settings: NatsSettings, p: Pipeline, data_dir: str | Path, *,
                heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT, startup_grace: float = DEFAULT_STARTUP_GRACE,
                lag_growth_runs: int = DEFAULT_LAG_GROWTH_RUNS, launch: LaunchRecord | None = None,
                now: float | None = None) -> WatchReport:
    """Look at pipeline ``p`` once, judge it and record this run's lag samples (module docstring).

    A pipeline whose status bucket does not exist (never provisioned) is ``idle``.
    Raises :class:`isbflow.isb.connect.IsbUnreachable` when the ISB service cannot be reached.
    """

    alive = launch.alive() if launch is not None else None  # before the heartbeats are read
    nc = await connect(settings, name=f"isbflow-watchdog-{p.name}")
    try:
        try:
            kv = await open_kv(nc, naming.status_bucket(p.name))
        except BucketMissing:
            return WatchReport(p.name)
        statuses = await all_status(nc, p.name, p.topological_order())
        now = time.time() if now is None else now
        watched = any(s is not None and str(s.state) in WATCHED for s in statuses.values())
        lost = await detect_loss(nc, p, Path(data_dir)) if watched else []
        history = next_history(await _get_json(kv, WATCHDOG_KEY), statuses, now, lag_growth_runs + 1)
        report = judge(p.name, statuses, now, history=history, lost=lost, launch=launch, launch_alive=alive,
                       heartbeat_timeout=heartbeat_timeout, startup_grace=startup_grace,
                       lag_growth_runs=lag_growth_runs)
        recovery = await _get_json(kv, RECOVERY_KEY)
        report.recovery_running = is_running(recovery, now)
        await kv.put(WATCHDOG_KEY, json.dumps({"at": now, "lag": history, "state": report.state,
                                               "findings": [f.kind for f in report.findings]}).encode())
        return report
    finally:
        await nc.close()
