"""A quality run on a live pipeline: records in flight are listed, never a failure.

The demo's first steps (source -> parse with two partitions keyed by service ->
raw sink) run continuously in this process; a burst of events is published and
``check_sinks`` (what ``isbflow quality run`` and the ``pipeline_quality`` DAG
call) judges the raw sink while the burst flows through both partitions. The
committed low watermark is proven by the running steps' commits, everything up
to it is in the sink, and the rest is reported in flight.
"""

from __future__ import annotations

import threading

import pytest

from isbflow.ops.quality import check_sinks
from tests.helpers import recovery as h

SPEC = """\
apiVersion: isbflow.io/v1alpha1
kind: InterStepBufferService
metadata:
  name: default
spec:
  jetstream:
    url: embedded
    settings:
      max_payload: 8MiB
    bufferConfig:
      stream:
        retention: Limits
        maxBytes: 64MiB
        storage: file
        duplicates: 2m
---
apiVersion: isbflow.io/v1alpha1
kind: Pipeline
metadata:
  name: logs
spec:
  interStepBufferServiceName: default
  limits:
    readBatchSize: 2000
  vertices:
    - name: in
      source:
        jetstream:
          subject: logs.events
        schema: "ts TIMESTAMP, service STRING, level STRING, host STRING, latency_ms DOUBLE, status INT, msg STRING"
    - name: parse
      partitions: 2
      udf:
        transform: spark_apps.logs:parse
    - name: raw
      sink:
        delta:
          path: sinks/logs/raw
  edges:
    - from: in
      to: parse
      partitionKey: service
    - from: parse
      to: raw
"""


class _StoppableRun(h.ContinuousRun):
    """The steps started one after the other (as ContinuousRun does), stopped at once on the way out
    rather than waiting for a drain: this test checks while records flow, then is done."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stop = threading.Event()

    def _run(self, runner, only) -> None:
        try:
            self.result.setdefault("out", {}).update(
                runner.run_continuous(only=only, poll=0.3, should_stop=self.stop.is_set))
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            self.result.setdefault("error", e)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        super().__exit__(*exc)


@pytest.mark.timeout(900)
def test_a_live_run_with_two_partitions_passes_with_records_in_flight_listed(spark, nats_server, tmp_path):
    spec = tmp_path / "live.yaml"
    spec.write_text(SPEC)
    settings = nats_server.settings
    specs, p = h.setup(settings, spec)
    data_dir = tmp_path / "data"
    h.publish(settings, p, 2000, malformed_every=500)
    with _StoppableRun(spark, specs, p, settings, data_dir) as run:
        h.wait_for(lambda: "error" in run.result or h.committed(settings, p, "raw", "isb-logs-parse-raw-0") > 0,
                   300, "the raw sink's first commit")
        h.publish(settings, p, 8000, start=2000, malformed_every=500)  # flows while the check runs
        out = check_sinks(spark, specs, p, settings, data_dir, ["raw"], wait_s=60)
    assert "error" not in run.result, run.result.get("error")
    report = out.reports[0]
    assert out.basis == "ledger" and not out.notes
    assert report.success, [c.to_dict() for c in report.failures]
    c = next(c for c in report.checks if c.name == "completeness").details
    assert c["basis"] == "ledger" and c["watermark"]["confirmed"], c["watermark"]
    part = c["partitions"]["in/0"]
    committed = c["watermark"]["committed"]["in/0"]
    assert part["watermark"] >= committed >= 2000 and part["missing"] == 0
    # everything up to the watermark, and beyond it what the sink committed of the faster partition
    assert part["proven"][0] == [1, part["watermark"]] and part["missing_first"] == []
    # the burst was still on its way: listed with the oldest record and its age, not a failure
    flying = part["in_flight"]
    assert flying["count"] > 0 and flying["oldest"] > part["watermark"], flying
    assert 0 <= flying["oldest_age_s"] < 600
