"""The spec's JSON Schema: shipped equal to what the models generate, accepting every spec the
loader accepts, describing the fields, and named by the spec files for editors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from isbflow.spec.schema import REFRESH, SCHEMA_FILE, render, spec_schema
from tests.conftest import ROOT

PIPELINES = sorted((ROOT / "pipelines").glob("*.yaml"))
#: the valid specs the suite runs (tests/specs/bad/ holds the invalid ones)
TEST_SPECS = sorted((ROOT / "tests" / "specs").glob("*.yaml"))
MODELINE = re.compile(r"^# yaml-language-server: \$schema=(\S+)$")


def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def problems(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator().iter_errors(doc)]


def test_the_shipped_schema_is_what_the_models_generate():
    assert SCHEMA_FILE.read_text() == render(), (
        f"{SCHEMA_FILE.relative_to(ROOT)} differs from the models: refresh it with '{REFRESH}'")


@pytest.mark.parametrize("path", PIPELINES + TEST_SPECS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_document_of_the_specs_validates(path):
    docs = documents(path)
    assert docs, f"{path}: no document"
    for doc in docs:
        assert problems(doc) == [], (path, doc.get("kind"), problems(doc))


def test_the_schema_refuses_what_a_document_may_not_hold():
    """The check above can fail: an unknown field, a misspelt kind, a bad name, a value out of range."""
    pipeline = next(d for d in documents(ROOT / "pipelines" / "logs.yaml") if d["kind"] == "Pipeline")
    assert problems({**pipeline, "kind": "Pipelin"})
    assert problems({**pipeline, "spec": {**pipeline["spec"], "vertexes": []}})
    assert problems({**pipeline, "metadata": {"name": "Logs_1"}})
    assert problems({**pipeline, "spec": {**pipeline["spec"], "limits": {"bufferUsageLimit": 0.8}}})
    isbsvc = {"kind": "InterStepBufferService", "spec": {"jetstream": {"bufferConfig": {
        "stream": {"maxAge": "72h", "maxBytes": "512MiB", "retention": 2, "storage": "tape"}}}}}
    worst = jsonschema.exceptions.best_match(validator().iter_errors(isbsvc))
    assert list(worst.absolute_path) == ["spec", "jetstream", "bufferConfig", "stream", "storage"], worst


def test_most_fields_are_described():
    """At least 90% of the properties carry a description (every one, today)."""
    defs = spec_schema()["$defs"]
    props = [(model, name, p) for model, d in defs.items() for name, p in d.get("properties", {}).items()]
    missing = [f"{model}.{name}" for model, name, p in props if not p.get("description")]
    assert len(props) > 100
    assert len(missing) <= 0.1 * len(props), f"{len(missing)} of {len(props)} undescribed: {missing}"


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.name)
def test_each_pipeline_file_points_editors_at_the_schema(path):
    first = path.read_text().splitlines()[0]
    m = MODELINE.match(first)
    assert m, f"{path.name}: first line is not '# yaml-language-server: $schema=...': {first!r}"
    assert (path.parent / m.group(1)).resolve() == SCHEMA_FILE.resolve()
