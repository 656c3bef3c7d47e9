"""``isbflow produce``: publish the demo's deterministic log events to a pipeline's source.

A single command (not a group): :func:`register` adds it to the top-level app.
Exit codes: 0 every event acknowledged; 1 the source stream is missing, the
server refused or never acknowledged; 2 bad input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
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
    err_console,
    fail,
    load_or_exit,
    print_json,
    run,
    settings_or_exit,
)


def produce(
    file: SpecFile,
    count: Annotated[int, typer.Option("--count", "-n", min=0, help="Number of events to publish.")],
    rate: Annotated[float | None, typer.Option(
        "--rate", min=0.001, help="At most this many events per second (default: as fast as acks allow).")] = None,
    seed: Annotated[int, typer.Option(help="Run seed: the same seed and range give the same events and ids.")] = 0,
    start: Annotated[int, typer.Option(min=0, help="Index of the first event (continue an earlier run).")] = 0,
    malformed_every: Annotated[int | None, typer.Option(
        "--malformed-every", min=1,
        help="Make every K-th event malformed (invalid JSON or a wrong type), for dead-letter tests.")] = None,
    vertex: Annotated[str | None, typer.Option(
        "--vertex", help="The JetStream source vertex (default: the pipeline's only one).")] = None,
    window: Annotated[int, typer.Option(min=1, help="Publishes kept unacknowledged at once.")] = 20_000,
    event_time_from: Annotated[str | None, typer.Option(
        "--event-time-from",
        help="Event time of the first event ('now' or an ISO time, UTC unless it says); later events "
             "follow 10 ms apart (at --rate 100 event time keeps pace with the clock). Default: "
             "2025-01-01T00:00:00Z + 10 ms x --start (the same run always gives the same events).")] = None,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Publish deterministic log events to the pipeline's source subject, with acknowledged publishes.

    Event i of seed S has Nats-Msg-Id "S-i": running the same command again stores
    nothing twice (the summary counts duplicates). The source stream must exist
    (isbflow isb apply).

    Examples:

      isbflow produce -f pipelines/logs.yaml --count 200000

      isbflow produce -f pipelines/logs.yaml --count 1000 --rate 100 --start 200000

      isbflow produce -f pipelines/logs.yaml --count 10000 --malformed-every 100 --json

      isbflow produce -f pipelines/logs.yaml --count 360000 --rate 100 --event-time-from now
    """
    # lazy: the ops verbs load the NATS client and the spec's models, which 'isbflow --help' must not pay for
    from isbflow.ops import produce as P
    from isbflow.ops.connection import PRODUCER
    from isbflow.ops.isb import granted
    from isbflow.spec import SpecError

    specs = load_or_exit(file)
    try:
        p = specs.select(pipeline)
        P.source_vertex(p, vertex)
    except (SpecError, ValueError) as e:
        fail(str(e), 2)
    # the producer's user: it may publish to granted source subjects and nothing else
    settings = settings_or_exit(nats_url, data_dir, specs, p.name, role=PRODUCER)
    # a Redis store's producer user is made by provisioning; a missing source stream is reported on writing
    on_nats = specs.service_for(p).store != "redis"
    if on_nats and settings.user == PRODUCER and not granted(data_dir_or_default(data_dir), p.name):
        fail(f"pipeline {p.name} is not provisioned on the embedded ISB service under "
             f"{data_dir_or_default(data_dir)}/ (its producer may publish nowhere yet): "
             "create it with 'isbflow isb apply -f <spec>'")
    shift_ms = 0
    if event_time_from is not None:
        try:
            t = datetime.now(UTC) if event_time_from == "now" else datetime.fromisoformat(event_time_from)
        except ValueError:
            fail(f"--event-time-from {event_time_from!r}: not 'now' nor an ISO time such as "
                 "2026-11-22T10:00:00Z", 2)
        shift_ms = P.shift_for(t, start)

    try:
        with _progress_bar(count, show=not json_out and err_console.is_terminal) as advance:
            report = run(P.produce(settings, p, vertex, count=count, rate=rate, seed=seed, start=start,
                                   malformed_every=malformed_every, window=window, progress=advance,
                                   shift_ms=shift_ms))
    except (P.SourceNotProvisioned, P.ProduceFailed) as e:
        fail(str(e))
    if json_out:
        print_json(report.to_json())
    else:
        console.print(
            f"{report.published:,} published, {report.duplicates:,} duplicates"
            f"{f', {report.malformed:,} malformed' if report.malformed else ''} to {report.subject} "
            f"(stream {report.stream}) in {report.seconds:.2f}s: {report.rate:,.0f} msg/s",
            markup=False, highlight=False)


@contextmanager
def _progress_bar(total: int, show: bool) -> Iterator[Callable[[int], None] | None]:
    """A rich progress bar on stderr, advanced by the callback it yields (None when hidden)."""
    if not show:
        yield None
        return
    # lazy: rich.progress adds ~28 ms to every command's start-up (-X importtime); only a shown bar needs it
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("publishing"), BarColumn(), MofNCompleteColumn(),
               TextColumn("{task.fields[rate]:>9,.0f}/s"), TimeRemainingColumn())
    with Progress(*columns, console=err_console, transient=True) as bar:
        task = bar.add_task("publish", total=total, rate=0.0)

        def advance(n: int) -> None:
            bar.advance(task, n)
            bar.update(task, rate=bar.tasks[task].speed or 0.0)

        yield advance


def register(app: typer.Typer) -> None:
    app.command("produce")(produce)
