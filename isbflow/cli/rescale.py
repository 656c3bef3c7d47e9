"""``isbflow pipeline rescale``: change how many partitions the buffers into a vertex have.

A face over :func:`isbflow.ops.rescale.rescale`; it adds itself to ``isbflow pipeline``
when :func:`isbflow.cli.pipeline.register` imports it.
"""

from __future__ import annotations

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
    print_json,
    settings_or_exit,
)
from isbflow.cli.pipeline import app


@app.command()
def rescale(
    file: SpecFile,
    vertex: Annotated[str, typer.Option(help="The vertex whose input buffers are re-partitioned.")],
    partitions: Annotated[int, typer.Option(
        min=1, help="The partition count; the spec file must already say 'partitions: N' on the vertex.")],
    force: Annotated[bool, typer.Option(
        "--force", help="Re-partition even when a partition holds unread messages: those in partitions "
                        "removed are lost.")] = False,
    drain_timeout: Annotated[float, typer.Option(
        help="Seconds the drain before the change may take (exit 1, stuck step named).")] = 300,
    master: Annotated[str | None, typer.Option(
        help="Spark master of the restarted driver. Default: the one it ran with.")] = None,
    workdir: Annotated[Path | None, typer.Option(
        help="The restarted driver's working directory, on its PYTHONPATH (your transforms).")] = None,
    pipeline: PipelineName = None,
    data_dir: DataDir = None,
    nats_url: NatsUrl = None,
    json_out: JsonOut = False,
) -> None:
    """Change how many partitions (JetStream streams) the buffers into a vertex have, losing and
    doubling nothing.

    Edit the spec first: set 'partitions: N' on the vertex. The spec stays the one
    source of the count, so 'isbflow isb diff' shows no drift afterwards. Then:

    1. checks, changing nothing: the spec says N; the vertex keeps no state (an
       aggregation's state cannot move to another partition count: refused, with
       the reason);

    2. drains the pipeline when its driver runs (upstream first, final offsets
       committed) and waits for the driver to exit;

    3. refuses when a partition still holds messages the vertex has not read,
       naming each stream and its unread count (--force: re-partition anyway;
       unread messages in removed partitions are lost);

    4. creates the new partitions, removes those the count no longer has;

    5. starts the pipeline again when it ran before. The vertex reads new
       partitions from their beginning; partitionKey records hash to one
       partition of the new count.

    Nothing to do (exit 0) when the server already holds N partitions.
    Exit 1 when refused or failed (the message says why and what to do),
    2 for a bad spec or usage.

    Example: isbflow pipeline rescale -f pipelines/logs.yaml --vertex parse --partitions 4
    """
    # lazy: ops.rescale loads the NATS client and the launcher, which 'isbflow --help' must not pay for
    from isbflow.ops import rescale as ops

    specs, p = pipeline_or_exit(file, pipeline)
    if len(file) != 1:
        fail("rescale takes one spec file (-f): the restarted driver reads it", 2)
    settings = settings_or_exit(nats_url, data_dir, specs, p.name)

    def progress(message: str) -> None:
        if not json_out:
            console.print(message, markup=False, highlight=False)

    try:
        out = call(ops.rescale, file[0], specs, p, vertex, settings, data_dir_or_default(data_dir),
                   partitions=partitions, force=force, drain_timeout=drain_timeout, master=master,
                   workdir=workdir, progress=progress)
    except (ops.RescaleError, ops.DrainTimeout) as e:
        if json_out:
            print_json({"pipeline": p.name, "vertex": vertex, "error": str(e),
                        "drained": getattr(e, "drained", False)})
        fail(str(e))
    if json_out:
        print_json(out.to_json())
        return
    if not out.changed:
        return
    console.print(f"pipeline {p.name}: the buffers into {vertex} now have {out.after} partition(s) "
                  f"(were {out.before}), in {out.seconds:.1f}s", markup=False, highlight=False)
    for s in out.created:
        console.print(f"  created {s}", markup=False, highlight=False)
    for s in out.removed:
        lost = out.dropped.get(s)
        console.print(f"  removed {s}" + (f" ({lost} unread message(s) dropped: --force)" if lost else ""),
                      markup=False, highlight=False)
    if out.launch_id is None:
        console.print(f"  pipeline {p.name} did not run: it was not started", markup=False, highlight=False)
