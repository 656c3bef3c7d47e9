"""``isbflow pipeline scale-to-zero``: the scale-to-zero watcher in the foreground."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Annotated

import typer

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
    pipeline_or_exit,
    settings_or_exit,
)


def scale_to_zero(
    file: SpecFile,
    master: Annotated[str, typer.Option(help="Spark master of the driver it starts, e.g. local[2].")] = "local[2]",
    workdir: Annotated[Path | None, typer.Option(
        help="Working directory of the driver it starts, on its PYTHONPATH (where transforms such as "
             "spark_apps/ import from). Default: the current directory.")] = None,
    drain_timeout: Annotated[float, typer.Option(
        help="Seconds a drain may take before the watcher gives up (exit 1, the stuck step named; the "
             "driver keeps running).")] = 300,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Scale an idle pipeline to zero: stop its Spark driver while nothing is pending, start it on new data.

    For a pipeline whose every vertex has scale.min: 0 (and not scale.disabled) and whose sources are
    JetStream sources. The watcher runs in the foreground without Spark (a small Python process):

    - while the driver runs, it looks at every buffer's pending messages and every step's heartbeat;
      after scaleDownCooldownSeconds (the largest of the vertices') with nothing pending and no batch
      run, it drains the pipeline as 'isbflow pipeline drain' does (final offsets committed,
      checkpoints kept) and the driver exits: 'isbflow pipeline status' shows each step 'sleeping';

    - asleep, it is woken by the source stream itself when an event lands (it peeks at least every
      zeroReplicaSleepSeconds where it cannot be woken), and starts the pipeline as the
      pipeline_start DAG does.

    Ctrl-C (or SIGTERM) stops the watcher and leaves the pipeline as it is: running, or drained.
    Starting the pipeline by hand while it sleeps wakes the watcher; draining it by hand ends the
    watch. One watcher per pipeline.

    Prints one line per decision with its reason; --json prints one JSON object per line:
    {"at", "pipeline", "action" (watching | sleep | asleep | wake | awake | stopped), "reason",
    "inputs": {the pending counts, states and batches, final offsets or launch it was taken on}}.

    Exit 0 when stopped or drained by hand; 1 when watching cannot go on (the driver died on its own,
    a drain timed out, the ISB service is unreachable); 2 when the pipeline cannot scale to zero.

    Example: isbflow pipeline scale-to-zero -f pipelines/logs.yaml
    """
    # lazy: ops.zero loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow.ops import zero
    from isbflow.ops.zero_policy import refusal

    if len(file) != 1:
        fail("scale-to-zero takes one spec file (-f FILE): the driver it starts runs that file", 2)
    specs, p = pipeline_or_exit(file, pipeline)
    why = refusal(p)
    if why is not None:
        fail(f"{file[0]}: {why}", 2)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def show(e: zero.ZeroEvent) -> None:
        if json_out:
            sys.stdout.write(json.dumps(e.to_json(), default=str) + "\n")
            sys.stdout.flush()
        else:
            console.print(e.line(), markup=False, highlight=False)

    try:
        call(zero.watch, file[0], specs, p, settings, data_dir_or_default(data_dir), stop=stop, on_event=show,
             master=master, workdir=workdir or Path.cwd(), drain_timeout=drain_timeout)
    except zero.ZeroError as e:
        fail(str(e))


def register(app: typer.Typer) -> None:
    """Add ``scale-to-zero`` to the ``pipeline`` group."""
    app.command("scale-to-zero")(scale_to_zero)
