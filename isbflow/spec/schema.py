"""The JSON Schema of a spec file's documents, generated from the models.

One schema validates every document of a spec file: an ``InterStepBufferService`` or a
``Pipeline``, told apart by ``kind`` (a ``oneOf``). Field descriptions are the models'
attribute docstrings. It takes what the loader takes before the models check values:
durations as Go-style strings or seconds, sizes as bytes or strings with a unit,
Numaflow's numeric ``retention``/``storage`` codes and its YAML-string ``settings`` and
``bufferConfig``. Rules spanning fields and documents (edges naming vertices, cycles, a
transform that imports) are the loader's alone: a document the schema accepts may
still fail ``isbflow validate``, never the other way round.

:data:`SCHEMA_FILE` is the schema shipped in the package (editors point at it with a
``# yaml-language-server: $schema=...`` line); ``isbflow spec schema`` prints the same
text, and a test keeps the file equal to what the models generate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, TypeAdapter

from isbflow.spec.models import InterStepBufferService, Pipeline
from isbflow.spec.numaflow import STRING_FIELDS

SCHEMA_FILE = Path(__file__).with_name("isbflow.schema.json")
#: the command that rewrites :data:`SCHEMA_FILE` after a model changed
REFRESH = "isbflow spec schema --output isbflow/spec/isbflow.schema.json"

Document = Annotated[InterStepBufferService | Pipeline, Field(discriminator="kind")]
#: pydantic's names of numeric bounds it could not place on a number type (a field taking a number
#: or a string) -> JSON Schema's, which apply to numbers and let strings through
_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def spec_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of one document of a spec file."""
    schema = TypeAdapter(Document).json_schema(mode="validation")
    _tidy(schema)
    defs = schema["$defs"]
    for loc in STRING_FIELDS:  # ("spec", "jetstream", "settings"): the model holding the field, then the field
        holder = defs[_model_at(defs, InterStepBufferService.__name__, loc[:-1])]
        field = holder["properties"][loc[-1]]
        described = {k: field.pop(k) for k in ("description", "title") if k in field}
        holder["properties"][loc[-1]] = {
            **described,
            "anyOf": [field, {"type": "string", "description": "The same mapping as a YAML string (Numaflow's form)."}],
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "isbflow spec document",
        "description": "One document of an isbflow spec file: an InterStepBufferService or a Pipeline, by kind. "
                       "Generated from isbflow's models by 'isbflow spec schema'.",
        **schema,
    }


def render() -> str:
    """:func:`spec_schema` as the text of :data:`SCHEMA_FILE`."""
    return json.dumps(spec_schema(), indent=2, ensure_ascii=False) + "\n"


def _model_at(defs: dict[str, Any], model: str, path: tuple[str, ...]) -> str:
    """The name in ``$defs`` of the model reached from ``model`` through the fields ``path``."""
    for name in path:
        prop = defs[model]["properties"][name]
        ref = prop.get("$ref") or next(o["$ref"] for o in prop.get("anyOf", []) if "$ref" in o)
        model = ref.rsplit("/", 1)[1]
    return model


def _tidy(node: Any) -> None:
    """In place: pydantic's ``ge``/``le``/``gt``/``lt`` left in ``node`` become JSON Schema's keywords, and
    descriptions (docstrings) become one line of Markdown each, as editors show them."""
    if isinstance(node, dict):
        for short, keyword in _BOUNDS.items():
            if short in node and not isinstance(node[short], dict):
                node[keyword] = node.pop(short)
        if isinstance(node.get("description"), str):
            node["description"] = " ".join(node["description"].split()).replace("``", "`")
        for value in node.values():
            _tidy(value)
    elif isinstance(node, list):
        for value in node:
            _tidy(value)
