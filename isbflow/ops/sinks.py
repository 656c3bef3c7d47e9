"""The sinks as the faces see them: each sink table's path and current Delta version, and their
scheduled maintenance (compaction and vacuum, :mod:`isbflow.sinks.maintain`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from isbflow.sinks.delta import sink_version
from isbflow.sinks.maintain import (
    DEFAULT_RETENTION_HOURS,
    MaintenanceError,
    TableMaintenance,
    check_retention,
    maintain_table,
)
from isbflow.sinks.tables import sink_table_path
from isbflow.spec.models import Pipeline

__all__ = ["DEFAULT_RETENTION_HOURS", "MaintenanceError", "TableMaintenance", "check_retention", "maintain_sinks",
           "sink_table_path", "sink_tables", "sink_version"]


def sink_tables(pipeline: Pipeline, data_dir: str | Path) -> list[tuple[str, str, int | None]]:
    """``(sink, table path, current version or None when the table does not exist yet)`` per sink."""
    out = []
    for v in pipeline.spec.vertices:
        if v.sink is not None and v.sink.delta is not None:  # PostgreSQL sinks have no Delta table
            path = sink_table_path(pipeline, v.name, data_dir)
            out.append((v.name, path, sink_version(path)))
    return out


def maintain_sinks(pipeline: Pipeline, data_dir: str | Path, sinks: Sequence[str] | None = None, *,
                   retention_hours: int = DEFAULT_RETENTION_HOURS, dry_run: bool = False,
                   force: bool = False) -> dict[str, TableMaintenance]:
    """Compact, then vacuum, each sink's Delta table (default: every sink of ``pipeline``); per sink
    what was done. Raises :class:`MaintenanceError` for an unknown sink or a retention below the
    floor without ``force``, before any table is touched."""
    names = [v.name for v in pipeline.spec.vertices if v.sink is not None and v.sink.delta is not None]
    unknown = [s for s in sinks or [] if s not in names]
    if unknown:
        raise MaintenanceError(f"pipeline {pipeline.name!r} has no sink {', '.join(unknown)} "
                               f"(sinks: {', '.join(names)})")
    check_retention(retention_hours, force)
    return {s: maintain_table(sink_table_path(pipeline, s, data_dir), retention_hours, dry_run=dry_run,
                              force=force)
            for s in (list(sinks) if sinks else names)}
