"""The sinks as the faces see them: each sink table's path and current Delta version, and their
scheduled maintenance (compaction, vacuum and a bounded log, :mod:`isbflow.sinks.maintain`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from isbflow.sinks.delta import sink_version
from isbflow.sinks.maintain import (
    DEFAULT_LOG_RETENTION_HOURS,
    DEFAULT_RETENTION_HOURS,
    MaintenanceError,
    TableMaintenance,
    check_retention,
    maintain_table,
)
from isbflow.sinks.tables import sink_table_path
from isbflow.spec.models import Pipeline

__all__ = ["DEFAULT_LOG_RETENTION_HOURS", "DEFAULT_RETENTION_HOURS", "MaintenanceError", "TableMaintenance", "check_retention", "maintain_sinks",
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
                   force: bool = False,
                   log_retention_hours: float = DEFAULT_LOG_RETENTION_HOURS) -> dict[str, TableMaintenance]:
    """Compact, vacuum, then bound the log of each sink's Delta table (default: every sink of ``pipeline``); per sink
    what was done. Raises :class:`MaintenanceError` for an unknown sink or a retention below the
    floors without ``force``, before any table is touched."""
    names = [v.name for v in pipeline.spec.vertices if v.sink is not None and v.sink.delta is not None]
    unknown = [s for s in sinks or [] if s not in names]
    if unknown:
        raise MaintenanceError(f"pipeline {pipeline.name!r} has no sink {', '.join(unknown)} "
                               f"(sinks: {', '.join(names)})")
    check_retention(retention_hours, force, log_retention_hours)
    return {s: maintain_table(sink_table_path(pipeline, s, data_dir), retention_hours, dry_run=dry_run,
                              force=force, log_retention_hours=log_retention_hours)
            for s in (list(sinks) if sinks else names)}
