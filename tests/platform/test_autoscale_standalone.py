"""The autoscaler on a real Spark standalone cluster (one master, two one-core workers) on loopback.

``isbflow pipeline run --trigger continuous --master spark://...`` runs tests/specs/autoscale.yaml
(JSON events -> raw, Delta; the source with ``scale: {min: 1, max: 2}``, a 3 s lookback, a 10 s
scale-down cooldown) as a subprocess with its own client-mode driver, on a real nats-server. The
application takes both workers' cores when it starts; the autoscaler holds it at ``min``: one
executor. A burst published faster than the source reads (at most 10,000 events every 2 s) leaves
a backlog, which makes it ask for a second (the step's heartbeat says so, and the master grants
the application its second core); once the backlog is worked off and the cooldown has passed, it
releases one (the master's grant drops back to one core). Drained, the sink holds every event
exactly once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time

import pytest
from deltalake import DeltaTable

from isbflow.isb import provision
from isbflow.isb import state as st
from isbflow.isb.connect import connect
from isbflow.ops.pipeline import drain
from isbflow.ops.produce import produce
from isbflow.platform.standalone import start_standalone, stop_standalone
from isbflow.spec import load_specs
from isbflow.steps.driver import driver_env
from tests.conftest import ROOT
from tests.helpers.scale_env import ISBFLOW

pytestmark = pytest.mark.slow

SPEC = ROOT / "tests" / "specs" / "autoscale.yaml"
COUNT = 60_000
WAIT_S = 120


@pytest.fixture
def cluster(tmp_path):
    c = start_standalone(tmp_path / "spark", workers=2, cores=1, memory="1g")
    try:
        yield c
    finally:
        stop_standalone(c)
        assert not any(d.alive() for d in c.daemons()), "a Spark daemon outlived the test"


def _status(settings, p) -> st.StepStatus | None:
    async def go():
        nc = await connect(settings)
        try:
            return await st.get_status(nc, p.name, "in")
        finally:
            await nc.close()

    return asyncio.run(go())


def _granted(cluster) -> int | None:
    """The cores the master has granted the running application (one per one-core executor)."""
    apps = cluster.master_state().get("activeapps") or []
    return int(apps[0]["cores"]) if apps else None


def _until(what: str, check, proc: subprocess.Popen, log) -> dict:
    """Poll ``check`` (returns a dict of what it saw, or None) until it holds; fail naming ``what``."""
    deadline = time.monotonic() + WAIT_S
    seen = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the pipeline exited ({proc.returncode}) before {what}:\n{log.read_text()[-3000:]}"
        seen = check()
        if seen is not None and seen.get("ok"):
            return seen
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {WAIT_S}s; last seen {seen}\n{log.read_text()[-3000:]}")


def test_a_backlog_scales_to_two_executors_and_idle_releases_one(cluster, nats_server, tmp_path):
    settings = nats_server.settings
    specs = load_specs([SPEC])
    p = specs.only_pipeline()
    asyncio.run(provision.apply(settings, specs))
    data = tmp_path / "data"
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([ISBFLOW, "pipeline", "run", "-f", str(SPEC), "--trigger", "continuous", "--master",
                                 cluster.master_url, "--data-dir", str(data)], env=driver_env(settings, data, workdir=ROOT),
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def replicas(target: int, live: int, idle: bool = False, **counts: int):
            def check():
                s = _status(settings, p)
                r = (s.replicas or {}) if s is not None else {}
                ex = r.get("executors") or {}
                seen = {"target": r.get("target"), "live": ex.get("live"), "asked": ex.get("target"),
                        "granted": _granted(cluster), "lag": sum(s.lag.values()) if s is not None else None,
                        **{k: r.get(k) for k in counts}}
                seen["ok"] = (seen["target"], seen["asked"], seen["live"], seen["granted"]) == (target, target, live, live) \
                    and all((r.get(k) or 0) >= n for k, n in counts.items()) and (not idle or seen["lag"] == 0)
                return seen
            return check

        # started: the application took both cores, the autoscaler holds it at min
        _until("one executor at min", replicas(1, 1), proc, log)
        report = asyncio.run(produce(settings, p, count=COUNT, seed=3, malformed_every=None))
        assert report.published == COUNT
        _until("a scale-up to two executors", replicas(2, 2, ups=1), proc, log)
        # the backlog worked off, the cooldown passed: one executor released (while the backlog
        # shrinks the formula may ask for one and then two again: Numaflow's rule, not counted here)
        _until("a scale-down to one executor once idle", replicas(1, 1, idle=True, downs=1), proc, log)

        final = drain(settings, p, timeout=WAIT_S)
        assert final["in"].final_offsets == {"src-auto-in": COUNT}
        proc.wait(timeout=WAIT_S)
        assert proc.returncode == 0, log.read_text()[-3000:]
        # each decision is in the driver's log with its inputs
        text = log.read_text()
        assert re.search(r"autoscale in: up 1 -> 2 \(.*\); desired 2 within 1\.\.2, pending \[\d+\], rate", text), text[-3000:]
        assert re.search(r"autoscale in: down 2 -> 1 ", text), text[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)

    ids = DeltaTable(str(data / "sinks" / "auto" / "raw")).to_pyarrow_table(columns=["_isb_id"]).column("_isb_id")
    ids = ids.to_pylist()
    assert len(ids) == len(set(ids)), "duplicate _isb_id in the sink"
    assert set(ids) == {f"in/0/{i + 1}" for i in range(COUNT)}
