"""``isb-ref``: a reference table in a KV bucket, joined by a streaming query,
picks up a changed value on a later micro-batch (real nats-server and Spark)."""

from __future__ import annotations

import asyncio
import time

from pyspark.sql import functions as F

from isbflow.isb import reference
from isbflow.isb.connect import settings_to_json


def test_stream_static_join_sees_a_changed_value(spark, nats_server, tmp_path):
    settings = nats_server.settings
    asyncio.run(reference.put(settings, "logs", "services", {"checkout": {"team": "payments", "tier": "1"}}))
    ref = (spark.read.format("isb-ref").option("pipeline", "logs").option("name", "services")
           .option("key", "service").option("settings", settings_to_json(settings)).load())
    events = (spark.readStream.format("rate").option("rowsPerSecond", 20).load()
              .select(F.lit("checkout").alias("service"), "value"))
    joined = events.join(F.broadcast(ref), "service", "left")
    q = (joined.writeStream.format("memory").queryName("enriched")
         .option("checkpointLocation", str(tmp_path / "cp")).trigger(processingTime="1 second").start())
    try:
        def wait_batches(n: int, deadline: float) -> int:
            start = q.lastProgress["batchId"] if q.lastProgress else -1
            while time.monotonic() < deadline:
                p = q.lastProgress
                if p and p["batchId"] >= start + n and p["numInputRows"] > 0:
                    return p["batchId"]
                assert q.exception() is None, q.exception()
                time.sleep(0.5)
            raise AssertionError("the query made no progress")

        wait_batches(2, time.monotonic() + 120)
        asyncio.run(reference.put(settings, "logs", "services", {"checkout": {"team": "growth", "tier": "1"}}))
        wait_batches(3, time.monotonic() + 120)
    finally:
        q.stop()
    teams = {r.team for r in spark.sql("select distinct team from enriched").collect()}
    assert teams == {"payments", "growth"}
