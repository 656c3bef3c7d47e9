"""``isbflow sink``: the sinks' Delta tables kept small on a long run (compaction, vacuum, a bounded log).

Exit codes: 0 done, 1 a table could not be maintained (a conflict: run again),
2 a bad spec, sink or retention.
"""

from __future__ import annotations

from typing import Annotated

import typer

from isbflow.cli.common import (
    DataDir,
    JsonOut,
    PipelineName,
    SpecFile,
    console,
    data_dir_or_default,
    fail,
    pipeline_or_exit,
    print_json,
)

#: the help's number; tests/cli/test_sink.py checks it is isbflow.sinks.maintain.DEFAULT_RETENTION_HOURS
#: (importing that here would load Spark and Delta for every 'isbflow' command)
RETENTION_DEFAULT_TEXT = "168 (7 days)"
app = typer.Typer(help="The sinks' Delta tables: compaction, vacuum and a bounded log.", no_args_is_help=True)


@app.command("maintain")
def maintain_cmd(
    file: SpecFile,
    sink: Annotated[list[str] | None, typer.Option("--sink", "-s", help="Sink vertex (repeat; default: all).")] = None,
    retention_hours: Annotated[int | None, typer.Option(
        "--retention-hours", show_default=False,
        help=f"Vacuum deletes files the log removed more than this many hours ago. Default and floor: "
             f"{RETENTION_DEFAULT_TEXT}; below the floor only with --force.")] = None,
    log_retention_hours: Annotated[float | None, typer.Option(
        "--log-retention-hours", show_default=False,
        help=f"Remove Delta log entries older than this many hours, after folding what the ledger and "
             f"'quality verify' read from them into one kept commit. Default and floor: {RETENTION_DEFAULT_TEXT} "
             f"(the vacuum's); below the floor only with --force.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Change nothing: count the files and list what "
                                                            "vacuum would delete.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Allow a retention below the floor (readers on older "
                                                        "snapshots and time travel may then fail).")] = False,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Compact each sink's small files into large ones (one OPTIMIZE commit, rows unchanged),
    vacuum files the log removed more than --retention-hours ago, then bound the table's log:
    fold the offsets its commits recorded into one kept commit, checkpoint, and remove log
    entries older than --log-retention-hours.

    Safe beside a running stream: both commit through Delta's optimistic concurrency, the
    stream's appends and the compaction never conflict, and vacuum never deletes files a
    batch has written but not committed yet. The offset ledger and 'quality verify' are
    unaffected (the compaction records no offsets and changes no data; the fold keeps what
    the removed log entries recorded).

    Examples:

        isbflow sink maintain -f pipelines/logs.yaml --dry-run
        isbflow sink maintain -f pipelines/logs.yaml --sink raw --retention-hours 336
    """
    # lazy: ops.sinks imports pyspark and deltalake (~1.3 s, -X importtime); only 'sink maintain' needs them
    from isbflow.ops.sinks import (
        DEFAULT_LOG_RETENTION_HOURS,
        DEFAULT_RETENTION_HOURS,
        MaintenanceError,
        check_retention,
        maintain_sinks,
    )

    _, p = pipeline_or_exit(file, pipeline)
    if retention_hours is None:
        retention_hours = DEFAULT_RETENTION_HOURS
    if log_retention_hours is None:
        log_retention_hours = DEFAULT_LOG_RETENTION_HOURS
    try:
        check_retention(retention_hours, force, log_retention_hours)
    except MaintenanceError as e:
        fail(str(e), 2)
    try:
        results = maintain_sinks(p, data_dir_or_default(data_dir), sink, retention_hours=retention_hours,
                                 dry_run=dry_run, force=force, log_retention_hours=log_retention_hours)
    except MaintenanceError as e:
        fail(str(e), 2 if "has no sink" in str(e) else 1)
    if json_out:
        print_json({s: r.to_json() for s, r in results.items()})
        return
    for s, r in results.items():
        if r.skipped:
            console.print(f"{s}: skipped ({r.skipped})", markup=False, highlight=False)
            continue
        what = "would vacuum" if dry_run else "vacuumed"
        console.print(f"{s}: v{r.version_before} -> v{r.version_after}, files {r.files_before} -> "
                      f"{r.files_after}, {what} {len(r.vacuumed)} file(s) removed over {r.retention_hours} h ago"
                      + f", log files {r.log_files_before} -> {r.log_files_after}"
                      + (" (dry run)" if dry_run else ""), markup=False, highlight=False)
