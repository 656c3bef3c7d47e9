"""The sinks as the faces see them: each sink table's path and current Delta version."""

from __future__ import annotations

from pathlib import Path

from isbflow.sinks.delta import sink_version
from isbflow.sinks.tables import sink_table_path
from isbflow.spec.models import Pipeline

__all__ = ["sink_table_path", "sink_tables", "sink_version"]


def sink_tables(pipeline: Pipeline, data_dir: str | Path) -> list[tuple[str, str, int | None]]:
    """``(sink, table path, current version or None when the table does not exist yet)`` per sink."""
    out = []
    for v in pipeline.spec.vertices:
        if v.sink is not None:
            path = sink_table_path(pipeline, v.name, data_dir)
            out.append((v.name, path, sink_version(path)))
    return out
