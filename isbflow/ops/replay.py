"""The replay verb: recover after buffer loss, or reprocess a source range; dry runs plan only.

Called by ``isbflow replay`` and the ``pipeline_replay`` DAG's operator. Spark
starts only when a phase needs it (``spark_for``: a
:class:`~isbflow.ops.spark.SparkOnDemand`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from isbflow.isb.connect import IsbUnreachable as Unreachable
from isbflow.isb.connect import NatsSettings
from isbflow.spec import Specs
from isbflow.spec.models import Pipeline

__all__ = ["MODES", "ReplayError", "Unreachable", "replay", "summary"]

MODES = ("recover", "reprocess")


class ReplayError(Exception):
    """A replay that cannot run or did not finish; ``usage`` when the request itself is wrong
    (a range that cannot be reprocessed, a range given to recover)."""

    def __init__(self, message: str, usage: bool = False):
        super().__init__(message)
        self.usage = usage


def replay(spark_for: Callable[[], Any], specs: Specs, p: Pipeline, settings: NatsSettings, data_dir: Path, *,
           mode: str, dry_run: bool = False, lost: list[str] | None = None, from_offset: Any = None,
           to_offset: Any = None, from_time: Any = None, to_time: Any = None, time_column: str | None = None,
           drain_timeout: float | None = None, on_phase: Callable[[Any], None] | None = None) -> Any:
    """Run (or with ``dry_run`` plan) a replay; the report (``.ok``, ``.to_json()``)."""
    # recovery imports Spark, Delta and GX: loaded when a replay runs, not with the faces' modules
    from isbflow.recovery.plan import plan_recover
    from isbflow.recovery.recover import RecoveryError, recover
    from isbflow.recovery.reprocess import RangeError, ReprocessError, reprocess

    ranged = any(v is not None and v != "" for v in (from_offset, to_offset, from_time, to_time))
    if mode == "recover":
        if ranged:
            raise ReplayError("recover takes no range: it replays from the offset ledger's low offsets "
                              "(reprocess runs a range again)", usage=True)
        if dry_run:
            return plan_recover(spark_for, specs, p, settings, data_dir, lost=lost)
        kw = {} if drain_timeout is None else {"drain_timeout": drain_timeout}
        try:
            return recover(spark_for, specs, p, settings, data_dir, lost=lost, on_phase=on_phase, **kw)
        except RecoveryError as e:
            raise ReplayError(str(e)) from None
    if mode != "reprocess":
        raise ReplayError(f"mode {mode!r} is not one of {', '.join(MODES)}", usage=True)
    if lost:
        raise ReplayError("lost buffers are named only for recover", usage=True)
    if not ranged:
        raise ReplayError("reprocess: give the range to reprocess: source offsets (from/to) or event "
                          "times (from-time/to-time)", usage=True)
    try:
        return reprocess(spark_for, specs, p, settings, data_dir, from_offset=from_offset, to_offset=to_offset,
                         from_time=from_time, to_time=to_time, dry_run=dry_run, on_phase=on_phase,
                         time_column=time_column)
    except RangeError as e:
        raise ReplayError(f"reprocess {p.name}: {e}", usage=True) from None
    except ReprocessError as e:
        raise ReplayError(f"reprocess {p.name}: {e}") from None


def summary(report: Any) -> list[str]:
    """The report in a few lines: a recovery's own account, else the report's ``summary()``."""
    if not hasattr(report, "replayed_records"):  # a plan or a reprocess report
        return str(report.summary()).splitlines()
    if report.state == "nothing-lost":
        return [f"pipeline {report.pipeline}: no buffer lost, nothing to recover ({report.seconds:.1f}s)"]
    lines = []
    for b in report.lost:
        rng = "" if b.first is None else f" from sequence {b.first}" + (f" to {b.last}" if b.last else "")
        lines.append(f"lost {b.stream}{rng}: {b.reason}")
    lines += [f"replayed source {part} from sequence {lo['low']}" for part, lo in report.low_offsets.items()]
    lines += [f"LOST AT THE SOURCE {part}: sequences {r} (no longer in the source stream)"
              for part, r in report.source_lost.items()]
    lines.append(f"{report.replayed_records:,} records replayed through {', '.join(report.region)}")
    for s in report.sinks:
        if s.verified:
            lines.append(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} inserted, {s.dropped:,} duplicates "
                         f"dropped, {s.duplicates} duplicate ids, {s.missing} missing -> "
                         f"{'ok' if s.ok else 'FAILED'}")
        else:
            lines.append(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} windows inserted, {s.dropped:,} kept "
                         "as they were (no _isb_id: unverified; reprocess recomputes it exactly)")
    lines.append(f"{report.state} in {report.seconds:.1f}s")
    return lines
