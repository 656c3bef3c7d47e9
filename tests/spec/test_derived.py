"""Derived stream, subject and bucket names never collide: within a pipeline, across the
pipelines of one file, and across every file validated together (isbflow.spec.derived)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from isbflow.isb import naming
from isbflow.spec import SpecError, derived, load_specs
from isbflow.spec.load import name_collisions
from tests.conftest import ROOT

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
T = "spark_apps.logs:parse"
FIXTURES = "tests.spec.transform_fixtures"


def pipeline(name: str, edges: list[tuple[str, str]], *, sources: dict[str, dict] | None = None,
             refs: dict[str, list[str]] | None = None, partitions: dict[str, int] | None = None) -> dict[str, Any]:
    """A Pipeline document: the first vertex of the first edge and every name in ``sources`` are
    sources, vertices without outputs are sinks, the others udfs (with ``refs`` as references)."""
    names = list(dict.fromkeys(n for e in edges for n in e))
    outs = {a for a, _ in edges}
    srcs = sources or {edges[0][0]: {"subject": f"{name}.events"}}
    vertices = []
    for n in names:
        if n in srcs:
            v: dict[str, Any] = {"name": n, "source": {"jetstream": srcs[n]}}
        elif n not in outs:
            v = {"name": n, "sink": {"delta": {"path": f"sinks/{name}/{n}"}}}
        else:
            v = {"name": n, "udf": {"transform": T}}
            if refs and n in refs:  # a transform taking any reference by name
                v["udf"] = {"transform": f"{FIXTURES}:passthrough",
                            "references": [{"name": r, "key": "service"} for r in refs[n]]}
        if partitions and n in partitions:
            v["partitions"] = partitions[n]
        vertices.append(v)
    spec = {"vertices": vertices, "edges": [{"from": a, "to": b} for a, b in edges]}
    if refs:
        spec["transformPackages"] = [FIXTURES]
    return {"kind": "Pipeline", "metadata": {"name": name}, "spec": spec}


def write(path: Path, *docs: dict) -> Path:
    path.write_text(yaml.safe_dump_all(list(docs), sort_keys=False))
    return path


def problems(*paths: Path) -> list:
    with pytest.raises(SpecError) as e:
        load_specs(list(paths))
    return e.value.problems


def line_of(path: Path, text: str, nth: int = 0) -> int:
    return [i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line][nth]


def test_the_scheme_is_unchanged():
    """Existing deployments keep their names: the demo's as they always were."""
    p = load_specs(ROOT / "pipelines" / "logs.yaml").only_pipeline()
    assert [ep.stream for ep in naming.edge_partitions(p)][:3] == [
        "isb-logs-in-parse-0", "isb-logs-in-parse-1", "isb-logs-parse-enrich-0"]
    assert naming.edge_partitions(p)[0].subject == "isb.logs.in.parse.0"
    assert naming.source_stream(p, "in") == "src-logs-in"
    assert (naming.dlq_stream("logs"), naming.dlq_subject("logs", "parse"), naming.dlq_subjects("logs")) == (
        "isb-logs-dlq", "isb.logs.dlq.parse", "isb.logs.dlq.>")
    assert [naming.control_bucket("logs"), naming.status_bucket("logs"), naming.ledger_bucket("logs"),
            naming.reference_bucket("logs", "services")] == [
        "isbflow-logs-control", "isbflow-logs-status", "isbflow-logs-ledger", "isbflow-logs-ref-services"]


def test_two_edges_of_one_pipeline_deriving_one_stream_are_refused(tmp_path):
    f = write(tmp_path / "p.yaml", pipeline("p", [("a", "b-c"), ("a", "a-b"), ("a-b", "c"), ("b-c", "x")]))
    [problem] = problems(f)
    assert problem.file == str(f) and problem.path == "edges[2]"
    assert problem.line == line_of(f, "from: a-b")
    msg = problem.message
    assert "derived stream name 'isb-p-a-b-c-0' (buffer a-b -> c, partition 0)" in msg
    assert f"is also derived from edges[0] (buffer a -> b-c, partition 0, line {line_of(f, 'to: b-c') - 1})" in msg


def test_a_partition_number_can_meet_a_vertex_name(tmp_path):
    """a -> b-1 (partition 0) and a-b -> 1 (partitions 0 and 1) both derive isb-q-a-b-1-0."""
    f = write(tmp_path / "q.yaml", pipeline("q", [("a", "b-1"), ("a", "a-b"), ("a-b", "1"), ("b-1", "z"),
                                                  ("1", "z")], partitions={"1": 2}))
    [problem] = problems(f)
    assert problem.path == "edges[2]" and "'isb-q-a-b-1-0' (buffer a-b -> 1, partition 0)" in problem.message


def test_a_reference_bucket_meeting_another_pipelines_control_bucket_across_files(tmp_path):
    """Pipeline a's reference table x-control is the control bucket of pipeline a-ref-x."""
    first = write(tmp_path / "first.yaml", pipeline("a-ref-x", [("in", "s"), ("s", "out")]))
    second = write(tmp_path / "second.yaml",
                   pipeline("a", [("in", "s"), ("s", "out")], refs={"s": ["x-control"]}))
    assert load_specs(first) and load_specs(second)  # each alone is valid
    [problem] = problems(first, second)
    assert problem.file == str(second) and problem.path == "vertices[1].udf.references[0].name"
    assert problem.line == line_of(second, "name: x-control")
    assert ("derived bucket name 'isbflow-a-ref-x-control' (reference table x-control) is also derived from "
            f"pipeline a-ref-x's metadata.name (control bucket, line {line_of(first, 'name: a-ref-x')}) "
            f"in {first}") in problem.message
    # the Airflow catalog loads file by file: the same check across what it loaded
    [again] = name_collisions(load_specs(first), load_specs(second))
    assert again == problem


def test_two_pipelines_deriving_one_stream(tmp_path):
    """Pipeline p's source a-b and edge a-b -> c meet pipeline p-a's source b and edge b -> c."""
    f = write(tmp_path / "two.yaml", pipeline("p", [("a-b", "c"), ("c", "z")]),
              pipeline("p-a", [("b", "c"), ("c", "z")]))
    found = problems(f)
    assert [(p.path, p.line) for p in found] == [("vertices[0].name", line_of(f, "name: b")),
                                                 ("edges[0]", line_of(f, "from: b"))]
    assert "'src-p-a-b' (stream of source b) is also derived from pipeline p's vertices[0].name " \
           "(stream of source a-b" in found[0].message
    assert "'isb-p-a-b-c-0' (buffer b -> c, partition 0) is also derived from pipeline p's edges[0] " \
           "(buffer a-b -> c, partition 0" in found[1].message


def test_a_vertex_named_dlq_feeds_the_dead_letter_stream(tmp_path):
    """isb.p.dlq.x.0 falls under the dead-letter stream's isb.p.dlq.>: JetStream would refuse it."""
    f = write(tmp_path / "p.yaml", pipeline("p", [("in", "dlq"), ("dlq", "x"), ("x", "out")]))
    [problem] = problems(f)
    assert problem.path == "edges[1]"
    assert "derived subject name 'isb.p.dlq.x.0' (buffer dlq -> x, partition 0) overlaps 'isb.p.dlq.>'" \
        in problem.message
    assert "metadata.name (dead-letter subjects" in problem.message


def test_source_subjects_and_named_streams(tmp_path):
    # two pipelines' sources on one subject: two streams, overlapping subjects
    f = write(tmp_path / "a.yaml", pipeline("p", [("in", "out")], sources={"in": {"subject": "ev.x"}}),
              pipeline("q", [("in", "out")], sources={"in": {"subject": "ev.x"}}))
    [problem] = problems(f)
    assert problem.path == "vertices[0].source.jetstream.subject" and "'ev.x'" in problem.message
    # one stream named by both: the producers' stream, read by both (one subject): fine
    shared = {"in": {"subject": "ev.x", "stream": "events"}}
    ok = write(tmp_path / "b.yaml", pipeline("p", [("in", "out")], sources=shared),
               pipeline("q", [("in", "out")], sources=shared))
    assert sorted(load_specs(ok).pipelines) == ["p", "q"]
    # a named stream that takes a name isbflow derives for a buffer: inside isbflow's namespace
    f = write(tmp_path / "c.yaml", pipeline("p", [("a", "b"), ("b", "z")]),
              pipeline("q", [("in", "out")], sources={"in": {"subject": "ev.y", "stream": "isb-p-a-b-0"}}))
    [problem] = problems(f)
    assert problem.path == "vertices[0].source.jetstream.stream"
    assert "'isb-p-a-b-0' is inside isbflow's own namespace" in problem.message


@pytest.mark.parametrize("named_first", [False, True])
def test_a_named_stream_meets_any_partition_of_an_edge(tmp_path, named_first):
    """Edges are claimed once, not per partition: partition 2 of a -> b is still found (a spec can no
    longer name such a stream, but a grant or a server's stream can hold one: :mod:`isbflow.isb.owners`)."""
    p = load_specs(write(tmp_path / "p.yaml", pipeline("p", [("a", "b"), ("b", "z")], partitions={"b": 3})))
    edge = [c for c in derived.claims(p.only_pipeline()) if c.kind == "stream" and c.partitions]

    def named(stream: str) -> derived.Claim:
        return derived.Claim("stream", stream, "q", ("x",), "stream named by source in", ("named-stream", stream))

    found = derived.collisions([named("isb-p-a-b-2"), *edge] if named_first else [*edge, named("isb-p-a-b-2")])
    assert [(c.name, o.name, c.pipeline) for c, o in found] == (
        [("isb-p-a-b-2", "isb-p-a-b-2", "p")] if named_first else [("isb-p-a-b-2", "isb-p-a-b-2", "q")])
    assert not derived.collisions([*edge, named("isb-p-a-b-3")])  # a -> b has no partition 3


@pytest.mark.parametrize(("field", "value"), [
    ("stream", "isb-logs-in-parse-0"), ("stream", "src-logs-in"), ("stream", "isbflow-logs-control"),
    ("subject", "isb.logs.in.parse.0"), ("subject", "isb.logs.dlq.parse"), ("subject", "_INBOX_pipeline-logs.x"),
    ("subject", "isbflow.x")])
def test_a_spec_naming_isbflows_own_namespace_is_refused(tmp_path, field, value):
    """A stream or subject isbflow derives belongs to some pipeline: a spec may not name one (it would
    hand its user read and purge on another pipeline's buffer, or its producer publish there)."""
    src = {"subject": "ev.x", "stream": "events", field: value}
    f = write(tmp_path / "steal.yaml", pipeline("steal", [("in", "out")], sources={"in": src}))
    [problem] = problems(f)
    assert (problem.file, problem.path) == (str(f), f"vertices[0].source.jetstream.{field}")
    assert problem.line == line_of(f, f"{field}: {value}")
    assert f"'{value}' is inside isbflow's own namespace" in problem.message


def test_one_reference_table_joined_by_two_steps_is_one_bucket(tmp_path):
    f = write(tmp_path / "p.yaml", pipeline("p", [("in", "s"), ("s", "t"), ("t", "out")],
                                            refs={"s": ["services"], "t": ["services"]}))
    assert load_specs(f).only_pipeline().name == "p"


def test_every_example_spec_validates_together():
    """The project's pipelines/ as the Airflow catalog sees it: no two derive one name."""
    files = sorted((ROOT / "pipelines").rglob("*.yaml"))
    assert files
    load_specs(files)


def test_cli_validate_checks_across_its_files(tmp_path):
    first = write(tmp_path / "first.yaml", pipeline("p", [("in", "a-b"), ("a-b", "c"), ("c", "z")]))
    second = write(tmp_path / "second.yaml", pipeline("p-a", [("in", "b"), ("b", "c"), ("c", "z")]))
    for f in (first, second):
        r = subprocess.run([ISBFLOW, "validate", "-f", str(f)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
    r = subprocess.run([ISBFLOW, "validate", "-f", str(first), "-f", str(second)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    [line] = r.stderr.splitlines()
    assert line.startswith(f"{second}: edges[1]: derived stream name 'isb-p-a-b-c-0'")
    assert f"pipeline p's edges[1] (buffer a-b -> c, partition 0, line {line_of(first, 'from: a-b')}) " \
           f"in {first}" in line
