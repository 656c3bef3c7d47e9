"""Fixtures of the step tests."""

from __future__ import annotations

import asyncio
import json

import pytest

from isbflow.isb import provision, reference
from isbflow.spec import load_specs
from tests.conftest import ROOT


@pytest.fixture
def demo(nats_server, tmp_path):
    """The demo spec (pipelines/logs.yaml) provisioned on a fresh server, its ``services`` reference
    table loaded: ``(specs, pipeline, settings, data_dir)``."""
    specs = load_specs(ROOT / "pipelines" / "logs.yaml")
    p = specs.only_pipeline()
    settings = nats_server.settings
    asyncio.run(provision.apply(settings, specs))
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())
    asyncio.run(reference.put(settings, p.name, "services", rows))
    return specs, p, settings, tmp_path
