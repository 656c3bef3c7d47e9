"""Where the ISB service is and how to reach it, for the faces (CLI, Airflow, platform).

The settings types and their resolution live in :mod:`isbflow.isb.connect`;
this is the use-case layer's view of them, so no face reaches below ``ops/``.
:func:`resolve_settings` refuses a service its pipelines cannot run on yet
(:func:`isbflow.ops.isb_service.require_runnable`).
"""

from __future__ import annotations

from pathlib import Path

from isbflow.isb.connect import (
    IsbUnreachable,
    NatsSettings,
    connect,
    default_data_dir,
    run_with,
    session,
)
from isbflow.isb.connect import resolve_settings as resolve_any_settings
from isbflow.isb.roles import PRODUCER, READER, pipeline_user
from isbflow.ops.isb_service import require_runnable
from isbflow.spec.models import InterStepBufferService


def resolve_settings(nats_url: str | None = None, data_dir: Path | str | None = None,
                     service: InterStepBufferService | None = None, role: str | None = None) -> NatsSettings:
    """:func:`isbflow.isb.connect.resolve_settings`, after :func:`require_runnable` (a Redis service
    raises :class:`isbflow.ops.isb_service.NotRunnable`, an :class:`IsbUnreachable`: one line)."""
    require_runnable(service)
    return resolve_any_settings(nats_url, data_dir, service, role=role)


__all__ = ["PRODUCER", "READER", "IsbUnreachable", "NatsSettings", "connect", "default_data_dir", "pipeline_user",
           "resolve_settings", "run_with", "session"]
