"""Where DAGs find pipeline specs, and the trigger-form parameter that picks one.

The spec folder is ``ISBFLOW_PIPELINES_DIR`` when set, else ``pipelines/`` in
the repository that holds the DAG file (``<repo>/dags/x.py`` ->
``<repo>/pipelines``). A spec is named by its file name relative to that folder
(``logs.yaml``); an absolute path is taken as is.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

ENV_DIR = "ISBFLOW_PIPELINES_DIR"
PROJECT_ENV = "ISBFLOW_PROJECT_DIR"
SUFFIXES = (".yaml", ".yml")


def pipelines_dir(dag_file: str | Path) -> Path:
    """The spec folder for DAGs living in ``dag_file``'s folder (see module docstring)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).resolve()
    return Path(dag_file).resolve().parent.parent / "pipelines"


def project_dir(dag_file: str | Path) -> Path:
    """Where launched drivers run and import the user's transforms (``spark_apps/``) from:
    ``ISBFLOW_PROJECT_DIR`` when set, else the repository holding the DAG file."""
    env = os.environ.get(PROJECT_ENV)
    return Path(env).resolve() if env else Path(dag_file).resolve().parent.parent


def pipeline_files(directory: Path) -> list[str]:
    """Spec file names under ``directory`` (recursively, sorted); empty when it does not exist."""
    if not directory.is_dir():
        return []
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*")
                  if p.suffix in SUFFIXES and p.is_file())


def resolve_pipeline_file(name: str | Path, directory: str | Path) -> Path:
    """``name`` relative to ``directory`` (absolute names unchanged); FileNotFoundError names both."""
    path = Path(name)
    if not path.is_absolute():
        path = Path(directory) / path
    if not path.is_file():
        known = ", ".join(pipeline_files(Path(directory))) or "none"
        raise FileNotFoundError(f"pipeline spec {name!r} not found at {path} (specs in {directory}: {known})")
    return path


def pipeline_param(directory: Path, default: str = "logs.yaml") -> Any:
    """A trigger-form ``Param`` whose choices are the spec files under ``directory``."""
    # lazy: airflow.sdk costs seconds; the UI app imports this module and is built and tested without Airflow
    from airflow.sdk import Param

    files = pipeline_files(directory)
    if not files:
        return Param(default, type="string",
                     description=f"Pipeline spec file (none found under {directory}; set {ENV_DIR}).")
    return Param(default if default in files else files[0], type="string", enum=files,
                 title="Pipeline spec",
                 description=f"Spec file under {directory}.")
