"""``isbflow replay``: recover a pipeline after buffer loss (``--mode recover``).

A single command (not a group): :func:`register` adds it to the top-level app.
It runs the steps in a local SparkSession (``--master``) and prints a summary:
what was lost, the low offsets replayed from, records replayed, duplicates the
sinks dropped, per-sink checks and the time taken. Exit codes: 0 recovered (or
nothing lost) and every sink check passed; 1 recovery failed or a check failed;
2 bad input.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

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


class Mode(StrEnum):
    RECOVER = "recover"
    REPROCESS = "reprocess"


def replay(
    file: SpecFile,
    mode: Annotated[Mode, typer.Option(help="recover: refill what buffer loss took (result identical to "
                                            "an uninterrupted run).")] = Mode.RECOVER,
    lost: Annotated[list[str] | None, typer.Option(
        "--lost", help="A lost stream, named explicitly (repeat); default: detect loss.")] = None,
    master: Annotated[str, typer.Option(help="Spark master for the replayed steps.")] = "local[2]",
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Replay a pipeline from source offsets.

    Examples:

      isbflow replay -f pipelines/logs.yaml --mode recover

      isbflow replay -f pipelines/logs.yaml --mode recover --lost isb-logs-enrich-raw-0 --json
    """
    from isbflow.isb.provision import select_pipeline
    from isbflow.recovery.recover import RecoveryError, recover
    from isbflow.spec import SpecError

    if mode != Mode.RECOVER:
        fail("--mode reprocess is not available yet: use --mode recover", 2)
    specs = load_or_exit(file)
    try:
        p = select_pipeline(specs, pipeline)
    except SpecError as e:
        fail(str(e), 2)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    from isbflow.steps.runner import spark_session

    sessions = []

    def session():  # started only when something was lost
        sessions.append(spark_session(master, app_name=f"isbflow-replay-{p.name}"))
        return sessions[0]

    def show(ph) -> None:
        if not json_out:
            console.print(f"  {ph.name:<9} {ph.state:<8} {ph.seconds:7.1f}s", markup=False, highlight=False)

    try:
        report = recover(session, specs, p, settings, data_dir_or_default(data_dir), lost=lost, on_phase=show)
    except RecoveryError as e:
        fail(str(e))
    finally:
        for s in sessions:
            s.stop()
    if json_out:
        print_json(report.to_json())
    else:
        _summary(report)
    if not report.ok:
        raise typer.Exit(1)


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
