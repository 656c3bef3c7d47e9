"""The local platform's pipeline on a native Redis service (``pipelines/logs-redis.yaml``), as
``isbflow platform up -f pipelines/logs-redis.yaml`` runs it.

The platform's producer (``isbflow produce`` as the ``producer`` ACL user, which may write source
streams and read nothing) writes the provisioned source stream. The whole pipeline, minus Airflow (its start would more
than double this test's wall time; Airflow's processes and their stopping are the live platform's
tests, tests/e2e/test_platform.py): the platform's nats-server, then :func:`isbflow.platform.run_pipeline`
starts the spec's redis-server, provisions the pipeline there, launches its driver as the pipeline's
ACL user and a producer as the ``producer`` user, and waits for every step; the steps heartbeat
``running`` on Redis, the raw sink gets rows, :func:`isbflow.platform.status` shows the redis-server
without its password; :func:`isbflow.platform.stop` drains the pipeline and stops every process
started, redis-server included, by PID.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest

from isbflow import platform
from isbflow.isb import server as nats_server
from isbflow.isb.redis.server import read_state as read_redis_state
from isbflow.isb.roles import PRODUCER, pipeline_user
from isbflow.ops import isb as ops_isb
from isbflow.ops import isb_service
from isbflow.spec import load_specs
from tests.helpers.live_platform import ROOT, alive, delta_ids, delta_rows, wait_for

pytestmark = pytest.mark.slow

SPEC = ROOT / "pipelines" / "logs-redis.yaml"


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").partition("=")[::2] for kv in raw if b"=" in kv)


def test_the_platforms_producer_writes_the_source_stream_as_the_producer_user(tmp_path):
    specs = load_specs(SPEC)
    p = specs.only_pipeline()
    dd = tmp_path / "data"
    isb_service.up(specs.service_for(p), dd)
    try:
        admin = platform.pipeline_settings(dd, specs, p)
        ops_isb.apply(admin, specs, p.name, data_dir=dd)
        # 3 s of producing: its environment is read while it runs (an exited one's reads empty)
        opts = platform.PipelineOptions(str(SPEC), rate=200, count=600)
        proc = platform.start_producer(dd, opts, p, admin, "test", first=0)
        assert environ(proc.pid)["REDIS_USER"] == PRODUCER
        _, status = os.waitpid(proc.pid, 0)
        log = Path(proc.log).read_text()
        assert os.waitstatus_to_exitcode(status) == 0, log
        assert json.loads(log[log.index("{"):])["published"] == 600
    finally:
        isb_service.down(specs.service_for(p), dd)


def test_the_redis_demo_runs_on_the_platform_and_stops_with_it(tmp_path):
    dd = (tmp_path / "data").resolve()
    nats_server.start_embedded(dd, client_port=nats_server.free_port())
    state = platform.PlatformState(str(dd), str(dd / "airflow"), 1, str(ROOT / "dags"), supervisor_pid=0,
                                   nats_started=True, marker=uuid.uuid4().hex[:16])
    platform.write_state(state)
    opts = platform.PipelineOptions(str(SPEC), rate=100, processing_time="2 seconds", wait=300)
    pids: set[int] = set()
    try:
        report = platform.run_pipeline(state, opts)
        assert report.check is not None and report.check.done, report.check
        assert state.redis and state.redis_started
        redis = read_redis_state(dd)
        assert redis is not None and redis.alive()
        # the driver logs in as the pipeline's ACL user, the producer as 'producer': neither as the admin
        assert environ(report.launch.pid)["REDIS_USER"] == pipeline_user("logs-redis")
        assert environ(report.producer.pid)["REDIS_USER"] == PRODUCER
        assert "NATS_URL" not in environ(report.producer.pid)
        raw = dd / "sinks" / "logs-redis" / "raw"
        wait_for(lambda: delta_rows(raw), 180, "rows in the raw sink")

        st = platform.status(dd, cpu_interval=0.1)
        steps = st["pipeline"]["steps"]
        assert steps and all(s["state"] == "running" for s in steps.values()), {v: s and s["state"] for v, s in steps.items()}
        assert st["pipeline"]["source_messages"] > 0  # read from the Redis source stream
        r = st["redis"]
        assert (r["pid"], r["url"], r["alive"], r["started_by_platform"]) == (
            redis.pid, f"redis://127.0.0.1:{redis.port}", True, True)
        assert r["password_file"] == str(dd / "redis" / "password") and redis.password not in repr(st)

        nats = nats_server.read_state(dd)
        pids = {redis.pid, report.launch.pid, report.producer.pid, *(n.pid for n in nats.nodes),
                *platform.platform_processes(state)}
    finally:
        stopped = platform.stop(dd, drain_timeout=120)
    assert stopped is not None and list(stopped.drained.values()) == ["drained"], stopped.drained
    wait_for(lambda: not alive(pids), 20, "every process of the platform to exit", every=0.5)
    assert read_redis_state(dd) is None and platform.read_state(dd) is None
    ids = delta_ids(raw)
    assert ids and len(ids) == len(set(ids)), "duplicate _isb_id in the raw sink"
