"""isbflow is an Airflow provider: Airflow lists it and offers the ``nats`` connection type with its form.

Checked in a real Airflow (a fresh process, a temporary ``AIRFLOW_HOME``): the entry point
``apache_airflow_provider`` in pyproject.toml is what Airflow discovers, through the installed
distribution's metadata.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from isbflow.airflow import NATS_CONN_FIELDS, get_provider_info
from isbflow.platform import airflow_env
from tests.conftest import ROOT

AIRFLOW = str(ROOT / ".venv" / "bin" / "airflow")
#: what Airflow's ProvidersManager knows of the nats connection type, printed as JSON
PROBE = """
import json
from airflow.providers_manager import ProvidersManager
pm = ProvidersManager()
hook = pm.hooks["nats"]
print(json.dumps({
    "hook": [hook.hook_class_name, hook.package_name, hook.connection_type] if hook else None,
    "widgets": sorted(k for k, w in pm.connection_form_widgets.items() if w.package_name == "isbflow"),
    "sensitive": sorted(k for k, w in pm.connection_form_widgets.items() if w.is_sensitive),
    "behaviour": pm.field_behaviours.get("nats"),
    "names": pm.hooks["nats"].hook_name if hook else None,
}))
"""


@pytest.fixture
def env(tmp_path):
    (tmp_path / "dags").mkdir()
    return airflow_env(tmp_path / "airflow", tmp_path / "dags")


@pytest.mark.slow
def test_airflow_lists_isbflow_and_offers_the_nats_connection(env, tmp_path):
    listed = subprocess.run([AIRFLOW, "providers", "list", "-o", "json"], env=env, capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert listed.returncode == 0, listed.stderr[-2000:]
    providers = {p["package_name"]: p for p in json.loads(listed.stdout)}
    assert "isbflow" in providers, sorted(providers)

    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["hook"] == ["isbflow.airflow.hooks.jetstream.JetStreamHook", "isbflow", "nats"]
    assert seen["names"] == "NATS JetStream (isbflow ISB service)"
    assert seen["widgets"] == sorted(f"extra__nats__{f}" for f in NATS_CONN_FIELDS)
    assert "extra__nats__token" in seen["sensitive"]
    assert seen["behaviour"]["hidden_fields"] == ["schema"]
    assert seen["behaviour"]["relabeling"] == {"host": "Server(s)", "login": "User"}


def test_the_provider_info_names_modules_that_exist():
    """Every module the provider info lists imports, and the connection type's hook class is there."""
    import importlib

    info = get_provider_info()
    for kind in ("hooks", "operators", "sensors", "triggers"):
        for entry in info[kind]:
            for module in entry["python-modules"]:
                importlib.import_module(module)
    (conn,) = info["connection-types"]
    module, _, cls = conn["hook-class-name"].rpartition(".")
    hook = getattr(importlib.import_module(module), cls)
    assert hook.conn_type == conn["connection-type"] == "nats"
    assert hook.hook_name == conn["hook-name"]
