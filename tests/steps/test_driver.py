"""A real driver's transforms cannot read the ISB service's passwords (isbflow.steps.driver.confine).

One available-now run of a two-step pipeline (a JetStream source, a transform that tries to
read ``<data dir>/nats/password``, a Delta sink) through :func:`isbflow.ops.pipeline.batch`,
the driver a batch run or a launch starts, on the data dir of a real embedded nats-server.
"""

from __future__ import annotations

import asyncio

from deltalake import DeltaTable

from isbflow.ops import pipeline as ops
from isbflow.ops.produce import produce
from isbflow.spec import load_specs
from tests.conftest import ROOT

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
        maxBytes: 16MiB
        duplicates: 2m
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: probe
spec:
  transformPackages: [tests.helpers]
  vertices:
    - name: in
      source:
        jetstream:
          subject: probe.events
        schema: "ts TIMESTAMP, service STRING, level STRING, host STRING, latency_ms DOUBLE, status INT, msg STRING"
    - name: probe
      udf:
        transform: tests.helpers.sandbox_transforms:probe
    - name: out
      sink:
        delta:
          path: sinks/probe/out
  edges:
    - from: in
      to: probe
    - from: probe
      to: out
"""


def test_a_transform_cannot_read_the_admin_password(nats_server, tmp_path):
    """The transform's own Python (in the driver) and its Python workers get PermissionError on the
    admin's password file; the run itself is unharmed (rows in the sink, checkpoints written)."""
    home = nats_server.data_dir
    assert (home / "nats" / "password").read_text()  # there, and readable outside the driver
    spec = tmp_path / "probe.yaml"
    spec.write_text(SPEC)
    specs = load_specs([spec])
    p = specs.only_pipeline()
    settings = nats_server.settings
    ops.prepare(settings, specs, p, None, data_dir=home)
    asyncio.run(produce(settings, p, count=20, seed=3))

    result, log = ops.batch(spec, p, settings, home, master="local[1]", workdir=ROOT, timeout=300)

    assert sum(result["steps"]["in"]["final_offsets"].values()) == 20, result
    rows = DeltaTable(str(home / "sinks" / "probe" / "out")).to_pyarrow_table(
        columns=["driver_read", "worker_read"]).to_pylist()
    assert len(rows) == 20
    assert {(r["driver_read"], r["worker_read"]) for r in rows} == {("denied", "denied")}
    assert any((home / "checkpoints" / "probe").iterdir())
