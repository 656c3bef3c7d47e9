"""The docs site builds with ``mkdocs build --strict``: every page in the nav, every link and
anchor resolves, and the generated reference pages (spec, CLI, Airflow classes: docs/hooks.py)
render from the code as it is."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.conftest import ROOT


def test_the_docs_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    for page in ("index.html", "get-started/first-pipeline/index.html", "operations/runbook/index.html",
                 "reference/spec/index.html", "reference/cli/index.html", "reference/airflow/index.html"):
        assert (site / page).is_file(), page
    cli = (site / "reference/cli/index.html").read_text()
    assert "isbflow pipeline run" in cli and "--trigger" in cli  # generated from the Typer app
    spec = (site / "reference/spec/index.html").read_text()
    assert "readTimeout" in spec and "retryStrategy" in spec  # generated from the models
    assert "PipelineStartOperator" in (site / "reference/airflow/index.html").read_text()
