"""The SparkSession every step runs in (:mod:`isbflow.steps.session`)."""

from __future__ import annotations

import pytest

from isbflow.steps.session import (
    CHECKPOINT_FILE_MANAGER,
    CODEGEN_CACHE_CONF,
    CODEGEN_CACHE_ENTRIES,
    DRIVER_JAVA_OPTIONS,
    IDLE_WORKERS,
    IDLE_WORKERS_CONF,
    driver_conf,
    task_slots,
)

pytestmark = pytest.mark.slow


def test_checkpoints_are_written_through_the_file_system_api(spark, tmp_path):
    """The checkpoint file manager a streaming query (and its state store) gets for a checkpoint under
    the data dir is the FileSystem one: the FileContext one ran ``readlink`` as a process for each file
    it renamed (a dozen a second on the demo). Asked the way Spark asks it, from a query's Hadoop conf."""
    jvm = spark.sparkContext._jvm
    conf = spark._jsparkSession.sessionState().newHadoopConf()
    path = jvm.org.apache.hadoop.fs.Path(f"file://{tmp_path / 'checkpoint'}")
    manager = jvm.org.apache.spark.sql.execution.streaming.checkpointing.CheckpointFileManager.create(path, conf)
    assert manager.getClass().getName() == CHECKPOINT_FILE_MANAGER
    # and a query checkpoints through it: batches committed, each offset and commit file in place
    q = (spark.readStream.format("isb-memory").option("rows", "30").option("batchRows", "10").load()
         .writeStream.format("noop").option("checkpointLocation", str(tmp_path / "checkpoint"))
         .trigger(availableNow=True).start())
    assert q.awaitTermination(120) and q.exception() is None
    commits = sorted(int(f.name) for f in (tmp_path / "checkpoint" / "commits").iterdir() if f.name.isdigit())
    offsets = sorted(int(f.name) for f in (tmp_path / "checkpoint" / "offsets").iterdir() if f.name.isdigit())
    assert commits == offsets and len(commits) >= 1, (commits, offsets)


def test_a_pipeline_driver_gets_the_lean_jvm_options_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("ISBFLOW_DRIVER_JAVA_OPTIONS", raising=False)
    assert driver_conf() == {"spark.driver.extraJavaOptions": DRIVER_JAVA_OPTIONS}
    assert "-XX:+UseSerialGC" in DRIVER_JAVA_OPTIONS.split()
    monkeypatch.setenv("ISBFLOW_DRIVER_JAVA_OPTIONS", "-XX:+UseG1GC")
    assert driver_conf() == {"spark.driver.extraJavaOptions": "-XX:+UseG1GC"}
    monkeypatch.setenv("ISBFLOW_DRIVER_JAVA_OPTIONS", " ")
    assert driver_conf() == {}


def test_spark_keeps_one_idle_python_worker_per_kind_on_a_local_master(spark):
    """The session bounds Spark's idle Python workers per kind to one on a local master, under a key
    Spark itself defines (a misspelt key would be ignored without a word)."""
    jvm = spark.sparkContext._jvm
    assert jvm.org.apache.spark.internal.config.Python.PYTHON_FACTORY_IDLE_WORKER_MAX_POOL_SIZE().key() == \
        IDLE_WORKERS_CONF
    assert spark.sparkContext.getConf().get(IDLE_WORKERS_CONF) == str(IDLE_WORKERS) == "1"
    assert [task_slots(m) for m in ("local", "local[2]", "local[3,2]", "spark://h:7077")] == [1, 2, 3, None]
    assert task_slots("local[*]") >= 1


def test_spark_keeps_more_generated_classes_than_its_default(spark):
    """The session's cache of compiled generated code holds 500 classes, under the key Spark defines for
    it (a static conf: a misspelt key, or one set after the JVM started, would leave Spark's 100)."""
    jvm = spark.sparkContext._jvm
    entry = jvm.org.apache.spark.sql.internal.StaticSQLConf.CODEGEN_CACHE_MAX_ENTRIES()
    assert entry.key() == CODEGEN_CACHE_CONF
    assert str(entry.defaultValueString()) == "100"
    assert spark.conf.get(CODEGEN_CACHE_CONF) == str(CODEGEN_CACHE_ENTRIES) == "500"


def test_the_jvm_and_a_launched_driver_run_with_bounded_malloc_arenas(spark, monkeypatch, tmp_path):
    """Spark's JVM (and the zygote) start with ``MALLOC_ARENA_MAX`` (a user's value kept); this
    process's environment is put back; a launched driver's environment carries it for its tree."""
    import os

    from pyspark import SparkContext

    from isbflow.isb.connect import NatsSettings
    from isbflow.steps.driver import MALLOC_ARENAS, driver_env

    jvm_pid = SparkContext._gateway.proc.pid
    env = dict(v.split("=", 1) for v in open(f"/proc/{jvm_pid}/environ").read().split("\0") if "=" in v)
    assert env.get("MALLOC_ARENA_MAX") == os.environ.get("MALLOC_ARENA_MAX", MALLOC_ARENAS), env.get("MALLOC_ARENA_MAX")
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    settings = NatsSettings(servers=("nats://127.0.0.1:4222",))
    assert driver_env(settings, tmp_path)["MALLOC_ARENA_MAX"] == MALLOC_ARENAS
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert driver_env(settings, tmp_path)["MALLOC_ARENA_MAX"] == "4"
