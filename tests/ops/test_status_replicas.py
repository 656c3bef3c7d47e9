"""``isbflow pipeline status`` on a real nats-server shows a scaled step's autoscaler: the line of its
last decision (replicas, desired within min..max, why, executors), and ``--json`` the whole decision;
a step without scale gets no line."""

from __future__ import annotations

import asyncio
import json

from typer.testing import CliRunner

from isbflow.isb import provision
from isbflow.isb import state as st
from isbflow.isb.connect import connect
from isbflow.spec import load_specs
from tests.airflow.test_ui_replicas import DECISION
from tests.conftest import ROOT

SPEC = str(ROOT / "tests" / "specs" / "autoscale.yaml")


def test_pipeline_status_shows_the_autoscalers_replicas(nats_server):
    from isbflow.cli import app

    specs = load_specs(SPEC)
    asyncio.run(provision.apply(nats_server.settings, specs))

    async def beat():
        nc = await connect(nats_server.settings)
        try:
            await st.put_status(nc, "auto", st.StepStatus("in", state="running", replicas=DECISION))
            await st.put_status(nc, "auto", st.StepStatus("raw", state="running"))
        finally:
            await nc.close()

    asyncio.run(beat())
    base = ["pipeline", "status", "-f", SPEC, "--data-dir", str(nats_server.data_dir)]
    r = CliRunner().invoke(app, base)
    assert r.exit_code == 0, r.output
    assert "in: replicas 2, desired 2 (1..2; backlog: pending [96000], 41,000.0 rows/s); executors 1 of 2" in r.stdout
    assert "raw: replicas" not in r.stdout
    r = CliRunner().invoke(app, [*base, "--json"])
    assert r.exit_code == 0, r.output
    steps = json.loads(r.stdout)["steps"]
    assert steps["in"]["replicas"]["target"] == 2 and steps["raw"]["replicas"] is None


def test_status_of_a_pipeline_not_provisioned_says_so(nats_server):
    """No status bucket on the server: one error naming the bucket and what to run (the key-value
    role reports a missing bucket whichever store)."""
    import pytest

    from isbflow.ops.status import NotProvisioned, read

    p = load_specs(SPEC).only_pipeline()

    async def go():
        nc = await connect(nats_server.settings)
        try:
            return await read(nc, p)
        finally:
            await nc.close()

    with pytest.raises(NotProvisioned, match="not provisioned yet"):
        asyncio.run(go())
