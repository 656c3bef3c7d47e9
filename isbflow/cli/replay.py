"""``isbflow replay``: recover after buffer loss (``--mode recover``) or reprocess a range (``--mode reprocess``).

A single command (not a group): :func:`register` adds it to the top-level app.
It runs the steps in a local SparkSession (``--master``; an already active
session is reused and left running) and prints each phase as it ends, then a
summary.

- ``recover``: what was lost, the low offsets replayed from, records replayed,
  duplicates the sinks dropped, per-sink checks, time taken.
- ``reprocess``: the range (``--from/--to`` source offsets, both included, or
  ``--from-time/--to-time`` event times, ``[from, to)``), records re-read,
  per sink the rows replaced (one commit each) or the windows recomputed, the
  checks, time taken.

``--dry-run`` (either mode) shows what would be done and changes nothing.

Exit codes: 0 done and every sink check passed; 1 failed or a check failed;
2 bad input (spec, options, a range that is malformed or cannot be reprocessed).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import Annotated, Any

import typer

from isbflow.cli.common import (
    DataDir,
    JsonOut,
    NatsUrl,
    PipelineName,
    SpecFile,
    console,
    data_dir_or_default,
    fail,
    load_or_exit,
    print_json,
    settings_or_exit,
)

OFFSET_HELP = ("Source offset (JetStream sequence of the source stream, included): N for the pipeline's only "
               "source, SOURCE:N, SOURCE/PARTITION:N, or a comma list of those. Default: the stream's first "
               "sequence (--from), the last one the pipeline has committed (--to).")
TIME_HELP = ("Event time (UTC) on the source's first TIMESTAMP column (or --time-column): ISO time or date "
             "('2025-01-01T00:10:00Z'), or 'yesterday', 'today', '-6h', 'today-2h'. --from-time is included, "
             "--to-time excluded; a side left out is open.")


class Mode(StrEnum):
    RECOVER = "recover"
    REPROCESS = "reprocess"


def replay(
    file: SpecFile,
    mode: Annotated[Mode, typer.Option(help="recover: refill what buffer loss took (result identical to an "
                                            "uninterrupted run). reprocess: run a source range again through the "
                                            "current code and replace its earlier output.")] = Mode.RECOVER,
    lost: Annotated[list[str] | None, typer.Option(
        "--lost", help="recover: a lost stream, named explicitly (repeat); default: detect loss.")] = None,
    from_: Annotated[str | None, typer.Option("--from", help=f"reprocess: first offset. {OFFSET_HELP}")] = None,
    to: Annotated[str | None, typer.Option("--to", help="reprocess: last offset (included).")] = None,
    from_time: Annotated[str | None, typer.Option("--from-time", help=f"reprocess: {TIME_HELP}")] = None,
    to_time: Annotated[str | None, typer.Option("--to-time", help="reprocess: end of the event-time range "
                                                                  "(excluded).")] = None,
    time_column: Annotated[str | None, typer.Option(
        "--time-column", help="reprocess: the source's TIMESTAMP column event time is read from.")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Show what would be done, change nothing. recover: the lost buffers, the steps it "
        "would drain, the buffers it would recreate, the low offsets and records to replay. reprocess: what "
        "the range covers.")] = False,
    master: Annotated[str, typer.Option(help="Spark master for the replayed steps.")] = "local[2]",
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Replay a pipeline from source offsets.

    Examples:

      isbflow replay -f pipelines/logs.yaml --mode recover --dry-run

      isbflow replay -f pipelines/logs.yaml --mode recover

      isbflow replay -f pipelines/logs.yaml --mode recover --lost isb-logs-enrich-raw-0 --json

      isbflow replay -f pipelines/logs.yaml --mode reprocess --from 1001 --to 2000 --dry-run

      isbflow replay -f pipelines/logs.yaml --mode reprocess --from in:1001 --to in:2000

      isbflow replay -f pipelines/logs.yaml --mode reprocess --from-time 2025-01-01T00:00:00Z --to-time 2025-01-01T01:00:00Z
    """
    from isbflow.isb.provision import select_pipeline
    from isbflow.spec import SpecError

    ranged = [o for o, v in (("--from", from_), ("--to", to), ("--from-time", from_time), ("--to-time", to_time),
                             ("--time-column", time_column)) if v]
    if mode == Mode.RECOVER and ranged:
        fail(f"{', '.join(ranged)}: only with --mode reprocess (recover replays from the offset ledger's low "
             "offsets)", 2)
    if mode == Mode.REPROCESS and lost:
        fail("--lost: only with --mode recover", 2)
    specs = load_or_exit(file)
    try:
        p = select_pipeline(specs, pipeline)
    except SpecError as e:
        fail(str(e), 2)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    sessions: list[Any] = []
    session = _session_factory(master, p.name, sessions)

    def show(ph) -> None:
        if not json_out:
            console.print(f"  {ph.name:<9} {ph.state:<8} {ph.seconds:7.1f}s", markup=False, highlight=False)

    try:
        if mode == Mode.RECOVER and dry_run:
            from isbflow.recovery.plan import plan_recover

            report = plan_recover(session, specs, p, settings, data_dir_or_default(data_dir), lost=lost)
        elif mode == Mode.RECOVER:
            report = _recover(session, specs, p, settings, data_dir_or_default(data_dir), lost, show)
        else:
            report = _reprocess(session, specs, p, settings, data_dir_or_default(data_dir), show,
                                from_offset=from_, to_offset=to, from_time=from_time, to_time=to_time,
                                time_column=time_column, dry_run=dry_run)
    finally:
        for s in sessions:
            s.stop()
    if json_out:
        print_json(report.to_json())
    elif mode == Mode.RECOVER and not dry_run:
        _summary(report)
    else:
        console.print(report.summary(), markup=False, highlight=False)
    if not report.ok:
        raise typer.Exit(1)


def _session_factory(master: str, pipeline: str, sessions: list[Any]) -> Callable[[], Any]:
    """Starts the SparkSession on first call (only when needed); an active one is reused, not stopped."""
    def session() -> Any:
        from pyspark.sql import SparkSession

        from isbflow.steps.runner import register_sources, spark_session

        active = SparkSession.getActiveSession()
        if active is not None:
            register_sources(active)
            return active
        sessions.append(spark_session(master, app_name=f"isbflow-replay-{pipeline}"))
        return sessions[0]

    return session


def _recover(session, specs, p, settings, data_dir, lost, show):
    from isbflow.recovery.recover import RecoveryError, recover

    try:
        return recover(session, specs, p, settings, data_dir, lost=lost, on_phase=show)
    except RecoveryError as e:
        fail(str(e))


def _reprocess(session, specs, p, settings, data_dir, show, **kw):
    from isbflow.recovery.reprocess import RangeError, ReprocessError, reprocess

    if not any(kw[k] for k in ("from_offset", "to_offset", "from_time", "to_time")):
        fail("--mode reprocess: give the range to reprocess: --from/--to (source offsets) or "
             "--from-time/--to-time (event time)", 2)
    try:
        return reprocess(session, specs, p, settings, data_dir, on_phase=show, **kw)
    except RangeError as e:
        fail(f"reprocess {p.name}: {e}", 2)
    except ReprocessError as e:
        fail(f"reprocess {p.name}: {e}")


def _summary(r) -> None:
    out = console.print
    if r.state == "nothing-lost":
        out(f"pipeline {r.pipeline}: no buffer lost, nothing to recover ({r.seconds:.1f}s)")
        return
    for b in r.lost:
        rng = "" if b.first is None else f" from sequence {b.first}" + (f" to {b.last}" if b.last else "")
        out(f"lost {b.stream}{rng}: {b.reason}", markup=False, highlight=False)
    for part, lo in r.low_offsets.items():
        out(f"replayed source {part} from sequence {lo['low']}", markup=False, highlight=False)
    for part, ranges in r.source_lost.items():
        out(f"LOST AT THE SOURCE {part}: sequences {ranges} (no longer in the source stream)", markup=False)
    out(f"{r.replayed_records:,} records replayed through {', '.join(r.region)}", markup=False)
    for s in r.sinks:
        if s.verified:
            out(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} inserted, {s.dropped:,} duplicates dropped, "
                f"{s.duplicates} duplicate ids, {s.missing} missing -> {'ok' if s.ok else 'FAILED'}", markup=False)
        else:
            out(f"sink {s.sink}: {s.rows:,} rows, {s.inserted:,} windows inserted, {s.dropped:,} kept as they "
                "were (no _isb_id: unverified; reprocess recomputes it exactly)", markup=False)
    out(f"{r.state} in {r.seconds:.1f}s", markup=False)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)
