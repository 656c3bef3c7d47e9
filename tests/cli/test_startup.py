"""``isbflow --help`` stays quick: importing the CLI loads no client, engine or model library.

Every command group registers when :mod:`isbflow.cli` is imported, so what a command module imports
at its top is paid by every ``isbflow`` call, ``--help`` and ``--version`` included; the layers below
(the spec's models, the ops verbs) are imported by the commands that use them.
"""

from __future__ import annotations

import os
import subprocess

from isbflow.cli import platform as cli_platform
from tests.conftest import ROOT
from tests.test_layout import heavy_modules_loaded

ISBFLOW = str(ROOT / ".venv" / "bin" / "isbflow")
#: what importing the CLI must not load: Spark, NATS, Delta, Arrow, GX, Airflow, and pydantic and
#: yaml (the spec's models: ~0.4 s of start-up)
NOT_AT_START = ("pyspark", "nats", "deltalake", "pyarrow", "great_expectations", "airflow", "pydantic", "yaml")


def test_importing_the_cli_loads_no_heavy_library():
    assert heavy_modules_loaded(["isbflow.cli"], heavy=NOT_AT_START) == []


def test_the_import_check_sees_a_heavy_library():
    """The check above can fail: a module that does import NATS and pydantic is caught."""
    assert heavy_modules_loaded(["isbflow.ops.connection"], heavy=NOT_AT_START) != []


def test_help_lists_every_command_group():
    done = subprocess.run([ISBFLOW, "--help"], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    for group in ("validate", "init", "spec", "nats", "isb", "produce", "ref", "platform", "pipeline", "step",
                  "replay", "quality", "sink"):
        assert f" {group} " in done.stdout, (group, done.stdout)


def test_the_platform_defaults_in_the_help_are_the_platforms():
    """``isbflow platform up --help`` shows defaults written in the CLI module (importing
    :mod:`isbflow.platform` there would load NATS for every command): they are the platform's own."""
    from isbflow import platform

    assert cli_platform.DEFAULT_API_PORT == platform.DEFAULT_API_PORT
    assert cli_platform.DEFAULT_NATS_PORT == platform.DEFAULT_NATS_PORT
    assert cli_platform.DEFAULT_RATE == platform.DEFAULT_RATE
