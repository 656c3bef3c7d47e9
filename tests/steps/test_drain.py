"""The drain protocol's control side against a real nats-server (no Spark needed)."""

from __future__ import annotations

import asyncio

import pytest

from isbflow.isb import provision
from isbflow.isb import state as st
from isbflow.isb.connect import connect
from isbflow.spec import load_specs
from isbflow.steps.drain import DrainTimeout, drain_pipeline
from tests.conftest import ROOT


def _specs():
    return load_specs(ROOT / "pipelines" / "logs.yaml")


async def _drain_with_fake_steps(settings, pipeline, report_drained: set[str], timeout: float):
    """Steps that answer the control key by reporting drained, except those not in ``report_drained``."""
    nc = await connect(settings)
    try:
        for v in pipeline.topological_order():
            await st.put_status(nc, pipeline.name, st.StepStatus(v, state=st.Observed.RUNNING))
        told: list[str] = []

        async def steps():
            while True:
                for v in pipeline.topological_order():
                    if v in told:
                        continue
                    if await st.get_desired(nc, pipeline.name, v) == st.Desired.DRAINING:
                        told.append(v)
                        if v in report_drained:
                            await st.put_status(nc, pipeline.name, st.StepStatus(
                                v, state=st.Observed.DRAINED, final_offsets={"s": 1}))
                await asyncio.sleep(0.05)

        task = asyncio.create_task(steps())
        try:
            return await drain_pipeline(nc, pipeline, timeout=timeout, poll=0.05), told
        finally:
            task.cancel()
    finally:
        await nc.close()


def test_drain_tells_downstream_steps_only_after_their_inputs_drained(nats_server):
    specs = _specs()
    p = specs.only_pipeline()
    asyncio.run(provision.apply(nats_server.settings, specs))
    order = p.topological_order()
    final, told = asyncio.run(_drain_with_fake_steps(nats_server.settings, p, set(order), timeout=30))
    assert set(final) == set(order)
    # each step was told after every step feeding it
    for v in order:
        for e in p.inputs(v):
            assert told.index(e.from_) < told.index(v)


def test_drain_timeout_names_the_stuck_step(nats_server):
    specs = _specs()
    p = specs.only_pipeline()
    asyncio.run(provision.apply(nats_server.settings, specs))
    with pytest.raises(DrainTimeout) as e:
        asyncio.run(_drain_with_fake_steps(nats_server.settings, p, {"in", "parse"}, timeout=2))
    assert "step 'enrich'" in str(e.value) and "running" in str(e.value)
