"""The ``isbflow`` command: a thin face over the library's layers.

One module per command group (``isbflow/cli/<group>.py``), each a Typer app.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated

import typer

from isbflow import __version__
from isbflow.cli import nats as nats_cli
from isbflow.cli.common import JsonOut, console, err_console, fail, print_json

app = typer.Typer(
    name="isbflow",
    help="Streaming pipelines: PySpark steps, NATS JetStream buffers, Airflow control plane.\n\n"
         "Start with: isbflow validate -f pipelines/logs.yaml",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(nats_cli.app, name="nats")


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"isbflow {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True, help="Print isbflow's version and exit.")] = False,
) -> None:
    """Streaming pipelines: PySpark steps, NATS JetStream buffers, Airflow control plane."""


@app.command()
def validate(
    file: Annotated[list[Path], typer.Option("--file", "-f", help="Spec file(s) to check.")],
    json_out: JsonOut = False,
) -> None:
    """Check spec files. Exit 0 when valid; else exit 2 with one line per problem:

    FILE: path.to.field: what is wrong

    A valid spec may draw warnings on stderr (exit 0 all the same), one line each:

    warning: FILE: path.to.field: what it does not do (e.g. a scale.min of 0 a running step keeps at 1)
    """
    # lazy: the spec's models load pydantic and yaml (~0.4 s), which 'isbflow --help' must not pay for
    from isbflow.spec import SpecError, load_specs

    try:
        specs = load_specs(file)
    except SpecError as e:
        if json_out:
            print_json({"valid": False, "problems": [p.__dict__ for p in e.problems]})
            raise typer.Exit(2) from None
        fail(str(e), 2)
    if json_out:
        print_json({"valid": True, "pipelines": sorted(specs.pipelines), "services": sorted(specs.services),
                    "warnings": [w.__dict__ for w in specs.warnings]})
        return
    for w in specs.warnings:
        err_console.print(f"warning: {w}", style="yellow", markup=False, highlight=False)
    console.print(f"valid: {len(specs.pipelines)} pipeline(s), {len(specs.services)} ISB service(s)")


def _register_optional() -> None:
    """Command groups added by later layers register here (kept import-light).

    A module exposing ``register(app)`` adds its own commands (a single top-level
    command such as ``produce``); otherwise its Typer ``app`` becomes group ``name``.
    """
    for mod, name in (("isbflow.cli.isb", "isb"), ("isbflow.cli.produce", "produce"),
                      ("isbflow.cli.ref", "ref"), ("isbflow.cli.platform", "platform"),
                      ("isbflow.cli.pipeline", "pipeline"), ("isbflow.cli.replay", "replay"),
                      ("isbflow.cli.quality", "quality"), ("isbflow.cli.sink", "sink"),
                      ("isbflow.cli.spec", "spec")):
        try:
            m = importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name != mod:
                raise
            continue
        if hasattr(m, "register"):
            m.register(app)
        else:
            app.add_typer(m.app, name=name)


_register_optional()


def main() -> None:
    """``isbflow``: the app, with a failure of the ISB service in the middle of a command (a
    request that timed out, a connection the server closed) told in one line and exit 1, like
    an unreachable one (:func:`isbflow.cli.common.call`), instead of a traceback."""
    try:
        app()
    except Exception as e:
        if type(e).__module__.partition(".")[0] != "nats":
            raise
        err_console.print(f"the ISB service stopped answering in the middle of the command: nats {type(e).__name__}"
                          f"{': ' + str(e) if str(e) else ''}. Check that it runs ('isbflow nats status' for the "
                          "embedded one) and run the command again.", style="red", markup=False, highlight=False)
        raise SystemExit(1) from None
