"""Delta sink maintenance: compaction (OPTIMIZE) and VACUUM with a retention floor, safe beside a running stream.

A streaming sink commits one or more small files per micro-batch, so a long run
makes a table of very many small files: every reader, and every commit (delta-rs
loads the table's snapshot to commit), pays per file. :func:`maintain_table`
bounds that on a schedule (``isbflow sink maintain``, the ``sink_maintenance``
DAG):

1. **compact** (:func:`compact_table`, delta-rs ``optimize.compact()``): small
   files are rewritten into files of about ``target_size`` (delta-rs' default,
   100 MiB) in one ``OPTIMIZE`` commit (``dataChange: false``; custom metadata
   ``isb.maintenance: compact``). The rows are unchanged, so the offset ledger
   is too: the commit carries no ``isb.offsets``, :func:`isbflow.isb.ledger.from_delta_history`
   adds nothing for it, and ``quality verify`` counts ``OPTIMIZE`` as a commit
   that changes no data. The app transactions stay in the log's snapshot, so a
   replayed batch is still recognised after a compaction.
2. **vacuum** (:func:`vacuum_table`, delta-rs ``vacuum()``): data files that
   the log removed (by a compaction, a merge, a reprocess) more than
   ``retention_hours`` ago are deleted. Default and floor
   :data:`DEFAULT_RETENTION_HOURS` = 168 h (7 days, Delta's own
   ``delta.deletedFileRetentionDuration``): a reader still on an older
   snapshot, time travel to a version a quality report cites, and
   ``quality verify``'s look at a reprocess commit's files all need the
   removed files for that long. Below the floor only with ``force``.
   Only files the log removed are deleted (delta-rs' default "lite" vacuum):
   files a running stream's tasks have written but the driver has not committed
   yet are never touched, nor the sink's ``_isb_pending`` markers.

**Beside a running stream.** Both commit through delta-rs' optimistic
concurrency: a compaction that finds a newer version (the stream appended a
batch meanwhile) checks it for conflicts and commits on top of it, because an
append only adds files and the compaction removes only files it read; the
stream's next append likewise commits on top of the compaction. A concurrent
commit that removed a file the compaction rewrote (a merge or reprocess of the
same files) makes the compaction fail with a conflict, changing nothing: run
it again (the schedule does).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from deltalake import CommitProperties, DeltaTable

from isbflow.sinks.delta_files import DeltaSinkError
from isbflow.sinks.delta_merge import open_table

#: the vacuum retention used when none is given, and the lowest allowed without ``force`` (module docstring)
DEFAULT_RETENTION_HOURS = 168
#: custom metadata of isbflow's compaction commits
MAINTENANCE_KEY = "isb.maintenance"


class MaintenanceError(DeltaSinkError):
    """A table cannot be maintained as asked (retention below the floor, a conflict); the message says why."""


@dataclass
class TableMaintenance:
    """What :func:`maintain_table` did to one table (or would do, with ``dry_run``)."""

    path: str
    dry_run: bool
    version_before: int | None
    version_after: int | None = None
    files_before: int = 0
    files_after: int = 0
    compacted: dict[str, Any] = field(default_factory=dict)  # delta-rs' optimize metrics
    vacuumed: list[str] = field(default_factory=list)  # files deleted (or, dry run, that would be)
    retention_hours: int = DEFAULT_RETENTION_HOURS
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["vacuumed"] = len(self.vacuumed)
        return d


def check_retention(retention_hours: int, force: bool = False) -> int:
    """``retention_hours`` when allowed: at least :data:`DEFAULT_RETENTION_HOURS`, or any >= 0 with ``force``."""
    if retention_hours < 0:
        raise MaintenanceError(f"retention must be >= 0 hours, got {retention_hours}")
    if retention_hours < DEFAULT_RETENTION_HOURS and not force:
        raise MaintenanceError(
            f"retention {retention_hours} h is below the floor of {DEFAULT_RETENTION_HOURS} h: readers on an "
            "older snapshot, time travel to versions quality reports cite, and 'quality verify' need removed "
            "files that long; pass --force to go below it anyway")
    return retention_hours


def compact_table(table: DeltaTable, target_size: int | None = None) -> dict[str, Any]:
    """One ``OPTIMIZE`` commit rewriting small files (module docstring); delta-rs' metrics."""
    try:
        return table.optimize.compact(
            target_size=target_size,
            commit_properties=CommitProperties(custom_metadata={MAINTENANCE_KEY: "compact"}))
    except Exception as e:  # delta-rs raises its own CommitFailedError / DeltaError kinds
        raise MaintenanceError(f"compacting {table.table_uri} failed ({e}); nothing was changed, run it "
                               "again (a concurrent rewrite of the same files conflicts)") from e


def vacuum_table(table: DeltaTable, retention_hours: int, dry_run: bool, force: bool = False) -> list[str]:
    """Delete files the log removed more than ``retention_hours`` ago (module docstring); their paths."""
    check_retention(retention_hours, force)
    return table.vacuum(retention_hours=retention_hours, dry_run=dry_run,
                        enforce_retention_duration=retention_hours >= DEFAULT_RETENTION_HOURS)


def maintain_table(path: str, retention_hours: int = DEFAULT_RETENTION_HOURS, *, dry_run: bool = False,
                   force: bool = False, target_size: int | None = None) -> TableMaintenance:
    """Compact, then vacuum, the Delta table at ``path`` (module docstring). ``dry_run`` changes
    nothing and lists what vacuum would delete (compaction has no dry run: the files it would
    rewrite are counted in ``files_before``)."""
    check_retention(retention_hours, force)
    table = open_table(path)
    if table is None:
        return TableMaintenance(path, dry_run, None, retention_hours=retention_hours,
                                skipped="no Delta table yet (the sink has committed nothing)")
    out = TableMaintenance(path, dry_run, table.version(), files_before=len(table.file_uris()),
                           retention_hours=retention_hours)
    if not dry_run:
        out.compacted = compact_table(table, target_size)
        table = DeltaTable(path)
    out.vacuumed = vacuum_table(table, retention_hours, dry_run, force)
    if not dry_run:
        table = DeltaTable(path)
    out.version_after, out.files_after = table.version(), len(table.file_uris())
    return out
