"""Where the ISB service is and how to reach it, for the faces (CLI, Airflow, platform).

The settings types and their resolution live in :mod:`isbflow.isb.connect`;
this is the use-case layer's view of them, so no face reaches below ``ops/``.
"""

from __future__ import annotations

from isbflow.isb.connect import (
    IsbSettings,
    IsbUnreachable,
    NatsSettings,
    RedisSettings,
    connect,
    default_data_dir,
    resolve_settings,
    run_with,
    session,
)
from isbflow.isb.roles import PRODUCER, READER, pipeline_user

__all__ = ["PRODUCER", "READER", "IsbSettings", "IsbUnreachable", "NatsSettings", "RedisSettings", "connect",
           "default_data_dir", "pipeline_user", "resolve_settings", "run_with", "session"]
