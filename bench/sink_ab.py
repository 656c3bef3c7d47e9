"""Interleaved A/B of the Delta sinks on one SparkSession (issue 14): the same in-memory source into
``noop``, the Spark-writer sink (``foreachBatch(DeltaBatchWriter)``) and the Python stream writer
(``isb-delta``), one after the other, twice, after a warm-up.

    python bench/sink_ab.py [ROWS]     # default 1,000,000 rows in 5 micro-batches; prints one line per run

Not a benchmark of record (bench/throughput.py is): a quick check that compares the sinks under the
same load. Writes under /tmp/isbflow-sink-ab (removed first).
"""
import json
import os
import shutil
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(BENCH.parent)])
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
import _common as cm  # noqa: E402

from isbflow.sinks.delta_files import DeltaSinkOptions  # noqa: E402
from isbflow.sinks.delta_spark import DeltaBatchWriter  # noqa: E402
from isbflow.steps.session import spark_session  # noqa: E402

spark = spark_session(conf={"spark.sql.streaming.numRecentProgressUpdates": "100"})
spark.sparkContext.setLogLevel("ERROR")
spark.dataSource.register(cm.BenchMemorySource)
rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
work = "/tmp/isbflow-sink-ab"
shutil.rmtree(work, ignore_errors=True)

def run(kind: str, i: int) -> None:
    df = (spark.readStream.format("isb-bench-memory").option("rows", str(rows))
          .option("batchRows", str(rows // 5)).option("partitions", "2").load())
    name = f"{kind}{i}"
    ck, path = f"{work}/ck/{name}", f"{work}/t/{name}"
    w = None
    if kind == "spark":
        w = DeltaBatchWriter(DeltaSinkOptions.from_options({"path": path, "appId": "ab/" + name}))
        q = df.writeStream.foreachBatch(w)
    elif kind == "python":
        q = df.writeStream.format("isb-delta").option("path", path).option("appId", "ab/" + name)
    else:
        q = df.writeStream.format("noop")
    t0 = time.time()
    q = q.option("checkpointLocation", ck).trigger(availableNow=True).start()
    q.awaitTermination()
    r = cm.progress_rates([json.loads(p.json) for p in q.recentProgress], rows, time.time() - t0)
    print(f"{kind:7s} whole {r['records_per_s']:>10} steady {r['steady_records_per_s']:>10} "
          f"load {os.getloadavg()[0]:.1f}"
          + (f" sink_s { {k: round(v, 2) for k, v in w.seconds.items()} }" if w else ""), flush=True)


run("spark", 0)  # warm-up
for i in range(1, 3):
    for kind in ("noop", "spark", "python"):
        run(kind, i)
