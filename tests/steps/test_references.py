"""A step's reference tables: cached in the driver, so a micro-batch builds its broadcast without a
Python planning call or read task, and read again once the runner's beat sees the KV bucket move
(real nats-server and Spark)."""

from __future__ import annotations

import asyncio
import json
import time

from pyspark.sql import functions as F

from isbflow.isb import reference
from isbflow.steps.runner import PipelineRunner
from tests.conftest import ROOT


def _teams(df) -> dict[str, str]:
    return {r.service: r.team for r in df.select("service", "team").collect()}


def test_a_reference_is_cached_and_read_again_when_its_bucket_moves(spark, demo):
    specs, p, settings, tmp_path = demo
    rows = json.loads((ROOT / "pipelines" / "reference" / "services.json").read_text())  # what the fixture put
    runner = PipelineRunner(spark, specs, p, settings, tmp_path)
    try:
        services = runner._references(p.vertex("enrich"))["services"]
        cached, revision = runner._refs[("services", "service")]
        assert cached.storageLevel.useMemory
        assert revision == asyncio.run(reference.revision(settings, p.name, "services"))
        assert _teams(services)["checkout"] == "commerce"
        # a stream-static join plans its static side from the cache, every batch
        events = (spark.readStream.format("rate").option("rowsPerSecond", 20).load()
                  .select(F.lit("checkout").alias("service"), "value"))
        q = (events.join(services, "service", "left").writeStream.format("memory").queryName("enriched_cached")
             .option("checkpointLocation", str(tmp_path / "cp")).trigger(processingTime="1 second").start())
        try:
            def wait_batches(n: int) -> None:
                start, deadline = (q.lastProgress or {}).get("batchId", -1), time.monotonic() + 120
                while time.monotonic() < deadline:
                    if (q.lastProgress or {}).get("batchId", -1) >= start + n and q.lastProgress["numInputRows"]:
                        return
                    assert q.exception() is None, q.exception()
                    time.sleep(0.3)
                raise AssertionError("the query made no progress")

            wait_batches(2)
            assert "InMemoryTableScan" in q._jsq.explainInternal(False)  # the last batch's plan

            rows["checkout"] = {"team": "growth", "tier": 1}
            asyncio.run(reference.put(settings, p.name, "services", rows))
            wait_batches(2)
            assert _teams(services)["checkout"] == "commerce"  # cached: the put is not read yet
            runner._refresh_references("enrich")  # the beat: the bucket moved
            assert runner._refs[("services", "service")][1] == asyncio.run(reference.revision(settings, p.name, "services"))
            assert _teams(services)["checkout"] == "growth"
            wait_batches(2)
        finally:
            q.stop()
        # the stream saw the old value, then the new one from a batch after the beat
        assert {r.team for r in spark.sql("select distinct team from enriched_cached").collect()} == \
            {"commerce", "growth"}
        before = runner._refs[("services", "service")]
        runner._refresh_references("enrich")  # nothing moved: the cache stays
        assert runner._refs[("services", "service")] == before
    finally:
        runner.close()
    assert not cached.storageLevel.useMemory  # the runner's cache ends with it
