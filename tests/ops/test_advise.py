"""The tuning report (isbflow.ops.advise, ``isbflow pipeline advise``) on a real nats-server: buffers
provisioned and filled as writers fill them, heartbeats and rate histories written as the runner
writes them (no Spark). A skewed partition shows as hot with its dominant key; a balanced edge
shows none."""

from __future__ import annotations

import asyncio
import json
import time

import pyarrow as pa
import pytest
from typer.testing import CliRunner

from isbflow.isb import frames, naming, provision
from isbflow.isb import state as st
from isbflow.isb.connect import connect
from isbflow.ops.advise import advise, desired_replicas, hot, mean_rate  # the autoscaler's formula
from isbflow.spec import load_specs
from isbflow.spec.scale import Scale

SPEC = """\
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata:
  name: default
spec:
  jetstream:
    url: embedded
    bufferConfig:
      stream:
        maxBytes: 64MiB
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: adv
spec:
  limits:
    readBatchSize: 1000
    readTimeout: 2s
  vertices:
    - name: in
      source:
        jetstream:
          subject: adv.events
      scale:
        max: 4
    - name: skewed
      partitions: 2
      sink:
        delta:
          path: adv/skewed
    - name: even
      partitions: 3
      sink:
        delta:
          path: adv/even
  edges:
    - from: in
      to: skewed
      partitionKey: service
    - from: in
      to: even
      partitionKey: service
"""


def test_hot_is_more_than_twice_the_siblings_median_and_past_the_floor():
    assert [h for h, _ in hot([40, 5])] == [True, False]
    assert [h for h, _ in hot([12, 12, 13])] == [False, False, False]
    assert [h for h, _ in hot([9, 0, 0])] == [False, False, False]  # 9 frames above: under the floor
    assert [h for h, _ in hot([30, 10, 12])] == [True, False, False]  # 30 > 2 x 11 and 19 above it
    assert hot([7]) == [(False, 0.0)]


def test_desired_replicas_follow_numaflows_formula():
    s = Scale()
    assert desired_replicas(True, s, 10.0, [600], 1, 1) == 3  # 600 / 10 / 20 s
    assert desired_replicas(True, s, 0.0, [0], 1, 1) == 0  # nothing pending, no rate: min
    assert desired_replicas(True, Scale(min=1, max=2), 1.0, [10_000], 1, 1) == 2  # bounded by max
    # one replica now, a buffer of 100 frames, 80 before onFull, 50% to keep free: 50 / (80 - pending)
    assert desired_replicas(False, s, 5.0, [0, 55], 1, 80, 50) == 2
    assert desired_replicas(False, s, 5.0, [80], 1, 80, 50) == 3  # full: 1 + replicasPerScaleUp
    assert desired_replicas(False, s, 5.0, [1], 1, 80, 50) == 1  # never more than what is pending


def test_mean_rate_averages_the_lookback_minutes_that_saw_rows():
    now = 10_000.0
    history = [{"t": now - 600, "out": 999.0}, {"t": now - 120, "out": 100.0}, {"t": now - 60, "out": 0.0},
               {"t": now - 30, "out": 300.0}]
    assert mean_rate(None, history, 120, now) == 200.0
    assert mean_rate(st.StepStatus("x", processed_rows_per_s=7.0), [], 120, now) == 7.0


def _frame(keys: list[str]) -> tuple[bytes, dict]:
    table = pa.table({"service": keys, "n": list(range(len(keys)))})
    return frames.encode(table), {frames.HDR_FRAME: frames.FRAME_FORMAT, frames.HDR_ROWS: str(len(keys))}


async def _fill(settings, p) -> None:
    """Frames on both edges as the writer routes them (skewed: partition 0 takes the hot key), events
    on the source, and heartbeats and rates as the runner writes them."""
    nc = await connect(settings)
    try:
        js = nc.jetstream()
        parts = {(ep.to_vertex, ep.partition): ep for ep in naming.edge_partitions(p)}
        for _ in range(40):
            data, headers = _frame(["checkout"] * 90 + ["search"] * 10)
            await js.publish(parts[("skewed", 0)].subject, data, headers=headers)
        for _ in range(5):
            data, headers = _frame(["login"] * 20)
            await js.publish(parts[("skewed", 1)].subject, data, headers=headers)
        for part in range(3):
            for _ in range(12):
                data, headers = _frame([f"svc-{part}"] * 50)
                await js.publish(parts[("even", part)].subject, data, headers=headers)
        for i in range(600):
            await js.publish("adv.events", json.dumps({"service": "a", "i": i}).encode())
        now = time.time()
        beats = {"in": st.StepStatus("in", state=st.Observed.RUNNING, batch_id=3, input_rows_per_s=10.0,
                                     processed_rows_per_s=10.0, batch_seconds=0.05, rows_total=30),
                 "skewed": st.StepStatus("skewed", state=st.Observed.RUNNING, batch_id=3, processed_rows_per_s=2000.0,
                                         input_rows_per_s=900.0, batch_seconds=3.0, rows_total=6000),
                 "even": st.StepStatus("even", state=st.Observed.RUNNING, batch_id=3, processed_rows_per_s=500.0,
                                       input_rows_per_s=500.0, batch_seconds=0.4, rows_total=1800)}
        for s in beats.values():
            await st.put_status(nc, p.name, s)
            await st.record_rates(nc, p.name, s, now=now)
    finally:
        await nc.close()


@pytest.fixture
def filled(nats_server, tmp_path):
    spec_file = tmp_path / "adv.yaml"
    spec_file.write_text(SPEC)
    specs = load_specs(spec_file)
    p = specs.pipelines["adv"]
    asyncio.run(provision.apply(nats_server.settings, specs))
    asyncio.run(_fill(nats_server.settings, p))
    return spec_file, p


def test_a_skewed_partition_is_hot_with_its_key_and_a_balanced_edge_is_not(nats_server, filled):
    spec_file, p = filled

    async def go():
        nc = await connect(nats_server.settings)
        try:
            return await advise(nc, p, sample=True)
        finally:
            await nc.close()

    report = asyncio.run(go())
    edges = {e.to_vertex: e for e in report.edges}
    skewed, even = edges["skewed"], edges["even"]
    assert skewed.hot == [0], skewed
    assert [q.lag for q in skewed.partitions] == [40, 5] and "lag 40" in skewed.partitions[0].why
    assert skewed.partitions[0].keys[0] == {"key": "checkout", "share": 0.9}
    assert even.hot == [] and all(not q.hot and q.keys is None for q in even.partitions)
    vs = {v.vertex: v for v in report.vertices}
    src = vs["in"]
    assert (src.pending, src.pending_unit, src.rate, src.desired_replicas) == (600, "events", 10.0, 3)
    assert src.scale["max"] == 4 and src.scale_configured and src.utilization == 0.025
    # the sink's last batch (3 s) overran its 2 s budget, and its batches read ~6,000 rows of 1,000
    assert vs["skewed"].utilization == 1.5
    assert any("over the 2s latency budget" in a for a in vs["skewed"].advice), vs["skewed"].advice
    assert any("raise limits.readBatchSize to 4,000" in a for a in vs["skewed"].advice), vs["skewed"].advice
    assert any("readTimeout could be 0.5s" in a for a in src.advice), src.advice


def test_advise_json_on_the_command_line(nats_server, filled):
    from isbflow.cli import app

    spec_file, _ = filled
    args = ["pipeline", "advise", "-f", str(spec_file), "--data-dir", str(nats_server.data_dir)]
    out = CliRunner().invoke(app, [*args, "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    edges = {e["to_vertex"]: e for e in doc["edges"]}
    assert edges["skewed"]["hot"] == [0] and edges["even"]["hot"] == []
    assert edges["skewed"]["partitions"][0]["keys"] is None  # not asked: says how
    assert "--keys" in edges["skewed"]["keys_note"]
    assert doc["thresholds"]["hot_factor"] == 2.0
    text = CliRunner().invoke(app, [*args, "--keys"])
    assert text.exit_code == 0, text.output
    assert "partition 0 is hot" in text.stdout and "'checkout' 90%" in text.stdout
