"""Offline proof: which source ranges a Delta sink holds completely and exactly once, from the table alone.

No ISB service, no Spark: :func:`verify_table` reads the table's commit log and
the ``_isb_id`` column of its current version (delta-rs and pyarrow).

Every commit isbflow makes to a sink with ``_isb_id`` records the source offsets
it wrote in its ``isb.offsets`` metadata (:mod:`isbflow.isb.ledger`). Replaying
the history oldest first gives the **claimed** ranges per source partition:

- a commit with ``isb.offsets`` (a micro-batch, a recovery merge) adds its ranges;
- a reprocess commit (``isb.operation: replace_keys`` with ``isb.offsets``)
  replaces its range by the ids it wrote there (the new code may emit fewer);
- table maintenance (``OPTIMIZE``, ``VACUUM``) changes no data;
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

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from isbflow.isb import ledger
from isbflow.isb.ledger import ID_COLUMN, PartitionRanges

#: operations that rewrite files without changing the data
MAINTENANCE = frozenset({"OPTIMIZE", "VACUUM START", "VACUUM END"})
REPROCESS_OPERATION = "replace_keys"
SAMPLE_RANGES = 5


class VerifyError(Exception):
    """The table cannot be verified at all (none there, no ``_isb_id`` column)."""


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


def _subtract(a: PartitionRanges, b: PartitionRanges) -> PartitionRanges:
    out = {p: ledger.difference(r, b.get(p, [])) for p, r in a.items()}
    return {p: r for p, r in out.items() if r}


def _intersect(a: PartitionRanges, b: PartitionRanges) -> PartitionRanges:
    return _subtract(a, _subtract(a, b))


# ------------------------------------------------------------------ reading the table


def _log_actions(path: Path, version: int) -> tuple[list[str], list[str]] | None:
    """(files added, files removed) by commit ``version`` from its JSON log entry; None when gone."""
    entry = path / "_delta_log" / f"{version:020d}.json"
    if not entry.is_file():
        return None
    added, removed = [], []
    for line in entry.read_text().splitlines():
        try:
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
    from urllib.parse import unquote

    import pyarrow as pa
    import pyarrow.parquet as pq

    arrays = []
    for f in files:
        p = path / unquote(f)
        if not p.is_file():
            return None
        arrays.append(pq.read_table(p, columns=[ID_COLUMN]).column(ID_COLUMN).cast(pa.string()))
    return pa.chunked_array([c for a in arrays for c in a.chunks], pa.string())


def _touched(path: Path, version: int) -> tuple[PartitionRanges, PartitionRanges, PartitionRanges] | None:
    """(offsets added, removed, rewritten) by commit ``version``; None when its log entry or files are gone."""
    actions = _log_actions(path, version)
    if actions is None:
        return None
    added_ids, removed_ids = _file_ids(path, actions[0]), _file_ids(path, actions[1])
    if added_ids is None or removed_ids is None:
        return None
    added, removed = ledger.id_ranges(added_ids), ledger.id_ranges(removed_ids)
    return _subtract(added, removed), _subtract(removed, added), _intersect(added, removed)


def _current_ids(table):
    """The ``_isb_id`` column of the table's current version (the Parquet files it lists, pyarrow)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    uris = table.file_uris()
    if not uris:
        return pa.chunked_array([], pa.string())
    files = [u.removeprefix("file://") for u in uris]
    return pq.ParquetDataset(files).read(columns=[ID_COLUMN]).column(ID_COLUMN).cast(pa.string())


def verify_table(path: str | Path) -> Verification:
    """The proof for the Delta table at ``path`` (module docstring)."""
    import pyarrow.compute as pc
    from deltalake import DeltaTable
    from deltalake.exceptions import TableNotFoundError

    root = Path(path)
    try:
        table = DeltaTable(str(root))
    except TableNotFoundError:
        raise VerifyError(f"no Delta table at {root}: the sink has not committed a batch yet") from None
    names = [f.name for f in table.schema().fields]
    if ID_COLUMN not in names:
        raise VerifyError(f"{root}: the table has no {ID_COLUMN} column; there are no source offsets to prove")
    version = table.version()
    history = sorted(table.history(), key=lambda h: int(h.get("version", 0)))
    claimed: PartitionRanges = {}
    foreign: list[ForeignCommit] = []
    for h in history:
        v = int(h.get("version", 0))
        op = str(h.get("operation", ""))
        if ledger.OFFSETS_KEY in h:
            ranges = ledger.from_metadata(h.get(ledger.OFFSETS_KEY))
            if h.get("isb.operation") == REPROCESS_OPERATION:
                touched = _touched(root, v)
                if touched is not None:  # the range now holds what the new code wrote there
                    written = ledger.union(touched[0], touched[2])
                    claimed = ledger.union(_subtract(claimed, ranges), _intersect(written, ranges))
                    continue
            claimed = ledger.union(claimed, ranges)
        elif op in MAINTENANCE or any(k.startswith("isb.") for k in h):
            continue  # no data change, or an isbflow commit that records no offsets (windows, upserts)
        else:
            touched = _touched(root, v)
            foreign.append(ForeignCommit(v, op, h.get("timestamp"), *(touched or (None, None, None))))

    ids = _current_ids(table)
    held = ledger.id_ranges(ids)
    malformed = len(ids) - int(pc.sum(pc.fill_null(pc.match_substring_regex(ids, r"^.+/\d+/\d+$"), False))
                                 .as_py() or 0)
    counts = pc.value_counts(ids)
    repeated = counts.filter(pc.greater(counts.field("counts"), 1))
    duplicated = ledger.id_ranges(repeated.field("values"))
    surplus = int(pc.sum(pc.subtract(repeated.field("counts"), 1)).as_py() or 0) if len(repeated) else 0
    missing = _subtract(claimed, held)
    unrecorded = _subtract(held, claimed)
    touched_by_foreign = ledger.union(*(r for c in foreign for r in (c.added, c.removed) if r))
    proven = _subtract(_subtract(_subtract(claimed, missing), duplicated), touched_by_foreign)
    return Verification(str(root), version, len(ids), claimed, proven, missing, unrecorded, duplicated, surplus,
                        malformed, foreign, len(history))
