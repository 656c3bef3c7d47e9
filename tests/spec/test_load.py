"""The spec: every validation rule names the file, the path in the document and
the rule, and ``isbflow validate`` prints exactly that (exit 2), never a traceback.

Most bad specs are the demo spec (pipelines/logs.yaml) with one change, so each
case shows the one rule it breaks; tests/specs/bad/ holds the ones that cannot
be written as a change of the demo (broken YAML, duplicate keys ...).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from isbflow.spec import SpecError, load_specs
from isbflow.spec.models import Pipeline, parse_duration, parse_size
from tests.conftest import ROOT

DEMO = ROOT / "pipelines" / "logs.yaml"
BAD = ROOT / "tests" / "specs" / "bad"
ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")

Docs = list[dict[str, Any]]


def _isb(d: Docs) -> dict:
    return d[0]["spec"]["jetstream"]


def _pl(d: Docs) -> dict:
    return d[1]["spec"]


def _vertex(d: Docs, name: str) -> dict:
    return next(v for v in _pl(d)["vertices"] if v["name"] == name)


def _rename(d: Docs, old: str, new: Any) -> None:
    """Rename a vertex everywhere (so the only problem is the name itself)."""
    _vertex(d, old)["name"] = new
    for e in _pl(d)["edges"]:
        for end in ("from", "to"):
            if e[end] == old:
                e[end] = new


# (id, change to the demo documents, expected path, words the message must hold)
CASES: list[tuple[str, Callable[[Docs], Any], str, list[str]]] = [
    ("unknown-field", lambda d: _vertex(d, "parse").update(partitons=2),
     "vertices[1].partitons", ["unknown field 'partitons'", "did you mean 'partitions'"]),
    ("unknown-field-top", lambda d: _pl(d).update(vertexes=[]),  # not close enough for a hint (ratio 0.75)
     "vertexes", ["unknown field 'vertexes'", "allowed:", "vertices"]),
    ("wrong-type", lambda d: _vertex(d, "parse").update(partitions="two"),
     "vertices[1].partitions", ["must be an integer", "'two'"]),
    ("edge-missing-vertex", lambda d: _pl(d)["edges"][0].update(to="pars"),
     "edges[0].to", ["no vertex named 'pars'", "did you mean 'parse'"]),
    ("cycle", lambda d: _pl(d)["edges"].append({"from": "enrich", "to": "parse"}),
     "edges", ["cycle", "parse -> enrich -> parse"]),
    ("partitions-zero", lambda d: _vertex(d, "parse").update(partitions=0),
     "vertices[1].partitions", ["must be >= 1", "0"]),
    ("usage-zero", lambda d: _pl(d)["limits"].update(bufferUsageLimit=0),
     "limits.bufferUsageLimit", ["percentage from 1 to 100", "got 0"]),
    ("usage-above-100", lambda d: _pl(d)["limits"].update(bufferUsageLimit=150),
     "limits.bufferUsageLimit", ["percentage from 1 to 100", "got 150"]),
    ("usage-negative", lambda d: _vertex(d, "enrich").update(limits={"bufferUsageLimit": -1}),
     "vertices[2].limits.bufferUsageLimit", ["percentage from 1 to 100", "got -1"]),
    ("read-timeout-zero", lambda d: _pl(d)["limits"].update(readTimeout="0s"),
     "limits.readTimeout", ["must be >= 0.01"]),
    ("read-timeout-words", lambda d: _vertex(d, "enrich").update(limits={"readTimeout": "soon"}),
     "vertices[2].limits.readTimeout", ["must be a duration", "'soon'"]),
    ("usage-fraction", lambda d: _pl(d)["limits"].update(bufferUsageLimit=0.8),  # isbflow's old unit
     "limits.bufferUsageLimit", ["whole percentage", "got 0.8", "write 80 for 80%"]),
    ("duplicate-vertex", lambda d: _pl(d)["vertices"].append({"name": "parse", "udf": {"transform": "spark_apps.logs:parse"}}),
     "vertices[7].name", ["duplicate vertex name 'parse'", "vertices[1]"]),
    ("unknown-isb-service", lambda d: _pl(d).update(interStepBufferServiceName="fast"),
     "interStepBufferServiceName", ["unknown InterStepBufferService 'fast'", "default"]),
    ("unknown-kind", lambda d: d[1].update(kind="Pipelines"),
     "kind", ["unknown kind 'Pipelines'", "did you mean 'Pipeline'"]),
    ("missing-kind", lambda d: d[1].pop("kind"),
     "kind", ["'kind' is missing"]),
    ("bad-duration", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxAge="3 days"),
     "jetstream.bufferConfig.stream.maxAge", ["must be a duration", "'3 days'"]),
    ("bad-duration-negative", lambda d: _isb(d)["bufferConfig"]["stream"].update(duplicates=-5),
     "jetstream.bufferConfig.stream.duplicates", [">= 0"]),
    ("bad-size", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxBytes="2 GiBs"),
     "jetstream.bufferConfig.stream.maxBytes", ["must be a size", "'2 GiBs'"]),
    ("bad-size-negative", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxBytes=-5),
     "jetstream.bufferConfig.stream.maxBytes", ["-1 for unlimited", "-5"]),
    ("payload-zero", lambda d: _isb(d)["settings"].update(max_payload=0),
     "jetstream.settings.max_payload", ["must be > 0"]),
    ("name-uppercase", lambda d: d[1]["metadata"].update(name="Logs-1"),
     "metadata.name", ["'Logs-1' is not a valid name", "lowercase"]),
    ("name-space", lambda d: _rename(d, "raw", "raw sink"),
     "vertices[4].name", ["'raw sink' is not a valid name"]),
    ("name-path", lambda d: _rename(d, "agg", "../x"),
     "vertices[5].name", ["'../x' is not a valid name"]),
    ("name-not-string", lambda d: _pl(d)["vertices"].append({"name": 5, "udf": {"transform": "spark_apps.logs:parse"}}),
     "vertices[7].name", ["must be a string", "got 5"]),
    ("sink-with-output", lambda d: _pl(d)["edges"].append({"from": "raw", "to": "minutely"}),
     "edges[6].from", ["'raw' is a sink", "no outputs"]),
    ("source-with-input", lambda d: _pl(d)["edges"].append({"from": "parse", "to": "in"}),
     "edges[6].to", ["'in' is a source", "no inputs"]),
    ("two-roles", lambda d: _vertex(d, "parse").update(sink={"delta": {"path": "x"}}),
     "vertices[1]", ["exactly one of: source, udf, sink", "'udf' and 'sink'"]),
    ("no-role", lambda d: _vertex(d, "parse").pop("udf"),
     "vertices[1]", ["exactly one of: source, udf, sink", "found none"]),
    ("dangling-vertex", lambda d: _pl(d)["vertices"].append({"name": "lost", "udf": {"transform": "spark_apps.logs:parse"}}),
     "vertices[7]", ["'lost' has no input and no output edge"]),
    ("self-edge", lambda d: _pl(d)["edges"].append({"from": "parse", "to": "parse"}),
     "edges[6]", ["to itself"]),
    ("duplicate-edge", lambda d: _pl(d)["edges"].append({"from": "in", "to": "parse"}),
     "edges[6]", ["duplicate edge 'in' -> 'parse'"]),
    ("python-field-name", lambda d: _pl(d)["edges"][0].update({"from_": "in"}),
     "edges[0].from_", ["unknown field 'from_'", "did you mean 'from'"]),
    ("enum-case", lambda d: _isb(d)["bufferConfig"]["stream"].update(retention="limits"),
     "jetstream.bufferConfig.stream.retention", ["must be one of", "did you mean 'Limits'"]),
    ("bad-url", lambda d: _isb(d).update(url="http://localhost:4222"),
     "jetstream.url", ["not a NATS URL"]),
    ("bad-transform", lambda d: _vertex(d, "parse")["udf"].update(transform="spark_apps/logs.py"),
     "vertices[1].udf.transform", ["package.module:function"]),
    ("source-two-kinds", lambda d: _vertex(d, "in")["source"].update(files={"path": "landing"}),
     "vertices[0].source", ["exactly one of: jetstream, files"]),
    ("quality-unknown-sink", lambda d: _pl(d).update(quality=[{"sink": "rwa"}]),
     "quality[0].sink", ["no sink vertex named 'rwa'"]),
    ("spec-not-mapping", lambda d: d[1].update(spec="x"),
     "spec", ["must be a mapping"]),
    ("missing-required", lambda d: d[1].pop("metadata"),
     "metadata", ["required field is missing"]),
    # every field's domain closed: no trailing newline, finite bounded durations, strict integers
    ("name-trailing-newline", lambda d: d[1]["metadata"].update(name="logs\n"),
     "metadata.name", ["'logs\\n' is not a valid name"]),
    ("subject-trailing-newline", lambda d: _vertex(d, "in")["source"]["jetstream"].update(subject="logs.events\n"),
     "vertices[0].source.jetstream.subject", ["not a plain NATS subject"]),
    ("transform-trailing-newline", lambda d: _vertex(d, "parse")["udf"].update(transform="spark_apps.logs:parse\n"),
     "vertices[1].udf.transform", ["package.module:function"]),
    ("duration-inf", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxAge=float("inf")),
     "jetstream.bufferConfig.stream.maxAge", ["finite"]),
    ("duration-nan", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxAge=float("nan")),
     "jetstream.bufferConfig.stream.maxAge", ["finite"]),
    ("duration-400-digits", lambda d: _isb(d)["bufferConfig"]["stream"].update(maxAge="9" * 400 + "s"),
     "jetstream.bufferConfig.stream.maxAge", ["at most 3650d"]),
    ("partitions-too-many", lambda d: _vertex(d, "parse").update(partitions=10000),
     "vertices[1].partitions", ["must be <= 64", "10000"]),
    ("partitions-string", lambda d: _vertex(d, "parse").update(partitions="3"),
     "vertices[1].partitions", ["must be an integer", "'3'"]),
    ("partitions-bool", lambda d: _vertex(d, "parse").update(partitions=True),
     "vertices[1].partitions", ["must be an integer", "True"]),
    ("partitions-float", lambda d: _vertex(d, "parse").update(partitions=3.0),
     "vertices[1].partitions", ["must be an integer", "3.0"]),
    ("sink-absolute-path", lambda d: _vertex(d, "raw")["sink"]["delta"].update(path="/etc/isbflow"),
     "vertices[4].sink.delta", ["outside the data dir", "external: true"]),
    ("sink-postgres-dsn-password", lambda d: _vertex(d, "raw").update(sink={"postgres": {
        "table": "raw_events", "dsn": "postgresql://isb:s3cret@127.0.0.1:5432/logs"}}),
     "vertices[4].sink.postgres.dsn", ["holds a password", "passwordFile", "Airflow connection"]),
    ("sink-postgres-dsn-sslpassword", lambda d: _vertex(d, "raw").update(sink={"postgres": {
        "table": "raw_events", "dsn": "host=127.0.0.1 dbname=logs sslpassword=k3y"}}),
     "vertices[4].sink.postgres.dsn", ["holds a password"]),
    ("sink-postgres-uri-sslpassword", lambda d: _vertex(d, "raw").update(sink={"postgres": {
        "table": "raw_events", "dsn": "postgresql://isb@127.0.0.1/logs?sslpassword=k3y"}}),
     "vertices[4].sink.postgres.dsn", ["holds a password"]),
    ("sink-postgres-platform-env", lambda d: _vertex(d, "raw").update(sink={"postgres": {
        "table": "raw_events", "dsn": "postgresql://isb@127.0.0.1/logs", "passwordEnv": "NATS_PASSWORD"}}),
     "vertices[4].sink.postgres.passwordEnv", ["platform's own variables", "NATS_"]),
    ("sink-postgres-no-server", lambda d: _vertex(d, "raw").update(sink={"postgres": {"table": "raw_events"}}),
     "vertices[4].sink.postgres", ["needs exactly one of: connection, dsn", "found none"]),
    ("sink-postgres-bad-table", lambda d: _vertex(d, "raw").update(sink={"postgres": {
        "table": "raw events", "connection": "pg"}}),
     "vertices[4].sink.postgres.table", ["'table' or 'schema.table'"]),
    ("sink-two-kinds", lambda d: _vertex(d, "raw")["sink"].update(postgres={"table": "t", "connection": "pg"}),
     "vertices[4].sink", ["a sink needs exactly one of: delta, postgres", "'delta' and 'postgres'"]),
]


def _demo_docs() -> Docs:
    return [d for d in yaml.safe_load_all(DEMO.read_text()) if d]


def _write(path: Path, docs: Docs) -> Path:
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory) -> dict[str, Path]:
    """One file per case: the demo with that case's change."""
    folder = tmp_path_factory.mktemp("bad")
    out = {}
    for n, (case_id, change, _, _) in enumerate(CASES):
        docs = _demo_docs()
        # unique names, so all files can also be validated together (test_cli_...)
        docs[0]["metadata"]["name"] = _pl(docs)["interStepBufferServiceName"] = f"isb-{n}"
        docs[1]["metadata"]["name"] = f"logs-{n}"
        _vertex(docs, "in")["source"]["jetstream"]["subject"] = f"logs-{n}.events"  # no two derive one name
        change(docs)
        out[case_id] = _write(folder / f"{case_id}.yaml", docs)
    return out


def _problems(path: Path | list[Path]) -> list:
    with pytest.raises(SpecError) as e:
        load_specs(path)
    return e.value.problems


def test_demo_spec_is_valid():
    specs = load_specs(DEMO)
    p = specs.only_pipeline()
    assert p.name == "logs"
    assert specs.service_for(p).name == "default"
    order = p.topological_order()
    assert sorted(order) == sorted(v.name for v in p.spec.vertices) and order[0] == "in"
    assert all(order.index(e.from_) < order.index(e.to) for e in p.spec.edges)
    stream = specs.services["default"].spec.jetstream.bufferConfig.stream
    raw = _demo_docs()[0]["spec"]["jetstream"]["bufferConfig"]["stream"]
    assert stream.maxAge == parse_duration(raw["maxAge"]) > 0
    assert stream.maxBytes == parse_size(raw["maxBytes"]) > 0


@pytest.mark.parametrize("case_id,path,words", [(c[0], c[2], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_each_rule_is_located(bad_files, case_id, path, words):
    problems = _problems(bad_files[case_id])
    assert len(problems) == 1, "\n".join(map(str, problems))  # one mistake, one line: no cascade
    p = problems[0]
    assert p.file == str(bad_files[case_id])
    assert p.path == path
    for w in words:
        assert w in p.message
    # the line points at the offending place in the file (a missing field: its parent)
    lines = bad_files[case_id].read_text().splitlines()
    leaf = path.rsplit(".", 1)[-1].split("[")[0]
    assert p.line is not None and 1 <= p.line <= len(lines)
    if case_id not in ("missing-required", "no-role", "missing-kind"):
        assert leaf in lines[p.line - 1] or "- " in lines[p.line - 1]


def test_a_refused_dsn_does_not_repeat_its_password(bad_files):
    assert "s3cret" not in str(_problems(bad_files["sink-postgres-dsn-password"])[0])


def test_field_error_and_edge_error_are_reported_together():
    problems = _problems(BAD / "field-and-edge.yaml")
    assert [(p.path, p.line) for p in problems] == [("vertices[1].partitions", 13), ("edges[1].to", 24)]
    assert "no vertex named 'ouput'" in problems[1].message
    assert "did you mean 'out'" in problems[1].message


def test_invalid_yaml_names_line_and_column():
    (p,) = _problems(BAD / "invalid-yaml.yaml")
    assert p.path == "" and p.message.startswith("invalid YAML:")
    assert (p.line, p.column) == (7, 1)
    assert str(p).endswith("(line 7, column 1)")


def test_duplicate_key_points_at_the_second():
    (p,) = _problems(BAD / "duplicate-key.yaml")
    assert p.path == "vertices[1].sink"
    assert p.message == "duplicate key 'sink' (first on line 12)"
    assert p.line == 15


def test_missing_file_and_empty_file(tmp_path):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing\n")
    problems = _problems([tmp_path / "nope.yaml", empty, tmp_path])
    assert [str(p) for p in problems] == [
        f"{tmp_path / 'nope.yaml'}: file not found",
        f"{empty}: no documents: expected a Pipeline or an InterStepBufferService",
        f"{tmp_path}: cannot read: Is a directory",
    ]


def test_duplicate_pipeline_across_files(tmp_path):
    a = _write(tmp_path / "a.yaml", _demo_docs())
    b = _write(tmp_path / "b.yaml", _demo_docs()[1:])
    (p,) = _problems([a, b])
    assert p.file == str(b) and p.path == "metadata.name"
    assert f"duplicate Pipeline name 'logs' (also in {a} line" in p.message


def test_pipeline_without_service_gets_default(tmp_path):
    only = _write(tmp_path / "p.yaml", _demo_docs()[1:])
    specs = load_specs(only)
    assert specs.services["default"].spec.jetstream.url == "embedded"


def test_broken_service_does_not_cascade_into_pipeline(tmp_path):
    docs = _demo_docs()
    docs[0]["metadata"]["name"] = "fast"
    docs[0]["spec"]["jetstream"]["replicas"] = 0
    docs[1]["spec"]["interStepBufferServiceName"] = "fast"
    (p,) = _problems(_write(tmp_path / "x.yaml", docs))
    assert p.path == "jetstream.replicas"


def test_lines_tell_documents_apart(tmp_path):
    docs = _demo_docs()
    docs[0]["spec"]["jetstream"]["bufferConfig"]["stream"]["replicas"] = 0
    docs[1]["spec"]["vertices"][1]["partitions"] = 0
    problems = _problems(_write(tmp_path / "x.yaml", docs))
    assert [p.path for p in problems] == ["jetstream.bufferConfig.stream.replicas", "vertices[1].partitions"]
    assert problems[0].line < problems[1].line


def test_durations_and_sizes():
    assert parse_duration("1m30s") == 90 and parse_duration("72h") == 259200 and parse_duration(5) == 5
    assert parse_duration("1.5h") == 5400 and parse_duration("250ms") == 0.25
    for bad in ("3 days", "10", "-5s", "1h-", True, None):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert parse_size("64MiB") == 64 * 1024**2 and parse_size("1GB") == 10**9 and parse_size(-1) == -1
    assert parse_size("-1") == -1 and parse_size(2048.0) == 2048
    for bad in ("2 GiBs", -2, "lots", 1.5, False):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_vertex_limits_merge_pipeline_then_vertex(tmp_path):
    docs = _demo_docs()
    docs[1]["spec"]["vertices"][1]["limits"] = {"readBatchSize": 7}
    p: Pipeline = load_specs(_write(tmp_path / "x.yaml", docs)).only_pipeline()
    lim = p.vertex("parse").effective_limits(p.spec.limits)
    assert (lim.readBatchSize, lim.bufferMaxLength, lim.bufferUsageLimit) == (7, 2_000_000, 0.8)
    assert lim.readTimeout == 5.0  # the default trigger interval (the cost curve's)

    docs[1]["spec"]["limits"]["readTimeout"] = "5s"
    docs[1]["spec"]["vertices"][2]["limits"] = {"readTimeout": "250ms"}
    p = load_specs(_write(tmp_path / "y.yaml", docs)).only_pipeline()
    assert [p.vertex(v).effective_limits(p.spec.limits).readTimeout for v in ("parse", "enrich")] == [5.0, 0.25]


# ------------------------------------------------------------------ the CLI


def _validate(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([ISBFLOW, "validate", *map(str, args)], capture_output=True, text=True, timeout=60)


def test_cli_valid_spec():
    r = _validate("-f", DEMO)
    assert r.returncode == 0, r.stderr
    assert "valid: 1 pipeline(s), 1 ISB service(s)" in r.stdout
    r = _validate("-f", DEMO, "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == {"valid": True, "pipelines": ["logs"], "services": ["default"],
                                                    "warnings": []}


def test_cli_prints_one_line_per_problem(bad_files):
    files = [bad_files[c[0]] for c in CASES] + sorted(BAD.glob("*.yaml"))
    args = [a for f in files for a in ("-f", f)]
    r = _validate(*args)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == sum(len(_problems(f)) for f in files)
    for case_id, _, path, words in CASES:
        f = bad_files[case_id]
        line = next(x for x in lines if x.startswith(f"{f}: "))
        assert line.startswith(f"{f}: {path}: "), line
        assert all(w in line for w in words)
    assert f"{BAD / 'unknown-kind.yaml'}: kind: unknown kind 'Pipline'" in r.stderr
    assert f"{BAD / 'invalid-yaml.yaml'}: invalid YAML: " in r.stderr


def test_cli_json_problems(bad_files):
    r = _validate("-f", BAD / "field-and-edge.yaml", "-f", bad_files["cycle"], "--json")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    out = json.loads(r.stdout)
    assert out["valid"] is False
    assert [(p["file"], p["path"], p["line"]) for p in out["problems"]] == [
        (str(BAD / "field-and-edge.yaml"), "vertices[1].partitions", 13),
        (str(BAD / "field-and-edge.yaml"), "edges[1].to", 24),
        (str(bad_files["cycle"]), "edges", out["problems"][2]["line"]),
    ]
    assert out["problems"][2]["message"] == "cycle: parse -> enrich -> parse"


def test_cli_missing_file_is_one_line(tmp_path):
    r = _validate("-f", tmp_path / "nope.yaml")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip() == f"{tmp_path / 'nope.yaml'}: file not found"


def test_absolute_sink_path_with_external_is_accepted(tmp_path):
    d = _demo_docs()
    _vertex(d, "raw")["sink"]["delta"].update(path=str(tmp_path / "raw"), external=True)
    p = load_specs([_write(tmp_path / "ext.yaml", d)]).only_pipeline()
    assert p.vertex("raw").sink.delta.path == str(tmp_path / "raw")


@pytest.mark.parametrize("name,text,words,line", [
    ("nul", "kind: Pipeline\nmetadata:\n  name: a\x00b\n", ["character U+0000 is not allowed"], 3),
    ("control", "kind: Pipeline\nmetadata:\n  name: a\x07b\n", ["character U+0007 is not allowed"], 3),
    ("nesting", "a: " + "[" * 500 + "]" * 500 + "\n", ["nested deeper than 32 levels"], 1),
    ("alias-bomb", "".join(f"{k}: &{k} [" + ",".join([f"*{p}" if p else "x"] * 9) + "]\n"
                           for k, p in zip("abcdefg", [None, *"abcdef"], strict=True)) + "h: [*g,*g]\n",
     ["values once aliases are expanded"], 6),
    ("kind-list", "kind: []\n", ["unknown kind []"], 1),  # found by test_spec_fuzz: an unhashable kind
    ("kind-map", "kind: {a: 1}\n", ["unknown kind {'a': 1}"], 1),
])
def test_hostile_yaml_is_one_located_problem(tmp_path, name, text, words, line):
    """NUL and control characters, deep nesting and alias bombs: one located problem, at once
    (the loader walks YAML events without recursion and never expands what it refuses)."""
    f = tmp_path / f"{name}.yaml"
    f.write_text(text)
    [problem] = _problems(f)
    assert all(w in str(problem) for w in words), str(problem)
    assert problem.line == line, str(problem)


def test_spec_file_size_is_bounded(tmp_path):
    f = tmp_path / "big.yaml"
    f.write_text("# " + "x" * (1 << 20) + "\n")
    [problem] = _problems(f)
    assert "a spec file may hold at most 1,048,576" in str(problem)


def test_a_thousand_vertex_chain_and_its_cycle_are_checked_without_recursion(tmp_path):
    vertices = ([{"name": "v0", "source": {"jetstream": {"subject": "x.y"}}}]
                + [{"name": f"v{i}", "udf": {"transform": "spark_apps.logs:parse"}} for i in range(1, 999)]
                + [{"name": "v999", "sink": {"delta": {"path": "t"}}}])
    edges = [{"from": f"v{i}", "to": f"v{i + 1}"} for i in range(999)]
    doc = {"apiVersion": "numaflow.numaproj.io/v1alpha1", "kind": "Pipeline", "metadata": {"name": "chain"},
           "spec": {"vertices": vertices, "edges": edges}}
    assert load_specs([_write(tmp_path / "chain.yaml", [doc])]).only_pipeline().name == "chain"
    edges.append({"from": "v998", "to": "v500"})
    problems = _problems(_write(tmp_path / "cycle.yaml", [doc]))
    assert any("cycle" in str(p) and "v500 -> v501" in str(p) for p in problems), problems


def test_problems_are_sorted_by_line(tmp_path):
    d = _demo_docs()
    _pl(d)["edges"][0].update(to="pars")  # a graph rule, checked after the fields
    _vertex(d, "parse").update(partitions=0)  # a field rule, above it in the file
    lines = [p.line for p in _problems(_write(tmp_path / "two.yaml", d))]
    assert lines == sorted(lines) and len(lines) == 2

