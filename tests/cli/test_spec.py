"""``isbflow init``, ``isbflow spec schema`` and ``isbflow --version``, run as a user would: the
installed console script, in a subprocess."""

from __future__ import annotations

import json
import re
import subprocess
from importlib.metadata import version
from pathlib import Path

import jsonschema
import yaml

from isbflow.spec.schema import SCHEMA_FILE
from tests.conftest import ROOT

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")


def isbflow(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([ISBFLOW, *args], capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, cwd=cwd)


def test_init_writes_a_spec_and_a_transform_that_validate(tmp_path):
    done = isbflow("init", "clicks", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    spec = tmp_path / "pipelines" / "clicks.yaml"
    assert (tmp_path / "spark_apps" / "clicks.py").is_file() and (tmp_path / "spark_apps" / "__init__.py").is_file()

    checked = isbflow("validate", "-f", "pipelines/clicks.yaml", "--json", cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr
    assert json.loads(checked.stdout) == {"valid": True, "pipelines": ["clicks"], "services": ["default"], "warnings": []}

    schema = re.match(r"^# yaml-language-server: \$schema=(\S+)$", spec.read_text().splitlines()[0])
    assert schema and (spec.parent / schema.group(1)).resolve() == SCHEMA_FILE.resolve()
    v = jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text()))
    for doc in yaml.safe_load_all(spec.read_text()):
        assert not list(v.iter_errors(doc)), doc


def test_init_overwrites_nothing_and_refuses_a_bad_name(tmp_path):
    assert isbflow("init", "orders-eu", cwd=tmp_path).returncode == 0
    transform = tmp_path / "spark_apps" / "orders_eu.py"
    transform.write_text("# edited\n")
    again = isbflow("init", "orders-eu", cwd=tmp_path)
    assert again.returncode == 2 and "already there, nothing written" in again.stderr, again.stderr
    assert transform.read_text() == "# edited\n"
    for bad in ("Orders", "1orders", "orders_eu"):
        refused = isbflow("init", bad, "--dir", str(tmp_path / "other"), cwd=tmp_path)
        assert refused.returncode == 2 and "NAME:" in refused.stderr, (bad, refused.stderr)
    assert not (tmp_path / "other").exists()


def test_spec_schema_prints_the_shipped_schema(tmp_path):
    done = isbflow("spec", "schema")
    assert done.returncode == 0, done.stderr
    assert done.stdout == SCHEMA_FILE.read_text()
    out = tmp_path / "schema.json"
    assert isbflow("spec", "schema", "--output", str(out)).returncode == 0
    assert out.read_text() == SCHEMA_FILE.read_text()


def test_version_is_the_installed_distributions():
    done = isbflow("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"isbflow {version('isbflow')}\n"
