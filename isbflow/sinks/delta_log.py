"""A Delta sink's commit log, bounded without losing the proof it holds.

Every commit is one JSON file in ``<table>/_delta_log``: a sink committing every
second adds 86,400 a day. delta-rs removes log files only older than the table's
``delta.logRetentionDuration`` (30 days by default), and only at a checkpoint.
But the proofs read the **whole** history: the offset ledger rebuilt from the
table and the ledger basis of quality runs (the union of the commits'
``isb.offsets``, :func:`isbflow.isb.ledger.history_offsets`), and ``quality
verify`` (the claimed ranges, replayed oldest first with reprocess commits
replacing their range, and the commits made outside isbflow; :func:`replay_claims`).
Removing old log files as they are would make them forget old ranges.

:func:`bound_log` (``isbflow sink maintain``: :func:`fold_log` before the
compaction and the vacuum, :func:`trim_log` after them) therefore, at the
table's version ``V``:

1. sets ``delta.logRetentionDuration`` (the chosen retention) and
   ``delta.enableExpiredLogCleanup = false`` unless the table has them (the
   stream creates its tables with the default's, :data:`TABLE_CONFIGURATION`):
   delta-rs' own post-commit hook would otherwise remove expired log files at
   every automatic checkpoint (every 100 commits) with nothing folded; from then
   on only this function removes log files, and it folds first. A property
   change is a metadata commit, which fails a concurrent append with "Metadata
   changed"; the stream's commit then commits again on the new metadata
   (:mod:`isbflow.sinks.delta_commit`);
2. **folds** the history up to ``V`` into one commit with no files (operation
   ``WRITE``, ``isb.maintenance: fold``) whose metadata carries what every
   reader derives from those commits: ``isb.fold.through`` = ``V``,
   ``isb.fold.offsets`` (the union of their ``isb.offsets``), ``isb.fold.claimed``
   (verify's claim after them), ``isb.fold.foreign`` (the commits among them made
   outside isbflow, with the ranges they touched) and ``isb.fold.commits`` (how
   many). Folds are cumulative: each starts from the previous one. Readers start
   from the newest fold whose ``through`` is at or before the version they read
   and add the commits after it, so they answer the same before and after;
3. writes a checkpoint at version ``V + 1`` (the fold, or a stream commit that
   landed between reading ``V`` and the fold) and removes the log files before
   it that are older than the retention (delta-rs ``create_checkpoint`` and
   ``cleanup_metadata`` on the table loaded at ``V + 1``): everything removed is
   at or before ``V``, so covered by the fold, which is kept.

**Retention.** Default and floor :data:`DEFAULT_LOG_RETENTION_HOURS` = 168 h, the
vacuum's retention (:data:`isbflow.sinks.maintain.DEFAULT_RETENTION_HOURS`): time
travel to a version needs both its log and its data files; vacuum keeps removed
data files 168 h, so a longer log buys no time travel and a shorter one loses
versions whose files are still there (a version a quality report cites).
A bound follows: the log holds at most the commits of the last 168 h plus those
since the last maintenance, and one checkpoint per maintenance. Below the floor
only with ``force`` (the soak benchmark and tests use minutes or zero).
Versions older than the retention can no longer be loaded or time-travelled to.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties
from deltalake.exceptions import CommitFailedError

from isbflow.isb import ledger
from isbflow.isb.ledger import ID_COLUMN, PartitionRanges
from isbflow.local import delta_sidecar
from isbflow.local.delta import load_table, table_history

_log = logging.getLogger(__name__)

#: the log retention used when none is given, and the lowest allowed without ``force`` (module docstring)
DEFAULT_LOG_RETENTION_HOURS = 168
#: the vacuum retention used when none is given (:data:`isbflow.sinks.maintain.DEFAULT_RETENTION_HOURS`)
DEFAULT_VACUUM_HOURS = 168
#: custom metadata naming isbflow's maintenance commits (compaction, fold, table properties)
MAINTENANCE_KEY = "isb.maintenance"
FOLD_CLAIMED_KEY = "isb.fold.claimed"
FOLD_FOREIGN_KEY = "isb.fold.foreign"
FOLD_COMMITS_KEY = "isb.fold.commits"


def tombstone_hours(vacuum_hours: float, log_hours: float) -> float:
    """How long a checkpoint keeps the tombstone (``remove`` action) of a removed file:
    ``delta.deletedFileRetentionDuration``. A checkpoint carries every unexpired tombstone, so
    with Delta's default (7 days) a sink compacted every few minutes grows its checkpoints for a
    week. It is the vacuum retention plus the log retention: the vacuum lists what to delete
    from the tombstones, and a maintenance schedule that bounds the log runs at least once per
    log retention, so every removed file is vacuumed before its tombstone expires."""
    return vacuum_hours + log_hours


def _interval(hours: float) -> str:
    return f"interval {round(hours * 3600)} seconds"


#: table properties of the sink tables the stream creates: the default log and tombstone retentions,
#: and only :func:`bound_log` removes log files (so maintenance at the defaults changes no table metadata)
TABLE_CONFIGURATION = {"delta.logRetentionDuration": _interval(DEFAULT_LOG_RETENTION_HOURS),
                       "delta.enableExpiredLogCleanup": "false",
                       "delta.deletedFileRetentionDuration": _interval(
                           tombstone_hours(DEFAULT_VACUUM_HOURS, DEFAULT_LOG_RETENTION_HOURS))}
#: operations that rewrite files without changing the data
MAINTENANCE_OPERATIONS = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END"})
REPROCESS_OPERATION = "replace_keys"


class LogRetentionError(ValueError):
    """A log retention below the floor without ``force``, or negative."""


@dataclass
class ForeignCommit:
    """A commit without ledger metadata: made outside isbflow."""

    version: int
    operation: str
    timestamp: int | None
    #: per source partition: offsets of rows it added / removed / rewrote (None: its files are gone)
    added: PartitionRanges | None = None
    removed: PartitionRanges | None = None
    rewritten: PartitionRanges | None = None

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "operation": self.operation, "timestamp": self.timestamp,
                "added": self.added, "removed": self.removed, "rewritten": self.rewritten}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ForeignCommit:
        return cls(int(d["version"]), str(d["operation"]), d.get("timestamp"), d.get("added"), d.get("removed"),
                   d.get("rewritten"))


@dataclass
class Claims:
    """What a history claims: the ranges isbflow's commits recorded, the foreign commits, how many commits."""

    claimed: PartitionRanges = field(default_factory=dict)
    foreign: list[ForeignCommit] = field(default_factory=list)
    commits: int = 0


def subtract(a: PartitionRanges, b: PartitionRanges) -> PartitionRanges:
    """The offsets of ``a`` not in ``b``, per source partition."""
    out = {p: ledger.difference(r, b.get(p, [])) for p, r in a.items()}
    return {p: r for p, r in out.items() if r}


def intersection(a: PartitionRanges, b: PartitionRanges) -> PartitionRanges:
    """The offsets in both, per source partition."""
    return subtract(a, subtract(a, b))


def replay_claims(root: Path, history: list[dict[str, Any]], version: int | None = None,
                  strict: bool = True) -> Claims:
    """The claim of the commits of ``history`` up to ``version`` (all when None), replayed oldest
    first from the newest fold that covers only such commits (module docstring; the rules are
    :mod:`isbflow.quality.verify`'s). Raises :class:`isbflow.isb.ledger.LogTruncated` when the
    history no longer reaches back that far (unless not ``strict``)."""
    fold, through = ledger.newest_fold(history, version, strict)
    out = Claims()
    if fold is not None:
        out = Claims(ledger.from_metadata(fold.get(FOLD_CLAIMED_KEY)),
                     [ForeignCommit.from_json(c) for c in json.loads(fold.get(FOLD_FOREIGN_KEY) or "[]")],
                     int(fold.get(FOLD_COMMITS_KEY) or 0))
    for h in sorted(history, key=lambda h: int(h.get("version", 0))):
        v = int(h.get("version", 0))
        if v <= through or (version is not None and v > version):
            continue
        out.commits += 1
        op = str(h.get("operation", ""))
        if ledger.OFFSETS_KEY in h:
            ranges = ledger.from_metadata(h.get(ledger.OFFSETS_KEY))
            if h.get("isb.operation") == REPROCESS_OPERATION:
                touched = _touched(root, v)
                if touched is not None:  # the range now holds what the new code wrote there
                    written = ledger.union(touched[0], touched[2])
                    out.claimed = ledger.union(subtract(out.claimed, ranges), intersection(written, ranges))
                    continue
            out.claimed = ledger.union(out.claimed, ranges)
        elif op in MAINTENANCE_OPERATIONS or any(k.startswith("isb.") for k in h):
            continue  # no data change, or an isbflow commit that records no offsets (windows, upserts, folds)
        else:
            touched = _touched(root, v)
            out.foreign.append(ForeignCommit(v, op, h.get("timestamp"), *(touched or (None, None, None))))
    return out


def log_actions(path: Path, version: int) -> tuple[list[str], list[str]] | None:
    """(files added, files removed) by commit ``version`` from its JSON log entry; None when gone."""
    entry = path / "_delta_log" / f"{version:020d}.json"
    if not entry.is_file():
        return None
    added, removed = [], []
    for line in entry.read_text(encoding="utf-8").split("\n"):  # JSON lines: not str.splitlines, which
        try:                                                        # also cuts at U+2028 inside a string
            action = json.loads(line)
        except ValueError:
            continue
        if "add" in action:
            added.append(action["add"]["path"])
        elif "remove" in action:
            removed.append(action["remove"]["path"])
    return added, removed


def _file_ids(path: Path, files: list[str]):
    """The ``_isb_id`` column of data files (pyarrow), or None when one of them is gone."""
    arrays = []
    for f in files:
        p = path / unquote(f)
        if not p.is_file():
            return None
        arrays.append(pq.read_table(p, columns=[ID_COLUMN]).column(ID_COLUMN).cast(pa.string()))
    return pa.chunked_array([c for a in arrays for c in a.chunks], pa.string())


def _touched(path: Path, version: int) -> tuple[PartitionRanges, PartitionRanges, PartitionRanges] | None:
    """(offsets added, removed, rewritten) by commit ``version``; None when its log entry or files are gone."""
    actions = log_actions(path, version)
    if actions is None:
        return None
    added_ids, removed_ids = _file_ids(path, actions[0]), _file_ids(path, actions[1])
    if added_ids is None or removed_ids is None:
        return None
    added, removed = ledger.id_ranges(added_ids), ledger.id_ranges(removed_ids)
    return subtract(added, removed), subtract(removed, added), intersection(added, removed)


# ------------------------------------------------------------------ bounding the log


@dataclass
class LogCleanup:
    """What :func:`bound_log` did to one table's log."""

    folded_through: int  # the last version the fold covers
    files_before: int
    files_after: int
    retention_hours: float


def check_log_retention(hours: float, force: bool = False) -> float:
    """``hours`` when allowed: at least :data:`DEFAULT_LOG_RETENTION_HOURS`, or any >= 0 with ``force``."""
    if hours < 0:
        raise LogRetentionError(f"log retention must be >= 0 hours, got {hours}")
    if hours < DEFAULT_LOG_RETENTION_HOURS and not force:
        raise LogRetentionError(
            f"log retention {hours:g} h is below the floor of {DEFAULT_LOG_RETENTION_HOURS} h (the vacuum's: "
            "time travel to a version needs its log as long as vacuum keeps its files); pass --force to go "
            "below it anyway")
    return hours


def log_files(path: str | Path) -> int:
    """How many files the table's ``_delta_log`` holds (commits, checkpoints, ``_last_checkpoint``)."""
    log = Path(path) / "_delta_log"
    return sum(1 for _ in log.iterdir()) if log.is_dir() else 0


def retention_properties(hours: float, vacuum_hours: float = DEFAULT_VACUUM_HOURS) -> dict[str, str]:
    """The table properties :func:`bound_log` sets for a log retention of ``hours`` and a vacuum
    retention of ``vacuum_hours`` (the tombstones': :func:`tombstone_hours`)."""
    return {**TABLE_CONFIGURATION, "delta.logRetentionDuration": _interval(hours),
            "delta.deletedFileRetentionDuration": _interval(tombstone_hours(vacuum_hours, hours))}


#: commits of a fold tried when a live writer commits between loading the table and the fold's commit
FOLD_ATTEMPTS = 5


def fold_log(path: str, retention_hours: float = DEFAULT_LOG_RETENTION_HOURS, *, force: bool = False,
             vacuum_hours: float = DEFAULT_VACUUM_HOURS) -> int:
    """Steps 1 and 2 of the module docstring: set the log retention, fold the history of the Delta
    table at ``path`` into one commit; the last version the fold covers. Run it before a vacuum that
    may delete files a reprocess or foreign commit touched (verify's claim reads them)."""
    check_log_retention(retention_hours, force)
    table = load_table(path)
    wanted = retention_properties(retention_hours, vacuum_hours)
    if any(table.metadata().configuration.get(k) != v for k, v in wanted.items()):
        table.alter.set_table_properties(wanted, commit_properties=CommitProperties(
            custom_metadata={MAINTENANCE_KEY: "log-retention"}))
    table = load_table(path)
    version = table.version()
    history = table_history(table)
    try:
        ledger.newest_fold(history, version)
    except ledger.LogTruncated as e:  # cleaned outside isbflow's maintenance: keep what is left
        _log.warning("%s: %s; folding the commits the log still holds", path, e)
    has_ids = ID_COLUMN in [f.name for f in table.schema().fields]
    claims = replay_claims(Path(path), history, version, strict=False) if has_ids else Claims(commits=len(history))
    fold = {MAINTENANCE_KEY: "fold", ledger.FOLD_THROUGH_KEY: str(version),
            ledger.FOLD_OFFSETS_KEY: ledger.to_metadata(ledger.history_offsets(history, version, strict=False)),
            FOLD_CLAIMED_KEY: ledger.to_metadata(claims.claimed),
            FOLD_FOREIGN_KEY: json.dumps([c.to_json() for c in claims.foreign], separators=(",", ":")),
            FOLD_COMMITS_KEY: str(claims.commits)}
    big = {k: fold[k] for k in (ledger.FOLD_OFFSETS_KEY, FOLD_CLAIMED_KEY)}
    if sum(map(len, big.values())) > delta_sidecar.INLINE_BYTES and Path(path).is_dir():
        # a sink fed by a filtering edge: one range per record; beside the log, not in it
        fold = {k: v for k, v in fold.items() if k not in big} | delta_sidecar.write(Path(path), str(version), big)
    for attempt in range(1, FOLD_ATTEMPTS + 1):
        try:
            # the fold's commit on the newest table: what it covers is through ``version`` whatever
            # version it lands at (commits after it stay in the log; trim_log keeps them)
            latest = load_table(path)
            latest.create_write_transaction([], mode="append", schema=latest.schema(),
                                            partition_by=list(latest.metadata().partition_columns) or None,
                                            commit_properties=CommitProperties(custom_metadata=fold))
            return version
        except CommitFailedError as e:
            # a live sink committed between loading the table and the fold's commit (e.g. an
            # upsert's merge, "a concurrent transaction deleted data this operation read")
            if attempt == FOLD_ATTEMPTS:
                raise
            _log.info("%s: the fold's commit met a concurrent commit (%s); committing it again", path, e)
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


def trim_log(path: str, folded_through: int) -> None:
    """Step 3 of the module docstring: checkpoint at ``folded_through + 1`` and remove the log files
    before it that are older than the table's log retention (all covered by the fold)."""
    at = load_table(path, version=folded_through + 1)  # the fold or a commit after V: all before it are folded
    at.create_checkpoint()
    at.cleanup_metadata()
    if Path(path).is_dir():  # the folds' files no commit of the log names any more
        delta_sidecar.prune(Path(path), [h.get(delta_sidecar.FILE_KEY) for h in table_history(load_table(path))])


def bound_log(path: str, retention_hours: float = DEFAULT_LOG_RETENTION_HOURS, *,
              force: bool = False, vacuum_hours: float = DEFAULT_VACUUM_HOURS) -> LogCleanup:
    """Fold the history of the Delta table at ``path``, checkpoint it and remove log files older
    than ``retention_hours`` (module docstring)."""
    before = log_files(path)
    through = fold_log(path, retention_hours, force=force, vacuum_hours=vacuum_hours)
    trim_log(path, through)
    return LogCleanup(through, before, log_files(path), retention_hours)
