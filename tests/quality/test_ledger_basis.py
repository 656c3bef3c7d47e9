"""Completeness on the offset ledger: what a sink must hold, and the committed low watermark.

:func:`~isbflow.quality.checks.judge_partition` is pure range arithmetic. The
walk that proves the committed low watermark
(:func:`~isbflow.isb.ledger.committed_watermarks`) runs against a real
nats-server with the demo's buffers, whose status keys (committed offsets,
heartbeats) the test writes as the runner would: no Spark needed.
"""

from __future__ import annotations

import asyncio
import time

from isbflow.isb import ledger, naming, provision
from isbflow.isb import state as st
from isbflow.isb.connect import session
from isbflow.quality.checks import judge_partition
from isbflow.spec import load_specs
from tests.conftest import ROOT

LOGS = ROOT / "pipelines" / "logs.yaml"


def test_judge_partition_requires_the_watermark_and_the_ledger_and_lists_what_is_in_flight():
    present = [[1, 49], [51, 60], [70, 85]]
    held, dead = [[1, 60], [70, 80]], [[61, 61]]
    v = judge_partition("in/0", present, held, dead, (1, 100), committed=65)
    assert (v.watermark, v.watermark_from) == (65, "committed by every step from the source to the sink")
    assert v.required == [[1, 60], [62, 65], [70, 80]]
    assert v.missing == [[50, 50], [62, 65]]  # 50: the ledger says committed; 62-65: under the watermark
    assert v.in_flight == [[66, 69], [86, 100]]
    assert v.proven == [[1, 49], [51, 61], [70, 80]] and v.dead_lettered == 1
    # not confirmed: the ledger's gap-free prefix (dead letters count as held) is the watermark
    v = judge_partition("in/0", present, held, dead, (1, 100), committed=None, why="step 'enrich' behind")
    assert v.watermark == 61 and "gap-free prefix (step 'enrich' behind)" in v.watermark_from
    assert v.missing == [[50, 50]] and v.in_flight == [[62, 69], [86, 100]]
    # a source stream whose first sequences are gone: counting starts at its first one
    v = judge_partition("in/0", [[40, 90]], [[40, 90]], [], (30, 95), committed=90)
    assert v.missing == [[30, 39]] and v.in_flight == [[91, 95]]
    # no source stream known: only what the ledger records is required
    v = judge_partition("files/0", [[1, 5]], [[1, 7]], [], None, committed=None)
    assert v.watermark is None and v.missing == [[6, 7]] and v.in_flight == []


def test_ranges_difference_and_first_of():
    assert ledger.difference([[1, 10], [20, 30]], [[2, 3], [5, 5], [9, 22], [25, 40]]) == [
        [1, 1], [4, 4], [6, 8], [23, 24]]
    assert ledger.difference([[1, 3]], []) == [[1, 3]] and ledger.difference([], [[1, 3]]) == []
    assert ledger.first_of([[1, 2], [5, 9]], 4) == [1, 2, 5, 6] and ledger.first_of([[1, 2]], 5) == [1, 2]


def test_committed_watermark_walks_the_steps_in_order_and_waits_for_a_running_one(nats_server):
    specs = load_specs(LOGS)
    p = specs.only_pipeline()
    settings = nats_server.settings
    asyncio.run(provision.apply(settings, specs))
    edges = {ep.stream: ep for ep in naming.edge_partitions(p)}
    source = naming.source_stream(p, "in")

    async def go():
        async with session(settings, name="test-watermark") as nc:
            js = nc.jetstream()
            for _ in range(5):
                await js.publish(p.vertex("in").source.jetstream.subject, b"{}")
            for ep in edges.values():  # two messages in every buffer: last_seq 2
                for _ in range(2):
                    await js.publish(ep.subject, b"x")

            async def step(vertex, committed, state=st.Observed.STOPPED):
                await st.put_status(nc, p.name, st.StepStatus(vertex, state=state))
                if committed is not None:
                    await st.put_committed(nc, p.name, vertex, committed)

            def inputs(vertex, seq):
                return {s: seq for s, ep in edges.items() if ep.to_vertex == vertex}

            await step("in", {source: 4})
            for v in ("parse", "enrich", "raw", "minutely", "agg"):
                await step(v, inputs(v, 2))
            seen = []
            marks = await ledger.committed_watermarks(nc, p, ["raw", "agg"], wait_s=5,
                                                      on_confirmed=lambda v: seen.append(v) or len(seen))
            # each step the two sinks depend on (not the errors sink) confirmed after every step before it
            assert seen == [v for v in p.topological_order() if v != "errors"]
            for sink in ("raw", "agg"):
                assert marks[sink].confirmed and marks[sink].committed == {"in/0": 4}
            assert marks["agg"].marks["minutely"] == seen.index("minutely") + 1

            # enrich stopped behind one of its buffers: nothing after it is confirmed, at once
            await step("enrich", {**inputs("enrich", 2), "isb-logs-parse-enrich-1": 1})
            t0 = time.monotonic()
            marks = await ledger.committed_watermarks(nc, p, ["raw", "agg"], wait_s=30)
            assert time.monotonic() - t0 < 5  # a step that does not run is not waited for
            for sink in ("raw", "agg"):
                assert not marks[sink].confirmed and marks[sink].behind.vertex == "enrich"
            assert marks["raw"].behind.streams == {"isb-logs-parse-enrich-1": (1, 2)}
            assert "not running" in marks["raw"].behind.reason

            # enrich running: the walk waits for it to commit what its buffers held
            await step("enrich", None, st.Observed.RUNNING)

            async def catch_up():
                await asyncio.sleep(1.5)
                await st.put_committed(nc, p.name, "enrich", inputs("enrich", 2))

            task = asyncio.create_task(catch_up())
            t0 = time.monotonic()
            marks = await ledger.committed_watermarks(nc, p, ["raw"], wait_s=20, poll_s=0.2)
            await task
            assert marks["raw"].confirmed and 1.4 < time.monotonic() - t0 < 15

            # running, but never catching up: the walk gives up after wait_s and says so
            await step("enrich", {"isb-logs-parse-enrich-0": 1}, st.Observed.RUNNING)
            marks = await ledger.committed_watermarks(nc, p, ["raw"], wait_s=1, poll_s=0.2)
            assert not marks["raw"].confirmed and "still behind its input buffers after 1s" in \
                marks["raw"].behind.reason

    asyncio.run(go())
