"""Fuzzing the spec loader: any bytes give a Specs or a SpecError, never another exception.

Three generators: raw bytes; the demo spec with bytes inserted or overwritten at
random places (so most inputs get deep into validation); and random YAML trees
built from the spec's own keys. Hypothesis keeps the examples that fail.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isbflow.spec import SpecError, load_specs
from tests.conftest import ROOT

DEMO = (ROOT / "pipelines" / "logs.yaml").read_bytes()
KEYS = ["kind", "metadata", "name", "spec", "vertices", "edges", "from", "to", "source", "udf", "sink",
        "jetstream", "subject", "delta", "path", "partitions", "limits", "transform", "bufferConfig",
        "stream", "maxAge", "maxMsgs", "Pipeline", "InterStepBufferService", "quality", "replays"]
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


def _check(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "fuzz.yaml"
        f.write_bytes(data)
        try:
            load_specs([f])
        except SpecError as e:
            assert e.problems and all(p.file == str(f) for p in e.problems), e.problems


@SETTINGS
@given(st.binary(max_size=4096))
def test_any_bytes(data):
    _check(data)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, len(DEMO)), st.binary(min_size=1, max_size=40), st.booleans()),
                min_size=1, max_size=4))
def test_the_demo_with_bytes_changed(edits):
    data = bytearray(DEMO)
    for at, chunk, overwrite in edits:
        data[at:at + (len(chunk) if overwrite else 0)] = chunk
    _check(bytes(data))


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20),
                     st.sampled_from(KEYS))
_TREES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)), max_leaves=40)


@SETTINGS
@given(st.dictionaries(st.sampled_from(KEYS), _TREES, max_size=6),
       st.sampled_from(["Pipeline", "InterStepBufferService", None]))
def test_yaml_trees_of_the_spec_keys(tree, kind):
    if kind:
        tree["kind"] = kind
    _check(yaml.safe_dump(tree).encode())
