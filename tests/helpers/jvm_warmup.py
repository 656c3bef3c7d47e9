"""The workload whose JVM writes the suite's class-data-sharing archive (:mod:`tests.helpers.jvm_cds`).

Run as a script by ``jvm_cds.build_archive`` with ``-XX:ArchiveClassesAtExit`` in
``SPARK_SUBMIT_OPTS``: every class the JVM loads here (SQL planning and codegen, Arrow
exchange with Python, Python data sources and stream writers, ``foreachBatch``, the
state store of a windowed aggregation, Parquet and JSON) lands in the archive, so the
suite's later JVMs map them instead of loading and verifying them again. A class not
covered here is loaded as usual: the archive only ever saves work.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pyarrow as pa
from pyspark.sql import functions as F
from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

from isbflow.steps.session import spark_session
from tests.helpers.memory_source import MemoryDataSource


class _Count(WriterCommitMessage):
    def __init__(self, rows: int):
        self.rows = rows


class _CountingWriter(DataSourceStreamArrowWriter):
    def write(self, iterator):
        return _Count(sum(b.num_rows for b in iterator))

    def commit(self, messages, batchId):
        pass

    def abort(self, messages, batchId):
        pass


class _CountingSink(DataSource):
    @classmethod
    def name(cls):
        return "isb-warmup-count"

    def streamWriter(self, schema, overwrite):
        return _CountingWriter()


def main(workdir: Path) -> None:
    spark = spark_session("local[2]", app_name="isbflow-jvm-warmup", conf={"spark.ui.enabled": "false"})
    spark.dataSource.register(MemoryDataSource)
    spark.dataSource.register(_CountingSink)
    spark.sparkContext.setLogLevel("ERROR")

    df = spark.range(2000).selectExpr("id", "id % 7 AS k", "CAST(id AS STRING) AS s",
                                      "timestamp_seconds(id) AS ts")
    df.groupBy("k").agg(F.count("*"), F.max("ts"), F.collect_list("s")).collect()
    df.join(df.select("k").distinct(), "k").count()
    df.select(F.udf(lambda x: x + 1, "long")("id")).collect()
    df.select(F.to_json(F.struct("id", "s")).alias("j")).select(
        F.from_json("j", "id long, s string").alias("r")).select("r.*").count()
    spark.createDataFrame(df.toArrow()).count()
    spark.createDataFrame(pa.table({"a": [1, 2], "b": ["x", None]})).collect()
    (df.repartition(2, "k").write.mode("overwrite").partitionBy("k")
       .option("compression", "snappy").parquet(str(workdir / "pq")))
    spark.read.parquet(str(workdir / "pq")).where("k = 3").count()
    df.write.mode("overwrite").json(str(workdir / "json"))
    spark.read.schema("id long, s string").json(str(workdir / "json")).count()

    src = (spark.readStream.format("isb-memory").option("rows", "3000").option("batchRows", "1000").load())
    windows = (src.withWatermark("ts", "1 minute")
               .groupBy(F.window("ts", "10 seconds"), "service").agg(F.count("*").alias("n")))
    seen: list[int] = []
    q = (windows.writeStream.outputMode("update").trigger(availableNow=True)
         .option("checkpointLocation", str(workdir / "ck-agg"))
         .foreachBatch(lambda b, i: seen.append(b.count())).start())
    q.awaitTermination()
    q = (src.writeStream.format("isb-warmup-count").trigger(availableNow=True)
         .option("checkpointLocation", str(workdir / "ck-py")).start())
    q.awaitTermination()
    q = (src.select(F.xxhash64("service").alias("h"), "id").writeStream.format("noop")
         .trigger(availableNow=True).option("checkpointLocation", str(workdir / "ck-noop")).start())
    q.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory(prefix="isbflow-jvm-warmup-") as d:
        main(Path(d))
    sys.exit(0)
