"""``isbflow isb``: start a spec's ISB service (``up``/``down``, JetStream or Redis) and provision a
pipeline's buffers (streams and KV buckets) on it.

Exit codes: 0 success; 1 the operation failed or was refused, leaving the server
as it was (unreachable server, server refusal, a change needing --recreate or
--force, a server that would not start); 2 bad input (spec, usage, delete without
confirmation, ``up``/``down`` of an external service); 3 ``diff`` found drift
(like ``terraform plan -detailed-exitcode``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

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
    data_dir_or_default,
    fail,
    load_or_exit,
    print_json,
    settings_or_exit,
)

if TYPE_CHECKING:
    from isbflow.ops import isb as ops_isb
    from isbflow.ops.connection import NatsSettings
    from isbflow.ops.isb_service import ServiceUp
    from isbflow.spec import Specs

DRIFT_EXIT = 3

app = typer.Typer(
    help="Start a spec's ISB service (up/down: the embedded nats-server or redis-server) and provision a "
         "pipeline's inter-step buffers: one JetStream stream per edge partition, source and "
         "dead-letter streams, and the control/status/ledger KV buckets.\n\n"
         "Typical use: isbflow isb up -f pipelines/logs.yaml, isbflow isb apply -f pipelines/logs.yaml, then "
         "isbflow isb status -f pipelines/logs.yaml",
    no_args_is_help=True,
)

ServiceName = Annotated[str | None, typer.Option(
    "--service", "-s", help="The InterStepBufferService to start or stop, when the files hold several. "
                            "Default: the pipeline's, else the only one.")]


def _table(names: list[str], *columns: str) -> Table:
    """A table whose first column shows resource names whole, however narrow the terminal."""
    table = Table()
    table.add_column("resource", no_wrap=True, min_width=max(map(len, names), default=8))
    for c in columns:
        table.add_column(c)
    return table


def _open(files, nats_url, data_dir, pipeline) -> tuple[Specs, str, NatsSettings]:
    # lazy: the spec's models load pydantic and yaml, which 'isbflow --help' must not pay for
    from isbflow.spec import SpecError

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
                           "(refused for a stream that still holds messages unless --force).")] = False,
    force: Annotated[bool, typer.Option(
        "--force", help="Apply changes that may discard unread messages; with --recreate, recreate "
                        "streams that hold messages too (they are lost).")] = False,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Create or update the pipeline's streams and KV buckets to match the spec. Idempotent, all or nothing.

    Every change is classified before anything is applied: in place, safe; may
    discard unread messages (a limit lowered below what a buffer holds unread,
    discard new -> old on a bounded buffer); needs a recreate (storage, retention).
    When any change is refused, nothing at all is applied and every buffer stays
    as it was: a recreate needs --recreate; a recreate of a buffer holding
    messages, or a change that may discard unread messages, needs --force.

    The service is checked first: at least jetstream.replicas servers, and an
    embedded server under --data-dir running with the spec's store limits.

    A stream whose metadata names another owner (another pipeline or edge that
    derives the same name) is never updated or recreated, whatever the flags.

    Exit 0 when the server now matches the spec; 1 when a change was refused
    (each refused buffer, field, old -> new and unread count is named) or the
    server refused a change.

    Examples:

      isbflow isb diff -f pipelines/logs.yaml                     # see each change and its class first

      isbflow isb apply -f pipelines/logs.yaml

      isbflow isb apply -f pipelines/logs.yaml --recreate          # apply storage/retention changes

      isbflow isb apply -f pipelines/logs.yaml --force             # accept losing unread messages

      isbflow isb apply -f pipelines/logs.yaml --nats-url nats://127.0.0.1:4222 --json
    """
    # lazy: ops.isb loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops import isb as ops_isb

    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    try:
        report = call(ops_isb.apply, settings, specs, name, recreate=recreate, force=force,
                      data_dir=data_dir_or_default(data_dir))
    except ops_isb.ProvisionError as e:
        if e.report is not None:
            if json_out:
                print_json({**e.report.to_json(), "error": str(e)})
            elif isinstance(e, ops_isb.ProvisionRefused):
                _print_report(e.report)
        fail(str(e))
    if json_out:
        print_json(report.to_json())
    else:
        _print_report(report)


_NEEDS = {"safe": "", "may-discard": " (apply needs --force when a buffer holds unread messages)",
          "recreate": " (apply needs --recreate, and --force when the buffer holds messages)",
          "foreign": " (apply and delete refuse it, whatever the flags: its metadata names another owner)"}


def _print_report(report: ops_isb.ProvisionReport) -> None:
    table = _table([r.name for r in report.resources])
    table.add_column("action", no_wrap=True)
    table.add_column("unread", no_wrap=True)
    table.add_column("changes")
    for r in report.resources:
        # a refusal's message is printed below the table, line by line
        notes = [str(c) for c in r.changes] + ([r.message] if r.message and r.action != "refused" else [])
        style = {"refused": "red", "skipped": "yellow"}.get(r.action.value)
        table.add_row(r.name, r.action.value, "" if r.unread is None else str(r.unread), "\n".join(notes),
                      style=style)
    console.print(table)


@app.command()
def diff(
    file: SpecFile,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show where the server differs from the spec, each change with its class; changes nothing.

    Classes: "in place, safe"; "may discard unread messages" (apply needs
    --force); "needs a recreate" (apply needs --recreate, and --force when the
    buffer holds messages). The class is judged against what each buffer holds
    now (its unread messages are shown).

    Exit 0 when in sync, 3 when there is drift (missing resources included),
    1 when the server cannot be reached: a script tests for 3.

    Examples:

      isbflow isb diff -f pipelines/logs.yaml

      isbflow isb diff -f pipelines/logs.yaml --json || [ $? -eq 3 ] && echo "drift"
    """
    # lazy: ops.isb loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops import isb as ops_isb

    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    drifts = call(ops_isb.diff, settings, specs, name, data_dir=data_dir_or_default(data_dir))
    if json_out:
        print_json({"pipeline": name, "in_sync": not drifts, "drift": [d.to_json() for d in drifts]})
    elif not drifts:
        console.print(f"pipeline {name}: the ISB service matches the spec")
    else:
        table = _table([d.resource for d in drifts])
        for column in ("field", "spec", "server", "class", "unread"):
            table.add_column(column, no_wrap=column in ("field", "class"))
        for d in drifts:
            j = d.to_json()
            style = {"may-discard": "red", "recreate": "yellow", "foreign": "red"}.get(d.cls.value)
            table.add_row(d.resource, d.field, str(j["spec"]), str(j["server"]), d.cls.value,
                          "" if d.unread is None else str(d.unread), style=style)
        console.print(table)
        for c in ops_isb.ChangeClass:
            if any(d.cls == c for d in drifts):
                console.print(f"{c.value}: {c.label}{_NEEDS[c.value]}", markup=False, highlight=False)
        for d in drifts:
            if d.reason and d.cls.value != "safe":
                console.print(f"  {d.resource} {d.field}: {d.reason}", markup=False, highlight=False)
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
    # lazy: ops.isb loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops import isb as ops_isb

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
    unless --yes is given. Missing resources are skipped. A stream whose metadata
    names another owner (another pipeline or edge deriving the same name) is never
    deleted: the run is refused and nothing is deleted (exit 1).

    Example: isbflow isb delete -f pipelines/logs.yaml --yes
    """
    # lazy: ops.isb loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops import isb as ops_isb

    specs, name, settings = _open(file, nats_url, data_dir, pipeline)
    if not yes:
        if sys.stdin is None or not sys.stdin.isatty():
            fail(f"refusing to delete the buffers of pipeline {name} without confirmation: pass --yes", 2)
        count = ops_isb.planned_count(specs, name)
        if not typer.confirm(f"Delete {count} streams/buckets of pipeline {name} on {settings.display}, "
                             "with all their messages?"):
            fail("nothing deleted", 1)
    try:
        deleted = call(ops_isb.delete, settings, specs, name, data_dir=data_dir_or_default(data_dir))
    except ops_isb.ProvisionError as e:
        if json_out and e.report is not None:
            print_json({**e.report.to_json(), "deleted": [], "error": str(e)})
        fail(str(e))
    if json_out:
        print_json({"pipeline": name, "deleted": deleted})
    else:
        console.print(f"deleted {len(deleted)} stream(s)/bucket(s) of pipeline {name}")
        for n in deleted:
            console.print(f"  {n}", markup=False, highlight=False)


def _service(files, service: str | None, pipeline: str | None):
    # lazy: ops.isb_service loads the NATS client and the spec's models, which 'isbflow --help' must not pay for
    from isbflow.ops.isb_service import pick_service
    from isbflow.spec import SpecError

    specs = load_or_exit(files)
    try:
        return pick_service(specs, service, pipeline)
    except SpecError as e:
        fail(str(e), 2)


def _print_up(up: ServiceUp) -> None:
    d = up.to_json()
    how = "started" if up.started else "already running, reused"
    if up.store == "redis":
        console.print(f"redis-server up ({how}): ISB service {up.service} (redis, native) under {up.data_dir}/redis, "
                      f"pid {d['pid']}, persistence {d['persistence']}"
                      + (f", fsync {up.fsync}" if up.fsync else ""), markup=False, highlight=False)
        console.print(f"REDIS_URL={d['url']}", markup=False, highlight=False)
        console.print(f"user default, password in {d['password_file']} (not printed; isbflow commands read it "
                      "through --data-dir)", markup=False, highlight=False)
        if up.settings:
            console.print("settings: " + ", ".join(f"{k} {v}" for k, v in up.settings.items()),
                          markup=False, highlight=False)
        return
    console.print(f"nats-server up ({how}): ISB service {up.service} (jetstream, embedded), "
                  f"{len(d['nodes'])} node(s) under {up.data_dir}/nats", markup=False, highlight=False)
    console.print(f"NATS_URL={','.join(d['urls'])}", markup=False, highlight=False)
    if d.get("user"):
        console.print(f"user {d['user']}, password in {d['password_file']} (not printed; isbflow commands read it "
                      "through --data-dir)", markup=False, highlight=False)


@app.command()
def up(
    file: SpecFile,
    service: ServiceName = None,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Start the spec's ISB service on 127.0.0.1 under --data-dir, whichever store it uses, and wait until it answers.

    jetstream with url: embedded: nats-server, as 'isbflow nats up' starts it, with
    jetstream.replicas nodes (1 when unset), the settings' store limits and
    encryption. redis.native: Debian's redis-server with a generated password
    (DATA_DIR/redis/password, never printed), the spec's persistence and fsync,
    then its settings.redis lines applied. Running it again reuses the live
    server. An external service (jetstream.url, redis.external) is refused: isbflow
    starts nothing for it (exit 2).

    Pipelines run on Redis buffers ('isbflow isb apply', 'isbflow pipeline
    start'), recover from buffer loss, reprocess ranges (shadow runs too),
    rescale and scale to zero, as on JetStream.

    Examples:

      isbflow isb up -f pipelines/logs.yaml                        # the pipeline's service

      isbflow isb up -f isbsvc-redis.yaml --data-dir /srv/isbflow --json

      isbflow isb down -f isbsvc-redis.yaml --data-dir /srv/isbflow
    """
    # lazy: ops.isb_service loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops.isb_service import IsbServiceError
    from isbflow.ops.isb_service import up as service_up

    svc = _service(file, service, pipeline)
    try:
        started = service_up(svc, data_dir_or_default(data_dir))
    except IsbServiceError as e:
        fail(str(e), 2 if e.external else 1)
    if json_out:
        print_json(started.to_json())
    else:
        _print_up(started)


@app.command()
def down(
    file: SpecFile,
    service: ServiceName = None,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Stop the spec's embedded ISB service under --data-dir by its recorded PID(s). Its data stays.

    nats-server for jetstream (url: embedded), redis-server for redis.native;
    nothing recorded is not an error. An external service is refused (exit 2).

    Example: isbflow isb down -f isbsvc-redis.yaml --data-dir /srv/isbflow
    """
    # lazy: ops.isb_service loads the NATS client and the provisioning code, which 'isbflow --help' must not pay for
    from isbflow.ops.isb_service import IsbServiceError
    from isbflow.ops.isb_service import down as service_down

    svc = _service(file, service, pipeline)
    dd = data_dir_or_default(data_dir)
    try:
        stopped = service_down(svc, dd)
    except IsbServiceError as e:
        fail(str(e), 2 if e.external else 1)
    if json_out:
        print_json(stopped.to_json())
    elif not stopped.stopped:
        console.print(f"nothing to stop for ISB service {svc.name} ({svc.store}) under {dd}/", markup=False,
                      highlight=False)
    else:
        server, folder = ("redis-server", "redis") if stopped.store == "redis" else ("nats-server", "nats")
        console.print(f"stopped ISB service {svc.name}: {len(stopped.stopped)} {server} process(es) (pid "
                      f"{', '.join(map(str, stopped.stopped))}); data kept under {dd}/{folder}", markup=False,
                      highlight=False)
