"""Scale to zero on Redis buffers: tests/ops/test_zero.py's watcher (the CLI in a subprocess, real
detached Spark drivers) on zero-mini's pipeline with a native Redis service
(tests/specs/zero-redis.yaml): it starts the pipeline for the events already produced, drains it
away once they are in the sink, starts it again when more land on the Redis source stream, and the
sink holds every event exactly once."""

from __future__ import annotations

import asyncio

import pytest

from isbflow.isb import naming
from isbflow.local.procs import process_alive
from isbflow.ops import isb as ops_isb
from isbflow.ops import pipeline as ops
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from tests.conftest import ROOT
from tests.ops.test_zero import Watcher, sink_ids

pytestmark = pytest.mark.slow

SPEC = ROOT / "tests" / "specs" / "zero-redis.yaml"


@pytest.mark.timeout(600)
def test_a_pipeline_on_redis_sleeps_and_wakes_on_new_data(redis_server, tmp_path):
    data_dir, admin = redis_server.data_dir, redis_server.settings()
    specs = load_specs([SPEC])
    p = specs.only_pipeline()
    ops_isb.apply(admin, specs, p.name, data_dir=data_dir)
    source = naming.source_stream(p, "in")
    first, more = 300, 200
    assert asyncio.run(produce(admin, p, count=first, seed=3, malformed_every=None)).published == first

    watcher = Watcher(data_dir, tmp_path / "watcher.jsonl", spec=SPEC)
    try:
        events = watcher.wait_for("asleep", 1, 300)
        pid = next(e for e in events if e["action"] == "awake")["inputs"]["driver_pid"]
        slept = next(e for e in events if e["action"] == "asleep")
        assert slept["inputs"]["final_offsets"]["in"] == {source: first} and not process_alive(pid)
        assert sorted(sink_ids(data_dir, p.name)) == sorted(f"in/0/{i}" for i in range(1, first + 1))

        assert asyncio.run(produce(admin, p, count=more, seed=3, start=first, malformed_every=None)).published == more
        events = watcher.wait_for("asleep", 2, 300)
        awake = [e for e in events if e["action"] == "awake"]
        assert len(awake) == 2 and awake[1]["inputs"]["driver_pid"] != pid
        wake = [e for e in events if e["action"] == "wake"][-1]
        assert wake["inputs"]["grown"][source]["committed"] == first
        ids = sink_ids(data_dir, p.name)
        assert len(ids) == len(set(ids)), "an event landed twice"
        assert set(ids) == {f"in/0/{i}" for i in range(1, first + more + 1)}
        assert watcher.stop() == 0
    finally:
        watcher.stop()
        ops.stop_launch(data_dir, p, grace=20)
