"""Sinks as Airflow Assets, so quality runs follow the data.

Every sink is the Asset ``isbflow://<pipeline>/<sink>`` (:func:`sink_asset`).
Tasks that write sinks (drain, batch, replay) declare the asset alias
``isbflow-sinks`` (:data:`SINKS_ALIAS`) as their outlet and, when they succeed,
add one event per sink of the pipeline they ran (:func:`emit_sink_events`): the
pipeline is a trigger-form choice, so the assets cannot be named in the DAG
file. Each event's ``extra`` holds the pipeline, the sink and the Delta table
version. The ``pipeline_quality`` DAG is scheduled on every known sink asset
and checks the sinks its triggering events name (:func:`sinks_from_events`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, AssetAlias

log = logging.getLogger(__name__)

SCHEME = "isbflow"
SINKS_ALIAS = "isbflow-sinks"


def sink_uri(pipeline: str, sink: str) -> str:
    return f"{SCHEME}://{pipeline}/{sink}"


def sink_asset(pipeline: str, sink: str) -> Asset:
    """The Asset of sink vertex ``sink`` of ``pipeline`` (name and URI: ``isbflow://<pipeline>/<sink>``)."""
    return Asset(uri=sink_uri(pipeline, sink), name=sink_uri(pipeline, sink), group="isbflow")


def sinks_alias() -> AssetAlias:
    """The outlet of every task that writes sinks; events are added to it per sink at run time."""
    return AssetAlias(SINKS_ALIAS, group="isbflow")


def parse_sink_uri(uri: str) -> tuple[str, str] | None:
    """``(pipeline, sink)`` of an ``isbflow://<pipeline>/<sink>`` URI, else None."""
    prefix = f"{SCHEME}://"
    if not uri.startswith(prefix):
        return None
    pipeline, _, sink = uri[len(prefix):].partition("/")
    return (pipeline, sink) if pipeline and sink and "/" not in sink else None


def emit_sink_events(context: Mapping[str, Any], pipeline, data_dir: str | Path,
                     sinks: Iterable[str] | None = None, **extra: Any) -> list[str]:
    """Add an asset event for each sink of ``pipeline`` (a spec ``Pipeline``) whose Delta table exists.

    ``sinks`` limits the sinks (default: all). Needs the task to have the
    :func:`sinks_alias` outlet. Returns the URIs of the events added.
    """
    # lazy: ops.sinks loads pyspark and deltalake (~2 s); DAG parsing must not (it reruns every 30 s)
    from isbflow.ops.sinks import (
        sink_table_path,
        sink_version,
    )

    wanted = set(sinks) if sinks is not None else None
    accessor = context["outlet_events"][sinks_alias()]
    added = []
    for v in pipeline.spec.vertices:
        if v.sink is None or v.sink.delta is None or (wanted is not None and v.name not in wanted):
            continue
        path = sink_table_path(pipeline, v.name, data_dir)
        version = sink_version(path)
        if version is None:
            log.info("sink %s/%s has no Delta table at %s yet: no asset event", pipeline.name, v.name, path)
            continue
        accessor.add(sink_asset(pipeline.name, v.name),
                     extra={"pipeline": pipeline.name, "sink": v.name, "table_version": version, **extra})
        added.append(sink_uri(pipeline.name, v.name))
    if added:
        log.info("asset events for %s", ", ".join(added))
    return added


def sinks_from_events(events: Mapping[Any, Iterable[Any]] | None) -> dict[str, list[str]]:
    """Pipeline -> sorted sinks named by a run's ``triggering_asset_events`` (isbflow sinks only)."""
    out: dict[str, set[str]] = {}
    for asset, evs in (events or {}).items():
        uris = [getattr(asset, "uri", None), *(getattr(getattr(e, "asset", None), "uri", None) for e in evs)]
        for uri in uris:
            found = parse_sink_uri(uri) if isinstance(uri, str) else None
            if found:
                out.setdefault(found[0], set()).add(found[1])
    return {p: sorted(s) for p, s in sorted(out.items())}
