"""Transforms are resolved when the spec is validated: importable, callable with the DataFrame
and the vertex's references, and only from the project's spark_apps, the package holding the
spec, or a package the pipeline declares (isbflow.spec.transforms)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from isbflow.spec import SpecError, load_specs
from tests.conftest import ROOT

DEMO = ROOT / "pipelines" / "logs.yaml"
ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
FIXTURES = "tests.spec.transform_fixtures"


def demo(tmp_path: Path, transform: str, *, packages: list | None = None, name: str = "spec.yaml",
         vertex: str = "parse") -> Path:
    """The demo with ``vertex``'s transform replaced (and ``transformPackages`` set)."""
    docs = [d for d in yaml.safe_load_all(DEMO.read_text()) if d]
    next(v for v in docs[1]["spec"]["vertices"] if v["name"] == vertex)["udf"]["transform"] = transform
    if packages is not None:
        docs[1]["spec"]["transformPackages"] = packages
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
    return path


def one_problem(path: Path):
    with pytest.raises(SpecError) as e:
        load_specs(path)
    [problem] = e.value.problems
    return problem


@pytest.mark.parametrize("transform, words", [
    ("no_such_module:nope", ["module 'no_such_module' is not a transform module isbflow may load",
                             "allowed here: spark_apps"]),
    ("os:system", ["module 'os' is not a transform module isbflow may load"]),
    ("isbflow.cli:app", ["module 'isbflow.cli' is not a transform module"]),
    ("spark_apps.nope:parse", ["cannot import 'spark_apps.nope': no module named 'spark_apps.nope'"]),
    ("spark_apps.logs:nope", ["module 'spark_apps.logs' has no 'nope'"]),
    ("spark_apps.logs:WINDOW", ["spark_apps.logs:WINDOW is a str, not a function"]),
    ("spark_apps.logs:enrich", ["cannot be called as enrich(df)", "missing a required argument: 'services'"]),
])
def test_a_transform_that_would_fail_later_is_refused_at_its_line(tmp_path, transform, words):
    f = demo(tmp_path, transform)
    problem = one_problem(f)
    assert (problem.file, problem.path) == (str(f), "vertices[1].udf.transform")
    assert problem.line == next(i for i, line in enumerate(f.read_text().splitlines(), 1) if transform in line)
    assert all(w in problem.message for w in words), problem.message


def test_references_are_passed_by_name(tmp_path):
    """enrich reads reference table 'services': parse, which takes no references, cannot stand in."""
    problem = one_problem(demo(tmp_path, "spark_apps.logs:parse", vertex="enrich"))
    assert problem.path == "vertices[2].udf.transform"
    assert "cannot be called as parse(df, services=...)" in problem.message
    assert "unexpected keyword argument 'services'" in problem.message


def test_a_declared_package(tmp_path):
    refused = one_problem(demo(tmp_path, f"{FIXTURES}:passthrough"))
    assert f"module '{FIXTURES}' is not a transform module" in refused.message
    specs = load_specs(demo(tmp_path, f"{FIXTURES}:passthrough", packages=[FIXTURES], name="declared.yaml"))
    assert specs.only_pipeline().spec.transformPackages == [FIXTURES]
    load_specs(demo(tmp_path, f"{FIXTURES}:with_services", packages=["tests.spec"], vertex="enrich", name="e.yaml"))
    broken = one_problem(demo(tmp_path, "tests.spec.transform_broken:f", packages=["tests.spec"], name="b.yaml"))
    assert broken.path == "vertices[1].udf.transform"
    assert broken.message == ("importing 'tests.spec.transform_broken' failed: RuntimeError: this module "
                              "cannot be imported second line")
    not_callable = one_problem(demo(tmp_path, f"{FIXTURES}:NOT_A_FUNCTION", packages=[FIXTURES], name="n.yaml"))
    assert "is a int, not a function" in not_callable.message


@pytest.mark.parametrize("package, words", [
    ("os", ["'os' is Python's standard library"]),
    ("importlib.util", ["'importlib.util' is Python's standard library"]),
    ("isbflow.steps", ["isbflow's own modules are not transforms"]),
    ("../x", ["'../x' is not a Python package name"]),
    ("acme\n", ["is not a Python package name"]),
])
def test_what_cannot_be_declared(tmp_path, package, words):
    problem = one_problem(demo(tmp_path, "spark_apps.logs:parse", packages=[package]))
    assert problem.path == "transformPackages"
    assert all(w in problem.message for w in words), problem.message


def test_a_spec_may_use_the_package_that_holds_it(tmp_path):
    """tests/specs/*.yaml use tests.helpers: the package holding them. A copy elsewhere may not."""
    spec = ROOT / "tests" / "specs" / "reprocess-logs.yaml"
    assert "tests.helpers.reprocess_transforms:tag" in spec.read_text()
    load_specs(spec)
    copy = tmp_path / "reprocess-logs.yaml"
    shutil.copy(spec, copy)
    with pytest.raises(SpecError) as e:
        load_specs(copy)
    assert {p.path for p in e.value.problems} == {"vertices[1].udf.transform", "vertices[2].udf.transform"}
    assert all("module 'tests.helpers.reprocess_transforms' is not a transform module" in p.message
               for p in e.value.problems)


def test_every_spec_of_the_project_resolves_its_transforms():
    for f in [*sorted((ROOT / "pipelines").rglob("*.yaml")), *sorted((ROOT / "tests" / "specs").glob("*.yaml"))]:
        load_specs(f)


def _validate(spec: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([ISBFLOW, "validate", "-f", str(spec)], capture_output=True, text=True, timeout=60, cwd=cwd)


def test_the_project_is_the_folder_holding_spark_apps(tmp_path):
    """Another project's spark_apps, found above its spec wherever isbflow runs from: its own
    modules resolve, the repository's do not."""
    project = tmp_path / "project"
    (project / "spark_apps").mkdir(parents=True)
    (project / "spark_apps" / "__init__.py").write_text("")
    (project / "spark_apps" / "mine.py").write_text("def clean(df):\n    return df\n")
    (project / "pipelines").mkdir()
    ok = demo(project / "pipelines", "spark_apps.mine:clean", name="ok.yaml")
    r = _validate(ok, cwd=tmp_path)
    # the demo's other udfs name the repository's spark_apps.logs, which this project has not
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["vertices[2].udf.transform", "vertices[3].udf.transform"]
    assert all("cannot import 'spark_apps.logs': no module named 'spark_apps.logs'" in line for line in lines)
    shutil.copy(ROOT / "spark_apps" / "logs.py", project / "spark_apps" / "logs.py")
    assert _validate(ok, cwd=tmp_path).returncode == 0
    r = _validate(demo(project / "pipelines", "spark_apps.mine:nope", name="bad.yaml"), cwd=tmp_path)
    assert r.returncode == 2 and "module 'spark_apps.mine' has no 'nope'" in r.stderr


def test_cli_refuses_os_system_in_one_line(tmp_path):
    r = _validate(demo(tmp_path, "os:system"), cwd=ROOT)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1
    assert ": vertices[1].udf.transform: module 'os' is not a transform module isbflow may load" in r.stderr


def test_resolving_transforms_starts_no_spark():
    """A transform module only defines functions: validating imports it, and starts no JVM."""
    code = ("import sys\n"
            "from isbflow.spec import load_specs\n"
            f"load_specs({str(DEMO)!r})\n"
            "assert 'spark_apps.logs' in sys.modules and 'pyspark.sql' in sys.modules\n"
            "from pyspark import SparkContext\n"
            "assert SparkContext._gateway is None and SparkContext._active_spark_context is None\n"
            "import psutil\n"
            "kids = psutil.Process().children(recursive=True)\n"  # a race-free look: no JVM was started
            "assert not kids, kids\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr
