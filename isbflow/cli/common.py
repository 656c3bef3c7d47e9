"""Options and helpers shared by every ``isbflow`` command.

Exit codes: 0 success, 1 the operation failed (unreachable server, drift
refused, timeout), 2 bad input (spec validation, usage).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

if TYPE_CHECKING:
    from isbflow.ops.connection import NatsSettings
    from isbflow.spec import Specs

# The layers below (the spec's models, the ops verbs and the NATS client they load) are imported by
# the helpers that use them, not here: every command module imports this one, and 'isbflow --help'
# must not pay for them (tests/cli/test_startup.py).

T = TypeVar("T")

console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)

SpecFile = Annotated[
    list[Path],
    typer.Option("--file", "-f", help="Spec file(s) (YAML, one or more documents each). Repeat for several."),
]
DataDir = Annotated[
    Path | None,
    typer.Option("--data-dir", envvar="ISBFLOW_HOME",
                 help="Where isbflow keeps its state (embedded server, checkpoints). Default: ./.isbflow"),
]
NatsUrl = Annotated[
    str | None,
    typer.Option("--nats-url", envvar="NATS_URL",
                 help="ISB service URL(s), comma separated, e.g. nats://user:pass@127.0.0.1:4222. "
                      "Default: the spec's jetstream.url, else the embedded server under --data-dir."),
]
JsonOut = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
PipelineName = Annotated[
    str | None, typer.Option("--pipeline", "-p", help="Pipeline name, when the files hold more than one.")
]


def fail(message: str, code: int = 1) -> NoReturn:
    """Print one clear line (or several for a spec) to stderr and exit."""
    err_console.print(message, style="red", markup=False, highlight=False)
    raise typer.Exit(code)


def load_or_exit(files: list[Path]) -> Specs:
    """Load the spec files, or exit 2 with one line per problem."""
    # lazy: the spec's models load pydantic and yaml (~0.4 s), which 'isbflow --help' must not pay for
    from isbflow.spec import SpecError, load_specs

    if not files:
        fail("no spec given: pass one with -f FILE", 2)
    try:
        return load_specs(files)
    except SpecError as e:
        fail(str(e), 2)


def pipeline_or_exit(files: list[Path], pipeline: str | None):
    """Load the spec files and pick the pipeline: the only one, or the one named by
    ``--pipeline``. Exits 2 with one line when it is not there."""
    specs = load_or_exit(files)
    p = specs.pipelines.get(pipeline) if pipeline else specs.only_pipeline()
    if p is None:
        fail(f"no pipeline named {pipeline!r} in {', '.join(map(str, files))}", 2)
    return specs, p


def data_dir_or_default(data_dir: Path | None) -> Path:
    """``--data-dir`` when given, else isbflow's default (``ISBFLOW_HOME``, else ``./.isbflow``)."""
    # lazy: ops.connection loads the NATS client, which 'isbflow --help' must not pay for
    from isbflow.ops.connection import default_data_dir

    return data_dir if data_dir is not None else default_data_dir()


def settings_or_exit(nats_url: str | None, data_dir: Path | None, specs: Specs | None = None,
                     pipeline: str | None = None, role: str | None = None) -> NatsSettings:
    """The settings of the ISB service (``role``: the embedded server's user to log in as,
    :mod:`isbflow.isb.roles`; default the admin), or exit 1 saying why there are none."""
    # lazy: ops.connection loads the NATS client, which 'isbflow --help' must not pay for
    from isbflow.ops.connection import IsbUnreachable, resolve_settings

    service = None
    if specs is not None:
        if specs.pipelines:
            p = specs.pipelines[pipeline] if pipeline else specs.only_pipeline()
            service = specs.service_for(p)
        elif specs.services:
            service = next(iter(specs.services.values()))
    try:
        return resolve_settings(nats_url, data_dir_or_default(data_dir), service, role=role)
    except IsbUnreachable as e:
        fail(str(e))


def reader_settings_or_exit(nats_url: str | None, data_dir: Path | None, specs: Specs, pipeline: str) -> NatsSettings:
    """Settings for a command that only reads ``pipeline``'s state: the embedded server's read-only
    ``reader`` user once the pipeline is granted (provisioned by isbflow), else the admin's (a
    pipeline provisioned by other means has no grants to read with)."""
    # lazy: ops.connection and ops.isb load the NATS client and the provisioning code
    from isbflow.ops.connection import READER
    from isbflow.ops.isb import granted

    dd = data_dir_or_default(data_dir)
    return settings_or_exit(nats_url, data_dir, specs, pipeline, role=READER if granted(dd, pipeline) else None)


def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call an ops verb; an unreachable ISB service becomes one line and exit 1."""
    # lazy: ops.connection loads the NATS client, which 'isbflow --help' must not pay for
    from isbflow.ops.connection import IsbUnreachable

    try:
        return fn(*args, **kwargs)
    except IsbUnreachable as e:
        fail(str(e))


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine; an unreachable ISB service becomes one line and exit 1."""
    # lazy: asyncio (with ssl) and ops.connection (the NATS client): 'isbflow --help' must not pay for them
    import asyncio

    from isbflow.ops.connection import IsbUnreachable

    try:
        return asyncio.run(coro)
    except IsbUnreachable as e:
        fail(str(e))


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
