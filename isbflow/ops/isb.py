"""The buffer verbs: apply a spec's buffers, diff them, show their state, delete them.

Called by ``isbflow isb ...``, the ``isb_provision`` DAG's operator and the pipeline verbs.
Synchronous wrappers of :mod:`isbflow.isb.provision` (see it for the contract).
"""

from __future__ import annotations

import asyncio

from isbflow.isb import provision
from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings
from isbflow.isb.provision import (
    Action,
    Drift,
    ProvisionError,
    ProvisionReport,
    StreamStatus,
    desired_resources,
)
from isbflow.spec import Specs

__all__ = ["Action", "Drift", "ProvisionError", "ProvisionReport", "StreamStatus", "Unreachable", "apply",
           "delete", "diff", "planned_count", "status"]


def apply(settings: NatsSettings, specs: Specs, pipeline: str | None = None, *, recreate: bool = False,
          force: bool = False) -> ProvisionReport:
    """Make the server hold the buffers the spec asks for (idempotent)."""
    return asyncio.run(provision.apply(settings, specs, pipeline, recreate=recreate, force=force))


def diff(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[Drift]:
    return asyncio.run(provision.diff(settings, specs, pipeline))


def status(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[StreamStatus]:
    return asyncio.run(provision.status(settings, specs, pipeline))


def delete(settings: NatsSettings, specs: Specs, pipeline: str | None = None) -> list[str]:
    return asyncio.run(provision.delete(settings, specs, pipeline))


def planned_count(specs: Specs, pipeline: str | None = None) -> int:
    """How many streams and buckets the pipeline owns."""
    return len(desired_resources(specs, pipeline))
