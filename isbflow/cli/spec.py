"""``isbflow spec schema`` and ``isbflow init``: the spec's JSON Schema, and a new pipeline to start from.

``init NAME`` writes, under ``--dir`` (default: the current directory), the layout the
demo uses: ``pipelines/NAME.yaml`` (an ISB service and a pipeline: a JetStream source, one
transform, a Delta sink and a quality gate) and ``spark_apps/NAME.py`` (the transform),
plus ``spark_apps/__init__.py`` when missing. The spec validates as written
(``isbflow validate``) and takes the events ``isbflow produce`` publishes.

Exit codes: 0 done; 2 bad input (a name that is not a valid pipeline name, a file that
already exists: nothing is overwritten).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from isbflow.cli.common import JsonOut, console, fail, print_json

app = typer.Typer(help="The spec's tooling: its JSON Schema, for editors and CI.", no_args_is_help=True)


@app.command("schema")
def schema_cmd(
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Write the schema to this file instead of printing it.")] = None,
) -> None:
    """Print the JSON Schema of a spec file's documents (InterStepBufferService or Pipeline, by kind).

    Every field carries its description, unit and default, so an editor that reads the schema completes
    and checks specs as they are typed. The schema checks each document on its own; rules spanning
    documents and files (edges, cycles, transforms that import) are isbflow validate's.

    The package ships it as isbflow/spec/isbflow.schema.json; a spec file points an editor at it with a
    first line such as:

      # yaml-language-server: $schema=../isbflow/spec/isbflow.schema.json

    Examples:

      isbflow spec schema > isbflow.schema.json

      isbflow spec schema --output isbflow/spec/isbflow.schema.json
    """
    # lazy: the spec's models load pydantic (~0.4 s), which 'isbflow --help' must not pay for
    from isbflow.spec.schema import render

    text = render()
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as e:
        fail(f"cannot write {output}: {e.strerror}", 2)
    console.print(f"wrote {output}", markup=False, highlight=False)


SPEC_TEMPLATE = """\
# yaml-language-server: $schema={schema}
# Pipeline {name}: JSON events published on NATS subject {name}.events -> transform
# (spark_apps/{module}.py) -> the Delta table {name}/out under the data dir.
#
#   isbflow validate -f pipelines/{name}.yaml
#   isbflow nats up
#   isbflow isb apply -f pipelines/{name}.yaml
#   isbflow produce -f pipelines/{name}.yaml --count 1000
#   isbflow pipeline run -f pipelines/{name}.yaml --trigger available-now
#   isbflow quality run -f pipelines/{name}.yaml
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata:
  name: default
spec:
  jetstream:
    url: embedded
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: {name}
spec:
  interStepBufferServiceName: default
  vertices:
    - name: in
      source:
        jetstream:
          subject: {name}.events
        schema: "ts TIMESTAMP, service STRING, level STRING, host STRING, latency_ms DOUBLE, status INT, msg STRING"
    - name: transform
      udf:
        transform: spark_apps.{module}:transform
    - name: out
      sink:
        delta:
          path: {name}/out
  edges:
    - from: in
      to: transform
    - from: transform
      to: out
  quality:
    - sink: out
      expectations:
        - expectation: expect_column_values_to_not_be_null
          kwargs: {{column: service}}
"""

TRANSFORM_TEMPLATE = '''\
"""Pipeline {name}'s transform (pipelines/{name}.yaml, vertex ``transform``).

A transform takes the input DataFrame (the source's columns plus ``_isb_id``, which it
carries through so each row lands in the sink once) and returns one. It knows nothing
of buffers; importing this module must not start Spark.
"""

from __future__ import annotations

from pyspark.sql import DataFrame
from pyspark.sql import functions as F


def transform(df: DataFrame) -> DataFrame:
    """``service`` trimmed and lower case, ``level`` upper case, and ``is_error`` (status >= 500 or ERROR)."""
    level = F.upper(F.trim(F.col("level")))
    return (df
            .withColumn("service", F.lower(F.trim(F.col("service"))))
            .withColumn("level", level)
            .withColumn("is_error", F.coalesce((F.col("status") >= 500) | (level == "ERROR"), F.lit(False))))
'''

PACKAGE_TEMPLATE = '''\
"""The project's transforms: the functions the pipelines' udf vertices name (``spark_apps.<module>:<function>``)."""
'''


def init(
    name: Annotated[str, typer.Argument(help="The pipeline's name: lowercase letters, digits and '-', "
                                             "starting with a letter.")],
    directory: Annotated[Path, typer.Option(
        "--dir", help="The project folder to write in (pipelines/ and spark_apps/ under it).")] = Path("."),
    json_out: JsonOut = False,
) -> None:
    """Start a pipeline: write pipelines/NAME.yaml and its transform spark_apps/NAME.py.

    The spec validates as written and takes the events 'isbflow produce' publishes; its comments
    list the commands that run it. Nothing is overwritten: exit 2 when a file exists.

    Example: isbflow init clicks && isbflow validate -f pipelines/clicks.yaml
    """
    # lazy: the spec's models load pydantic (~0.4 s), which 'isbflow --help' must not pay for
    from isbflow.spec.fields import check_name
    from isbflow.spec.schema import SCHEMA_FILE

    try:
        check_name(name)
    except ValueError as e:
        fail(f"NAME: {e}", 2)
    if not name[0].isalpha():
        fail(f"NAME: {name!r} must start with a letter (it names the transform module too)", 2)
    module = name.replace("-", "_")
    spec = directory / "pipelines" / f"{name}.yaml"
    transform = directory / "spark_apps" / f"{module}.py"
    package = directory / "spark_apps" / "__init__.py"
    existing = [str(p) for p in (spec, transform) if p.exists()]
    if existing:
        fail(f"{', '.join(existing)}: already there, nothing written (pick another NAME, or remove them)", 2)
    spec.parent.mkdir(parents=True, exist_ok=True)
    # the package's schema, relative to the spec's folder (the editor resolves it from there)
    schema = Path(os.path.relpath(SCHEMA_FILE.resolve(), spec.parent.resolve())).as_posix()
    written = []
    for path, text in ((package, PACKAGE_TEMPLATE), (transform, TRANSFORM_TEMPLATE), (spec, SPEC_TEMPLATE)):
        if path == package and path.exists():
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text.format(name=name, module=module, schema=schema), encoding="utf-8")
        written.append(str(path))
    if json_out:
        print_json({"pipeline": name, "files": written})
        return
    for path in written:
        console.print(f"wrote {path}", markup=False, highlight=False)
    console.print(f"next: isbflow validate -f {spec}", markup=False, highlight=False)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="spec")
    root.command("init")(init)
