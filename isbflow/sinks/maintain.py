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
   yet are never touched, nor the sink's ``_isb_pending`` markers. delta-rs lists
   them (a dry run) and isbflow deletes them: delta-rs' own vacuum also commits a
   VACUUM START and END to the log, informational commits the protocol does not
   ask for, and the END one fails against any sink commit that removed a file in
   between (an upsert sink committing every 200 ms made a vacuum fail five
   attempts in a row); a file the log removed stays removed, so the list cannot
   go stale.
3. **bound the log** (:mod:`isbflow.sinks.delta_log`): first of all, the history
   is folded into one commit that keeps what the ledger, its quality basis and
   ``quality verify`` read from it (before the vacuum, which may delete files
   verify reads to judge a reprocess or a foreign commit); last, the log is
   checkpointed and its files older than ``log_retention_hours`` (default and
   floor 168 h, the vacuum's) are removed.

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

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote, urlparse

from deltalake import CommitProperties, DeltaTable
from deltalake.exceptions import CommitFailedError

from isbflow.local.delta import load_table, log_root
from isbflow.sinks.delta_files import DeltaSinkError
from isbflow.sinks.delta_log import (
    DEFAULT_LOG_RETENTION_HOURS,
    DEFAULT_VACUUM_HOURS,
    MAINTENANCE_KEY,
    LogRetentionError,
    check_log_retention,
    fold_log,
    log_files,
    trim_log,
)
from isbflow.sinks.delta_merge import open_table

#: the vacuum retention used when none is given, and the lowest allowed without ``force`` (module docstring)
DEFAULT_RETENTION_HOURS = DEFAULT_VACUUM_HOURS
#: compaction attempts on a live sink: a micro-batch that rewrites files the compaction read (an
#: upsert sink's merge does, every batch) fails its commit; it is run again on the new snapshot
COMPACT_ATTEMPTS = 5
T = TypeVar("T")
__all__ = ["DEFAULT_LOG_RETENTION_HOURS", "DEFAULT_RETENTION_HOURS", "MAINTENANCE_KEY", "MaintenanceError",
           "TableMaintenance", "check_retention", "compact_table", "maintain_table", "vacuum_table"]


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
    log_retention_hours: float = DEFAULT_LOG_RETENTION_HOURS
    log_files_before: int = 0  # files in _delta_log
    log_files_after: int = 0
    folded_through: int | None = None  # the last version the log's fold covers (None: not folded, dry run)
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["vacuumed"] = len(self.vacuumed)
        return d


def check_retention(retention_hours: int, force: bool = False,
                    log_retention_hours: float = DEFAULT_LOG_RETENTION_HOURS) -> int:
    """``retention_hours`` when allowed: at least :data:`DEFAULT_RETENTION_HOURS`, or any >= 0 with
    ``force``; ``log_retention_hours`` likewise (:func:`isbflow.sinks.delta_log.check_log_retention`)."""
    if retention_hours < 0:
        raise MaintenanceError(f"retention must be >= 0 hours, got {retention_hours}")
    if retention_hours < DEFAULT_RETENTION_HOURS and not force:
        raise MaintenanceError(
            f"retention {retention_hours} h is below the floor of {DEFAULT_RETENTION_HOURS} h: readers on an "
            "older snapshot, time travel to versions quality reports cite, and 'quality verify' need removed "
            "files that long; pass --force to go below it anyway")
    try:
        check_log_retention(log_retention_hours, force)
    except LogRetentionError as e:
        raise MaintenanceError(str(e)) from None
    return retention_hours


def compact_table(table: DeltaTable, target_size: int | None = None, attempts: int = COMPACT_ATTEMPTS,
                  sleep: Callable[[float], None] = time.sleep) -> dict[str, Any]:
    """One ``OPTIMIZE`` commit rewriting small files (module docstring); delta-rs' metrics.
    Run again on a fresh snapshot when a live sink's commit conflicts (:func:`_on_fresh_snapshot`)."""
    return _on_fresh_snapshot("compacting", table, lambda t: t.optimize.compact(
        target_size=target_size, commit_properties=CommitProperties(custom_metadata={MAINTENANCE_KEY: "compact"})),
        attempts, sleep)


def vacuum_table(table: DeltaTable, retention_hours: int, dry_run: bool, force: bool = False,
                 attempts: int = COMPACT_ATTEMPTS, sleep: Callable[[float], None] = time.sleep) -> list[str]:
    """Delete files the log removed more than ``retention_hours`` ago (module docstring); their paths.
    A local table's files are listed by delta-rs and deleted here, with no log commit to conflict
    with a live sink's; a table elsewhere goes through delta-rs' vacuum, run again on a fresh
    snapshot when its commits conflict (:func:`_on_fresh_snapshot`)."""
    check_retention(retention_hours, force)
    # the floor is check_retention's; delta-rs' own would refuse any retention below the table's
    # tombstone retention (the vacuum's plus the log's, delta_log.tombstone_hours)
    enforce = False
    if urlparse(table.table_uri).scheme not in ("", "file"):
        return _on_fresh_snapshot("vacuuming", table, lambda t: t.vacuum(
            retention_hours=retention_hours, dry_run=dry_run, enforce_retention_duration=enforce), attempts, sleep)
    expired = table.vacuum(retention_hours=retention_hours, dry_run=True, enforce_retention_duration=enforce)
    if dry_run:
        return expired
    root = Path(log_root(table)).parent
    deleted = []
    for rel in expired:  # module docstring: listed by delta-rs, deleted without its log commits
        path = root / rel if (root / rel).exists() else root / unquote(rel)
        try:
            path.unlink()
            deleted.append(rel)
        except FileNotFoundError:  # another vacuum took it
            pass
        except OSError as e:
            raise MaintenanceError(f"vacuuming {table.table_uri}: cannot delete {rel} ({e}); run it again") from e
    return deleted


def _on_fresh_snapshot(what: str, table: DeltaTable, action: Callable[[DeltaTable], T], attempts: int,
                       sleep: Callable[[float], None]) -> T:
    """``action(table)``. A commit that conflicts with a concurrent writer (a live sink's micro-batch
    rewrote or removed files this operation read) changes nothing; it is run again on the table's
    new snapshot after 0.5 s, 1 s, ... up to ``attempts`` times, then fails naming the table."""
    for n in range(1, attempts + 1):
        try:
            return action(table)
        except CommitFailedError as e:
            if n == attempts:
                raise MaintenanceError(f"{what} {table.table_uri} failed {attempts} times on concurrent "
                                       f"commits ({e}); nothing was changed, run it again") from e
            sleep(0.5 * n)
            table = load_table(table.table_uri)
        except Exception as e:  # delta-rs raises its own DeltaError kinds
            raise MaintenanceError(f"{what} {table.table_uri} failed ({e}); run it again") from e
    raise AssertionError("unreachable")


def maintain_table(path: str, retention_hours: int = DEFAULT_RETENTION_HOURS, *, dry_run: bool = False,
                   force: bool = False, target_size: int | None = None,
                   log_retention_hours: float = DEFAULT_LOG_RETENTION_HOURS) -> TableMaintenance:
    """Fold the log of, compact, vacuum, then trim the log of the Delta table at ``path`` (module docstring).
    ``dry_run`` changes nothing and lists what vacuum would delete (compaction has no dry run: the
    files it would rewrite are counted in ``files_before``; the log is counted, not folded)."""
    check_retention(retention_hours, force, log_retention_hours)
    table = open_table(path)
    if table is None:
        return TableMaintenance(path, dry_run, None, retention_hours=retention_hours,
                                log_retention_hours=log_retention_hours,
                                skipped="no Delta table yet (the sink has committed nothing)")
    out = TableMaintenance(path, dry_run, table.version(), files_before=len(table.file_uris()),
                           retention_hours=retention_hours, log_retention_hours=log_retention_hours,
                           log_files_before=log_files(path))
    if not dry_run:
        out.folded_through = _log_step(path, fold_log, path, log_retention_hours, force=force,
                                       vacuum_hours=retention_hours)
        out.compacted = compact_table(load_table(path), target_size)
        table = load_table(path)
    out.vacuumed = vacuum_table(table, retention_hours, dry_run, force)
    if not dry_run:
        _log_step(path, trim_log, path, out.folded_through)
        table = load_table(path)
    out.version_after, out.files_after = table.version(), len(table.file_uris())
    out.log_files_after = log_files(path)
    return out


def _log_step(path: str, step, *args, **kwargs):
    """A step of :mod:`isbflow.sinks.delta_log`, its failure worded as a :class:`MaintenanceError`."""
    try:
        return step(*args, **kwargs)
    except Exception as e:  # delta-rs raises its own CommitFailedError / DeltaError kinds
        raise MaintenanceError(f"bounding the log of {path} failed ({e}); a fold changes no data and a "
                               "clean-up removes only folded entries: run it again") from e
