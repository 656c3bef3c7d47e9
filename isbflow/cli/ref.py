"""``isbflow ref``: reference tables (key -> columns) that pipeline steps join against.

Exit codes: 0 success; 1 the ISB service is unreachable or the table is missing;
2 bad input (spec, file, a name no step references).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

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

if TYPE_CHECKING:
    from isbflow.ops.connection import NatsSettings
    from isbflow.spec.models import Pipeline

app = typer.Typer(
    help="Reference tables a step joins against (Kafka Streams' GlobalKTable), kept in a KV bucket.\n\n"
         "Typical use: isbflow ref put -f pipelines/logs.yaml --name services "
         "--from-file pipelines/reference/services.json",
    no_args_is_help=True,
)

RefName = Annotated[str, typer.Option("--name", help="The reference's name, as in a step's udf.references.")]


def reference_key(pipeline: Pipeline, name: str) -> str:
    """The key column of reference ``name`` as the spec declares it; ValueError when no step uses it."""
    for v in pipeline.spec.vertices:
        for r in v.udf.references if v.udf else []:
            if r.name == name:
                return r.key
    declared = sorted({r.name for v in pipeline.spec.vertices if v.udf for r in v.udf.references})
    raise ValueError(f"pipeline {pipeline.name}: no step references {name!r} "
                     f"(declared in udf.references: {', '.join(declared) or 'none'})")


def read_rows(path: Path, key: str) -> dict[str, dict[str, Any]]:
    """Rows from ``.json`` (an object key -> columns, or a list of objects holding ``key``)
    or ``.jsonl`` (one object holding ``key`` per line). ValueError names the file and line."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    if path.suffix == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except ValueError as e:
                    raise ValueError(f"{path}:{n}: not JSON: {e}") from None
    else:
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        if isinstance(data, dict):
            return {str(k): v for k, v in data.items()}
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected an object (key -> columns) or a list of rows")
        records = data
    rows: dict[str, dict[str, Any]] = {}
    for n, rec in enumerate(records, 1):
        if not isinstance(rec, dict) or key not in rec:
            raise ValueError(f"{path}: row {n} has no {key!r} field")
        rows[str(rec[key])] = {c: v for c, v in rec.items() if c != key}
    return rows


def _open(files, pipeline, name, nats_url, data_dir) -> tuple[Pipeline, str, NatsSettings]:
    # lazy: the spec's models load pydantic and yaml, which 'isbflow --help' must not pay for
    from isbflow.spec import SpecError

    specs = load_or_exit(files)
    try:
        p = specs.select(pipeline)
        key = reference_key(p, name)
    except (SpecError, ValueError) as e:
        fail(str(e), 2)
    return p, key, settings_or_exit(nats_url, data_dir, specs, p.name)


@app.command()
def put(
    file: SpecFile,
    name: RefName,
    from_file: Annotated[Path, typer.Option("--from-file", help="Rows: .json (object or list) or .jsonl.")],
    replace: Annotated[bool, typer.Option("--replace", help="Also delete keys absent from the file.")] = False,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Store a reference table's rows. Unchanged rows are skipped, so re-running changes nothing.

    Example: isbflow ref put -f pipelines/logs.yaml --name services --from-file pipelines/reference/services.json
    """
    # lazy: ops.ref loads pyarrow and the NATS client, which 'isbflow --help' must not pay for
    from isbflow.ops import ref as reference

    p, key, settings = _open(file, pipeline, name, nats_url, data_dir)
    try:
        rows = read_rows(from_file, key)
        reference.check_rows(rows)
    except (ValueError, reference.ReferenceError) as e:
        fail(str(e), 2)
    counts = call(reference.put, settings, p.name, name, rows, replace=replace)
    if json_out:
        print_json({"pipeline": p.name, "name": name, **counts})
    else:
        console.print(f"{name}: {counts['written']} written, {counts['unchanged']} unchanged, "
                      f"{counts['deleted']} deleted (revision {counts['revision']})")


@app.command()
def load(
    file: SpecFile,
    name: RefName,
    pipeline: PipelineName = None,
    nats_url: NatsUrl = None,
    data_dir: DataDir = None,
    json_out: JsonOut = False,
) -> None:
    """Show a reference table as the steps see it, with its revision.

    Example: isbflow ref load -f pipelines/logs.yaml --name services
    """
    # lazy: ops.ref loads pyarrow and the NATS client, which 'isbflow --help' must not pay for
    from isbflow.ops import ref as reference

    p, key, settings = _open(file, pipeline, name, nats_url, data_dir)
    try:
        rev, table = call(reference.load, settings, p.name, name, key)
    except reference.ReferenceError as e:
        fail(str(e))
    if json_out:
        print_json({"pipeline": p.name, "name": name, "revision": rev, "rows": table.to_pylist()})
        return
    out = Table(*table.column_names, title=f"{name} (revision {rev})")
    for row in table.to_pylist():
        out.add_row(*("" if v is None else str(v) for v in row.values()))
    console.print(out)
