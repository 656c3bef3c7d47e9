"""``isbflow isb``: provision a pipeline's buffers (streams and KV buckets) on the ISB service.

Exit codes: 0 success; 1 the operation failed or left the server differing from
the spec (unreachable server, server refusal, drift needing --recreate, recreate
refused); 2 bad input (spec, usage, delete without confirmation); 3 ``diff``
found drift (like ``terraform plan -detailed-exitcode``).
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer
from rich.table import Table

from isbflow.cli.common import (
    DataDir,
    JsonOut,
    NatsUrl,
    PipelineName,
    SpecFile,
    call,
    console,
    fail,
    load_or_exit,
    print_json,
    settings_or_exit,
)
from isbflow.ops import isb as ops_isb
from isbflow.ops.connection import NatsSettings
from isbflow.spec import SpecError, Specs

DRIFT_EXIT = 3

app = typer.Typer(
    help="Provision a pipeline's inter-step buffers: one JetStream stream per edge partition, source and "
         "dead-letter streams, and the control/status/ledger KV buckets.\n\n"
         "Typical use: isbflow isb apply -f pipelines/logs.yaml, then isbflow isb status -f pipelines/logs.yaml",
    no_args_is_help=True,
)


def _table(names: list[str], *columns: str) -> Table:
    """A table whose first column shows resource names whole, however narrow the terminal."""
    table = Table()
    table.add_column("resource", no_wrap=True, min_width=max(map(len, names), default=8))
    for c in columns:
        table.add_column(c)
    return table


def _open(files, nats_url, data_dir, pipeline) -> tuple[Specs, str, NatsSettings]:
    specs = load_or_exit(files)
    try:
        name = specs.select(pipeline).name
    except SpecError as e:
        fail(str(e), 2)
    return specs, name, settings_or_exit(nats_url, data_dir, specs, name)


@app.command()
def apply(
    file: SpecFile,
    recreate: Annotated[bool, typer.Option(
        "--recreate", help="Delete and recreate streams whose storage or retention changed "
                           "(refused for a stream that still holds messages).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="With --recreate: recreate even streams holding messages (they are lost).")] = False,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Create or update the pipeline's streams and KV buckets to match the spec. Idempotent.

    Limits, replicas, duplicates window, max message size and metadata are updated
    in place. Storage and retention cannot change in place: such a stream is
    reported as drift and left alone unless --recreate is given.

    Exit 0 when the server now matches the spec; 1 when something still differs
    (drift needing --recreate, a refused recreate) or the server refused a change.

    Examples:

      isbflow isb apply -f pipelines/logs.yaml

      isbflow isb apply -f pipelines/logs.yaml --recreate          # apply storage/retention changes

      isbflow isb apply -f pipelines/logs.yaml --nats-url nats://127.0.0.1:4222 --json
    """
    if force and not recreate:
        fail("--force only makes sense with --recreate", 2)
    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    try:
        report = call(ops_isb.apply, settings, specs, name, recreate=recreate, force=force)
    except ops_isb.ProvisionError as e:
        if json_out and e.report is not None:
            print_json({**e.report.to_json(), "error": str(e)})
        fail(str(e))
    if json_out:
        print_json(report.to_json())
    else:
        table = _table([r.name for r in report.resources], "kind", "action", "changes")
        for r in report.resources:
            # a drift's message repeats what each "(needs --recreate)" says; --json keeps it
            notes = [str(c) for c in r.changes] + ([r.message] if r.message and r.action != "drift" else [])
            style = {"drift": "yellow", "refused": "red"}.get(r.action.value)
            table.add_row(r.name, r.kind, r.action.value, "\n".join(notes), style=style)
        console.print(table)
    if report.pending:
        names = ", ".join(r.name for r in report.pending)
        fail(f"{len(report.pending)} resource(s) still differ from the spec: {names}")


@app.command()
def diff(
    file: SpecFile,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show where the server differs from the spec, changing nothing.

    Exit 0 when in sync, 3 when there is drift (missing resources included),
    1 when the server cannot be reached: a script tests for 3.

    Examples:

      isbflow isb diff -f pipelines/logs.yaml

      isbflow isb diff -f pipelines/logs.yaml --json || [ $? -eq 3 ] && echo "drift"
    """
    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    drifts = call(ops_isb.diff, settings, specs, name)
    if json_out:
        print_json({"pipeline": name, "in_sync": not drifts, "drift": [d.to_json() for d in drifts]})
    elif not drifts:
        console.print(f"pipeline {name}: the ISB service matches the spec")
    else:
        table = _table([d.resource for d in drifts], "kind", "field", "spec", "server")
        for d in drifts:
            j = d.to_json()
            table.add_row(d.resource, d.kind, d.field, str(j["spec"]), str(j["server"]))
        console.print(table)
    if drifts:
        raise typer.Exit(DRIFT_EXIT)


@app.command()
def status(
    file: SpecFile,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show each buffer and bucket: messages, bytes, sequences, consumers, replicas and their health.

    msgs counts messages (for a KV bucket: values stored); seq is first..last
    sequence; cons counts consumers; R is the replica count. A replica is
    healthy when it is current and online; "behind N" counts operations it
    lags the leader.

    Example: isbflow isb status -f pipelines/logs.yaml
    """
    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    statuses = call(ops_isb.status, settings, specs, name)
    if json_out:
        print_json({"pipeline": name, "resources": [s.to_json() for s in statuses]})
        return
    table = _table([s.name for s in statuses], "kind", "msgs", "bytes", "seq", "cons", "R", "leader",
                   "replicas")
    for s in statuses:
        if not s.exists:
            table.add_row(s.name, s.kind, "missing", "", "", "", "", "", "", style="red")
            continue
        peers = ", ".join(
            f"{p.name}: " + ("offline" if p.offline else "current" if p.current else f"behind {p.lag or 0}")
            for p in s.peers)
        table.add_row(s.name, s.kind, str(s.messages), str(s.bytes),
                      f"{s.first_seq}..{s.last_seq}", str(s.consumer_count), str(s.replicas),
                      s.leader or "-", peers or "-")
    console.print(table)


@app.command()
def delete(
    file: SpecFile,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")] = False,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Delete the pipeline's streams and KV buckets, and every message in them.

    Asks for confirmation on a terminal; without a terminal it refuses (exit 2)
    unless --yes is given. Missing resources are skipped.

    Example: isbflow isb delete -f pipelines/logs.yaml --yes
    """
    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    if not yes:
        if sys.stdin is None or not sys.stdin.isatty():
            fail(f"refusing to delete the buffers of pipeline {name} without confirmation: pass --yes", 2)
        count = ops_isb.planned_count(specs, name)
        if not typer.confirm(f"Delete {count} streams/buckets of pipeline {name} on {settings.display}, "
                             "with all their messages?"):
            fail("nothing deleted", 1)
    deleted = call(ops_isb.delete, settings, specs, name)
    if json_out:
        print_json({"pipeline": name, "deleted": deleted})
    else:
        console.print(f"deleted {len(deleted)} stream(s)/bucket(s) of pipeline {name}")
        for n in deleted:
            console.print(f"  {n}", markup=False, highlight=False)
