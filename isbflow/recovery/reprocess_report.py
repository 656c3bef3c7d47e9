"""What a reprocess reports: per sink (:class:`SinkReplace`) and for the run (:class:`ReprocessReport`).

Contract: plain dataclasses, the JSON the status bucket, the CLI's ``--json`` and
the replay DAG's XCom carry (``to_json``), and ``summary()``, a few lines for a
terminal or a task log. A shadow reprocess (``state`` ``shadowed``) and its
promote (``promoted``) use the same report with ``shadow_run`` set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from isbflow.isb import ledger
from isbflow.recovery.job import Phase
from isbflow.recovery.shadow_diff import summary_line as diff_line


@dataclass
class SinkReplace:
    """What reprocess did (or, dry run, would touch) in one sink."""

    sink: str
    kind: str  # raw (rows carry _isb_id) | aggregate
    path: str = ""
    #: raw: rows of the range before; aggregate: windows (keys) of touched windows before
    rows_before: int = 0
    #: raw: rows the range produces now; aggregate: window rows recomputed
    rows_after: int = 0
    deleted: int = 0
    updated: int = 0
    inserted: int = 0
    version_before: int | None = None
    version: int | None = None
    commits: int = 0
    windows_touched: int = 0
    duplicates: int = 0
    #: raw: rows outside the range added or removed (must be 0)
    outside_changed: int = 0
    #: raw: rows in the range after the commit minus rows_after (must be 0)
    range_mismatch: int = 0
    shadow_path: str | None = None  # shadow: the shadow table
    diff: dict[str, Any] | None = None  # shadow: isbflow.recovery.shadow_diff.diff_rows of the range
    error: str | None = None
    note: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.duplicates == 0 and self.outside_changed == 0 \
            and self.range_mismatch == 0


@dataclass
class ReprocessReport:
    pipeline: str
    #: offsets | event-time
    mode: str = "offsets"
    dry_run: bool = False
    #: the range as asked (texts)
    asked: dict[str, Any] = field(default_factory=dict)
    time_column: dict[str, str] = field(default_factory=dict)
    #: per source partition, the inclusive sequence ranges reprocessed
    range: dict[str, list[list[int]]] = field(default_factory=dict)
    region: list[str] = field(default_factory=list)
    records_scanned: int = 0
    records_reread: int = 0
    dead_lettered: int = 0
    sinks: list[SinkReplace] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
    seconds: float = 0.0
    state: str = "running"  # running | planned (dry run) | shadowed | reprocessed | promoted | failed
    shadow_run: str | None = None  # a shadow reprocess (or its promote): the run id

    @property
    def ok(self) -> bool:
        return self.state in ("reprocessed", "planned", "shadowed", "promoted") and all(s.ok for s in self.sinks)

    def to_json(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        for s, obj in zip(d["sinks"], self.sinks, strict=True):
            s["ok"] = obj.ok
        return d

    def describe_range(self) -> str:
        if not self.range:
            return "no source offsets"
        parts = [f"{part} {rs[0][0]}..{rs[0][1]}" if len(rs) == 1 else
                 f"{part} {ledger.count(rs):,} sequences in {len(rs)} ranges within {rs[0][0]}..{rs[-1][1]}"
                 for part, rs in self.range.items()]
        return "source offsets " + "; ".join(parts)

    def summary(self) -> str:
        """A few lines for a terminal or a task log."""
        what = "dry run of reprocess" if self.dry_run else "reprocess"
        if self.shadow_run:
            what = ("promote of shadow reprocess " if self.state != "shadowed" else "shadow reprocess ") \
                + self.shadow_run
        asked = ", ".join(f"{k} {v}" for k, v in self.asked.items() if v is not None)
        lines = [f"{what} of pipeline {self.pipeline} ({self.mode}: {asked}): {self.describe_range()}"]
        if self.shadow_run and self.state != "shadowed":  # a promote writes the reviewed rows, runs nothing
            lines.append("  the shadow tables' rows of the range, as reviewed (nothing re-read or run again)")
        else:
            lines.append(f"  {self.records_reread:,} records {'to re-read' if self.dry_run else 're-read'}"
                         + (f" (of {self.records_scanned:,} scanned)" if self.mode == "event-time" else "")
                         + (f", {self.dead_lettered:,} malformed skipped (already dead-lettered)"
                            if self.dead_lettered else "")
                         + (f" through {', '.join(self.region)}" if self.region else ""))
        for s in self.sinks:
            verdict = "ok" if s.ok else "FAILED" + (f" ({s.error})" if s.error else "")
            if self.state == "shadowed":
                lines.append(f"  sink {s.sink} ({s.kind}): " + (s.note or "") if s.shadow_path is None else
                             f"  sink {s.sink}: shadow {s.shadow_path}: {diff_line(s.diff)}: {verdict}")
                continue
            if self.dry_run:
                unit = "rows" if s.kind == "raw" else "windows"
                lines.append(f"  sink {s.sink} ({s.kind}): the range covers {s.rows_before:,} {unit} now")
                continue
            versions = (f"version {s.version_before} -> {s.version}" if s.commits else "no change")
            if s.kind == "raw":
                lines.append(f"  sink {s.sink}: {s.rows_before:,} rows of the range replaced by {s.rows_after:,} "
                             f"(updated {s.updated:,}, inserted {s.inserted:,}, deleted {s.deleted:,}) in "
                             f"{s.commits} commit(s), {versions}; {s.duplicates} duplicate ids, "
                             f"{s.outside_changed} rows outside changed: {verdict}")
            else:
                lines.append(f"  sink {s.sink}: {s.windows_touched:,} window(s) touched, {s.rows_after:,} rows "
                             f"recomputed (updated {s.updated:,}, inserted {s.inserted:,}, deleted {s.deleted:,})"
                             f" in {s.commits} commit(s), {versions}: {verdict}")
            if s.note:
                lines.append(f"    {s.note}")
        lines.append(f"  {self.state} in {self.seconds:.1f}s")
        return "\n".join(lines)
