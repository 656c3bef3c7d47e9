"""The Airflow catalog (isbflow.airflow.catalog) loads the pipelines folder file by file: a file
that does not load, or whose derived names another file already claims, gets no DAGs and is named
in ``Catalog.errors``; the other files keep theirs."""

from __future__ import annotations

from isbflow.airflow.catalog import load_catalog
from tests.spec.test_derived import pipeline, write


def test_a_spec_claiming_another_specs_derived_names_gets_no_dags(tmp_path):
    write(tmp_path / "a.yaml", pipeline("a-ref-x", [("in", "s"), ("s", "out")]))
    write(tmp_path / "b.yaml", pipeline("a", [("in", "s"), ("s", "out")], refs={"s": ["x-control"]}))
    write(tmp_path / "c.yaml", pipeline("other", [("in", "s"), ("s", "out")]))
    (tmp_path / "d.yaml").write_bytes(b"kind: Pipeline\x00\n")

    cat = load_catalog(tmp_path)

    assert [(e.file, e.name) for e in cat.entries] == [("a.yaml", "a-ref-x"), ("c.yaml", "other")]
    assert sorted(cat.errors) == ["b.yaml", "d.yaml"]
    assert "derived bucket name 'isbflow-a-ref-x-control'" in cat.errors["b.yaml"]
    assert "a.yaml" in cat.errors["b.yaml"] and "line" in cat.errors["b.yaml"]
    assert "d.yaml" in cat.errors["d.yaml"]
