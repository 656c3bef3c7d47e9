"""Offline proof: which source ranges a Delta sink holds completely and exactly once, from the table alone.

No ISB service, no Spark: :func:`verify_table` reads the table's commit log and
the ``_isb_id`` column of its current version (delta-rs and pyarrow).

Every commit isbflow makes to a sink with ``_isb_id`` records the source offsets
it wrote in its ``isb.offsets`` metadata (:mod:`isbflow.isb.ledger`). Replaying
the history oldest first gives the **claimed** ranges per source partition:

- a commit with ``isb.offsets`` (a micro-batch, a recovery merge) adds its ranges;
- a reprocess commit (``isb.operation: replace_keys`` with ``isb.offsets``)
  replaces its range by the ids it wrote there (the new code may emit fewer);
- table maintenance (``OPTIMIZE``, ``VACUUM``, the fold) changes no data;
- a fold (:mod:`isbflow.sinks.delta_log`) stands for the commits it covers,
  which maintenance may have removed from the log: the replay starts from the
  newest fold's claim and foreign commits (:func:`isbflow.sinks.delta_log.replay_claims`);
- any other commit was made **outside isbflow** (no ledger metadata): it fails
  the proof, named with its version and operation and the ranges it touched,
  from the ids of the files it added and removed: rows added, rows removed, and
  rows rewritten (possibly changed) when the files are still there.

The current data is then compared with the claim: claimed offsets the table
lacks (rows deleted), offsets the table holds that no isbflow commit recorded
(rows added outside isbflow), and ids held more than once fail, each named by
its ranges. What remains, claimed and held exactly once and untouched by a
foreign commit, is **proven**. Gaps between claimed ranges are outside the proof:
offline, a dead letter, a record still in flight and a record never written look
the same (``quality run`` judges them against the live ledger).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake.exceptions import TableNotFoundError

from isbflow.isb import ledger
from isbflow.isb.ledger import ID_COLUMN, PartitionRanges
from isbflow.local.delta import load_table, table_history
from isbflow.sinks.delta_log import ForeignCommit, replay_claims, subtract

__all__ = ["ForeignCommit", "Verification", "VerifyError", "verify_table"]

SAMPLE_RANGES = 5


class VerifyError(Exception):
    """The table cannot be verified at all (none there, no ``_isb_id`` column)."""


@dataclass
class Verification:
    """The proof for one table; ``ok`` when nothing failed."""

    path: str
    version: int
    rows: int
    claimed: PartitionRanges
    proven: PartitionRanges
    missing: PartitionRanges = field(default_factory=dict)  # claimed, not held: rows deleted
    unrecorded: PartitionRanges = field(default_factory=dict)  # held, never claimed: rows added outside
    duplicated: PartitionRanges = field(default_factory=dict)  # ids held more than once
    surplus_rows: int = 0  # rows less distinct ids
    malformed_ids: int = 0
    foreign: list[ForeignCommit] = field(default_factory=list)
    commits: int = 0

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unrecorded or self.duplicated or self.foreign or self.malformed_ids)

    def problems(self) -> list[str]:
        """One line per failure, naming the ranges (the first few of each)."""
        out = []
        for c in self.foreign:
            touched = "; ".join(f"{what} {_describe(r)}" for what, r in
                                (("added", c.added), ("removed", c.removed), ("rewrote", c.rewritten)) if r)
            out.append(f"version {c.version} ({c.operation}) was committed outside isbflow (no ledger metadata)"
                       + (f": {touched}" if touched else "" if c.added is not None else ": its files are gone"))
        if self.missing:
            out.append(f"{_count(self.missing)} offset(s) recorded as committed are not in the table "
                       f"(rows deleted): {_describe(self.missing)}")
        if self.unrecorded:
            out.append(f"{_count(self.unrecorded)} offset(s) in the table no isbflow commit recorded: "
                       f"{_describe(self.unrecorded)}")
        if self.duplicated:
            out.append(f"{_count(self.duplicated)} id(s) held more than once ({self.surplus_rows} surplus row(s)): "
                       f"{_describe(self.duplicated)}")
        if self.malformed_ids:
            out.append(f"{self.malformed_ids} row(s) whose _isb_id is not <source>/<partition>/<seq>")
        return out

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "version": self.version, "rows": self.rows, "ok": self.ok,
                "commits": self.commits, "claimed": self.claimed, "proven": self.proven, "missing": self.missing,
                "unrecorded": self.unrecorded, "duplicated": self.duplicated, "surplus_rows": self.surplus_rows,
                "malformed_ids": self.malformed_ids, "foreign_commits": [c.to_json() for c in self.foreign],
                "problems": self.problems()}


def _count(ranges: PartitionRanges) -> int:
    return sum(ledger.count(r) for r in ranges.values())


def _describe(ranges: PartitionRanges) -> str:
    parts = []
    for part, rs in ranges.items():
        shown = ", ".join(f"{a}" if a == b else f"{a}..{b}" for a, b in rs[:SAMPLE_RANGES])
        more = f" and {len(rs) - SAMPLE_RANGES} more range(s)" if len(rs) > SAMPLE_RANGES else ""
        parts.append(f"{part} {shown}{more}")
    return "; ".join(parts)


# ------------------------------------------------------------------ reading the table


def _current_ids(table):
    """The ``_isb_id`` column of the table's current version (the Parquet files it lists, pyarrow)."""
    uris = table.file_uris()
    if not uris:
        return pa.chunked_array([], pa.string())
    files = [u.removeprefix("file://") for u in uris]
    return pq.ParquetDataset(files).read(columns=[ID_COLUMN]).column(ID_COLUMN).cast(pa.string())


def verify_table(path: str | Path) -> Verification:
    """The proof for the Delta table at ``path`` (module docstring)."""
    root = Path(path)
    try:
        table = load_table(str(root))
    except TableNotFoundError:
        raise VerifyError(f"no Delta table at {root}: the sink has not committed a batch yet") from None
    names = [f.name for f in table.schema().fields]
    if ID_COLUMN not in names:
        raise VerifyError(f"{root}: the table has no {ID_COLUMN} column; there are no source offsets to prove")
    version = table.version()
    try:
        claims = replay_claims(root, table_history(table))
    except ledger.LogTruncated as e:
        raise VerifyError(f"{root}: {e}") from None
    claimed, foreign = claims.claimed, claims.foreign

    ids = _current_ids(table)
    held = ledger.id_ranges(ids)
    malformed = len(ids) - int(pc.sum(pc.fill_null(pc.match_substring_regex(ids, r"^.+/\d+/\d+$"), False))
                                 .as_py() or 0)
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    duplicated = ledger.id_ranges(repeated.field("values"))
    surplus = int(pc.sum(pc.subtract(repeated.field("counts"), 1)).as_py() or 0) if len(repeated) else 0
    missing = subtract(claimed, held)
    unrecorded = subtract(held, claimed)
    touched_by_foreign = ledger.union(*(r for c in foreign for r in (c.added, c.removed) if r))
    proven = subtract(subtract(subtract(claimed, missing), duplicated), touched_by_foreign)
    return Verification(str(root), version, len(ids), claimed, proven, missing, unrecorded, duplicated, surplus,
                        malformed, foreign, claims.commits)
