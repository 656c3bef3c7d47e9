"""Watching a running pipeline: its steps' states against a target, and its lag.

Synchronous one-shot checks for sensors and the CLI; the async forms (on one
open ``session``) for Airflow triggers, which poll on the triggerer's loop.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings, run_with, session
from isbflow.isb.settings import IsbNotStarted as NotStarted
from isbflow.recovery.watchdog import DEFAULT_LAG_GROWTH_RUNS, WatchReport, watch
from isbflow.spec.models import Pipeline
from isbflow.steps.lag import pipeline_lag
from isbflow.steps.launch import (
    DEFAULT_HEARTBEAT_TIMEOUT,
    DEFAULT_STARTUP_GRACE,
    LaunchRecord,
    StateCheck,
    observe_state,
    read_launch,
)

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "DEFAULT_LAG_GROWTH_RUNS", "DEFAULT_STARTUP_GRACE", "LaunchRecord", "NotStarted", "StateCheck", "Unreachable", "lag", "observe_state", "pipeline_lag", "read_launch",
           "session", "state", "watchdog", "watched_steps"]


def watched_steps(p: Pipeline, launch: LaunchRecord | None) -> list[str]:
    """The steps a launch runs (all of the pipeline's when it runs them all, or none is known)."""
    return list(launch.steps) if launch and launch.steps else p.topological_order()


def state(settings: NatsSettings, p: Pipeline, target: str, launch: LaunchRecord | None,
          heartbeat_timeout: float, startup_grace: float, name: str = "isbflow-watch") -> StateCheck:
    """Whether every watched step reports ``target`` (or what stands in the way), from their heartbeats."""
    steps = watched_steps(p, launch)
    return run_with(settings, lambda nc: observe_state(nc, p.name, steps, target, launch, heartbeat_timeout,
                                                       startup_grace), name=name)


def lag(settings: NatsSettings, p: Pipeline, include_sources: bool = False, name: str = "isbflow-lag") -> list:
    """Each buffer's lag (messages not yet committed downstream)."""
    return run_with(settings, lambda nc: pipeline_lag(nc, p, include_sources), name=name)


def watchdog(settings: NatsSettings, p: Pipeline, data_dir: Path, *, heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
             startup_grace: float = DEFAULT_STARTUP_GRACE,
             lag_growth_runs: int = DEFAULT_LAG_GROWTH_RUNS) -> WatchReport:
    """One look at the pipeline's health (stale heartbeats, a dead driver, lost buffers, growing lag)."""
    return asyncio.run(watch(settings, p, data_dir, heartbeat_timeout=heartbeat_timeout, startup_grace=startup_grace,
                             lag_growth_runs=lag_growth_runs, launch=read_launch(data_dir, p.name)))
