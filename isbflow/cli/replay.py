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

Review, then promote: ``--mode reprocess ... --shadow`` writes the range's new
output into shadow tables beside the sinks (the live tables are not touched),
runs the sinks' suites on them and prints the diff per sink and the run id;
``--promote RUN`` replaces the range in the live sinks (one Delta commit per
raw sink, then the aggregate windows) once every suite passed, and refuses
naming the failed check or the live sink that moved.

Exit codes: 0 done and every sink check passed; 1 failed, a check failed (a
shadow whose suite failed) or a promote refused; 2 bad input (spec, options, a
range that is malformed or cannot be reprocessed, an unknown shadow run).
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
    shadow: Annotated[bool, typer.Option(
        "--shadow", help="reprocess: write the range's new output into shadow tables beside the sinks "
        "(<data dir>/shadow/<pipeline>/<run>/), never touching the live tables; run the sinks' suites on them "
        "and show the diff per sink (rows added, removed, changed, per column, with samples under --json). "
        "Prints the run id for --promote.")] = False,
    promote: Annotated[str | None, typer.Option(
        "--promote", metavar="RUN", help="Promote shadow run RUN (reprocess-<time>, as --shadow printed it): "
        "replace the range in the live sinks, one Delta commit per raw sink, then recompute the aggregate "
        "windows. Refused, changing nothing, when a suite failed on the shadow (naming the check), when a "
        "live sink's rows of the range changed since the shadow, or when RUN was promoted already.")] = None,
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

      isbflow replay -f pipelines/logs.yaml --mode reprocess --from 1001 --to 2000 --shadow

      isbflow replay -f pipelines/logs.yaml --promote reprocess-20261125T101500Z
    """
    # lazy: the replay verbs load Spark's helpers, Delta and the NATS client; 'isbflow --help' must not
    from isbflow.ops import replay as ops_replay
    from isbflow.ops.spark import SparkOnDemand
    from isbflow.spec import SpecError

    ranged = [o for o, v in (("--from", from_), ("--to", to), ("--from-time", from_time), ("--to-time", to_time),
                             ("--time-column", time_column)) if v]
    if mode == Mode.RECOVER and ranged and promote is None:
        fail(f"{', '.join(ranged)}: only with --mode reprocess (recover replays from the offset ledger's low "
             "offsets)", 2)
    if mode == Mode.REPROCESS and lost:
        fail("--lost: only with --mode recover", 2)
    if promote is not None:
        extra = [o for o, v in (("--from/--to/--from-time/--to-time/--time-column", ranged), ("--shadow", shadow),
                                ("--dry-run", dry_run), ("--lost", lost)) if v]
        if extra:
            fail(f"--promote RUN takes the range from the shadow run: drop {', '.join(extra)}", 2)
    elif shadow and mode != Mode.REPROCESS:
        fail("--shadow: only with --mode reprocess (and a range)", 2)
    specs = load_or_exit(file)
    try:
        p = specs.select(pipeline)
    except SpecError as e:
        fail(str(e), 2)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)

    def show(ph) -> None:
        if not json_out:
            console.print(f"  {ph.name:<9} {ph.state:<8} {ph.seconds:7.1f}s", markup=False, highlight=False)

    with SparkOnDemand(master, f"isbflow-replay-{p.name}") as spark_for:
        try:
            if promote is not None:
                report = ops_replay.promote(spark_for, specs, p, settings, data_dir_or_default(data_dir), promote,
                                            on_phase=show)
            else:
                report = ops_replay.replay(spark_for, specs, p, settings, data_dir_or_default(data_dir),
                                           mode=mode.value, dry_run=dry_run, lost=lost, from_offset=from_,
                                           to_offset=to, from_time=from_time, to_time=to_time,
                                           time_column=time_column, on_phase=show, shadow=shadow)
        except ops_replay.ReplayError as e:
            fail(str(e), 2 if e.usage else 1)
        except ops_replay.Unreachable as e:
            fail(str(e))
    if json_out:
        print_json(report.to_json())
    else:
        for line in ops_replay.summary(report):
            console.print(line, markup=False, highlight=False)
    if not report.ok:
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)
