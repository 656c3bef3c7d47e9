"""The SparkSession every step runs in (:mod:`isbflow.steps.session`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from isbflow.steps.session import (
    BROADCAST_BLOCK,
    BROADCAST_BLOCK_CONF,
    BROADCAST_THREADS,
    BROADCAST_THREADS_CONF,
    CHECKPOINT_FILE_MANAGER,
    CODEGEN_CACHE_CONF,
    CODEGEN_CACHE_ENTRIES,
    DRIVER_JAVA_OPTIONS,
    IDLE_WORKERS,
    IDLE_WORKERS_CONF,
    PAGE_SIZE,
    PAGE_SIZE_CONF,
    QueryStarter,
    driver_conf,
    task_slots,
)
from tests.conftest import ROOT

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


def test_a_step_query_runs_without_adaptive_execution(spark, tmp_path):
    """A stream-static broadcast join (the demo's ``enrich``) started the way the runner starts a
    step (``QueryStarter``) plans its micro-batches once, without adaptive execution and without
    whole-stage code generation; the same query started from the session runs them adaptively and
    generated (so this test can fail); the session keeps both for its batch work."""
    from pyspark.sql import functions as F  # lazy: this module's other tests start no Spark

    services = F.broadcast(spark.createDataFrame([("api", "core"), ("web", "edge")], "service string, team string"))

    def last_plan(start, name: str) -> str:
        events = spark.readStream.format("isb-memory").option("rows", "30").option("batchRows", "10").load()
        w = (events.join(services, "service", "left").writeStream.format("noop")
             .option("checkpointLocation", str(tmp_path / name)).trigger(availableNow=True))
        q = start(w)
        assert q.awaitTermination(120) and q.exception() is None
        return q._jsq.explainInternal(False)  # what StreamingQuery.explain() prints: the last batch's plan

    session = last_plan(lambda w: w.start(), "session")
    assert "AdaptiveSparkPlan" in session and "*(" in session, session  # "*(1) Project": generated code
    step = last_plan(lambda w: QueryStarter(spark, w, 2).start(), "step")
    assert "BroadcastHashJoin" in step and "AdaptiveSparkPlan" not in step and "*(" not in step, step
    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"
    assert spark.conf.get("spark.sql.codegen.wholeStage") == "true"


def test_a_pipeline_driver_gets_the_lean_jvm_options_unless_told_otherwise(monkeypatch):
    monkeypatch.delenv("ISBFLOW_DRIVER_JAVA_OPTIONS", raising=False)
    assert driver_conf() == {"spark.driver.extraJavaOptions": DRIVER_JAVA_OPTIONS}
    assert "-XX:+UseSerialGC" in DRIVER_JAVA_OPTIONS.split()
    monkeypatch.setenv("ISBFLOW_DRIVER_JAVA_OPTIONS", "-XX:+UseG1GC")
    assert driver_conf() == {"spark.driver.extraJavaOptions": "-XX:+UseG1GC"}
    assert driver_conf(0.2) == {"spark.driver.extraJavaOptions": "-XX:+UseG1GC"}  # the user's, whatever the budget
    monkeypatch.setenv("ISBFLOW_DRIVER_JAVA_OPTIONS", " ")
    assert driver_conf() == {}


def test_a_driver_with_a_sub_second_latency_budget_keeps_heap_headroom(monkeypatch):
    """A budget under LOW_LATENCY_S: a quarter of the heap kept free after a collection, where the lean
    options keep a tenth (the full collections of a 90%-full old generation paused 200 ms batches)."""
    from isbflow.steps.session import LOW_LATENCY_JAVA_OPTIONS, LOW_LATENCY_S

    monkeypatch.delenv("ISBFLOW_DRIVER_JAVA_OPTIONS", raising=False)
    lean, low = ({"spark.driver.extraJavaOptions": o} for o in (DRIVER_JAVA_OPTIONS, LOW_LATENCY_JAVA_OPTIONS))
    assert driver_conf(0.2) == low and driver_conf(LOW_LATENCY_S - 0.001) == low
    assert driver_conf(LOW_LATENCY_S) == lean and driver_conf(5.0) == lean and driver_conf(None) == lean
    assert "-XX:MinHeapFreeRatio=25" in LOW_LATENCY_JAVA_OPTIONS.split()
    assert "-XX:MinHeapFreeRatio=10" in DRIVER_JAVA_OPTIONS.split()


def test_a_pipelines_latency_budget_is_its_sources_shortest_trigger():
    from isbflow.spec import load_specs
    from isbflow.steps.driver import LaunchError, interval_s
    from isbflow.steps.runner import latency_budget_s

    assert [interval_s(v) for v in ("200 milliseconds", "250ms", "5 seconds", "5s", "1.5 s", "1 minute")] == [
        0.2, 0.25, 5.0, 5.0, 1.5, 60.0]
    with pytest.raises(LaunchError, match="not an interval"):
        interval_s("soon")
    p = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline()
    assert latency_budget_s(p) == 5.0  # the demo's source readTimeout (its buffer steps are event-driven)
    assert latency_budget_s(p, "200 milliseconds") == 0.2  # a runner's processing time for every step


def test_a_busy_run_beats_at_its_latency_budget_between_2_and_5_seconds():
    from isbflow.spec import load_specs
    from isbflow.steps.runner import heartbeat_interval_s

    p = load_specs([ROOT / "pipelines" / "logs.yaml"]).only_pipeline()
    assert heartbeat_interval_s(p) == 5.0  # the demo: data moves every 5 s
    assert heartbeat_interval_s(p, "200 milliseconds") == 2.0
    assert heartbeat_interval_s(p, "3 seconds") == 3.0
    assert heartbeat_interval_s(p, "1 minute") == 5.0  # well inside the UI's 30 s staleness


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


def test_spark_builds_a_few_broadcast_tables_at_once(spark):
    """The session's pool of broadcast threads holds 8, under the key Spark defines for it (a static
    conf: a misspelt key, or one set after the JVM started, would leave Spark's 128)."""
    jvm = spark.sparkContext._jvm
    entry = jvm.org.apache.spark.sql.internal.StaticSQLConf.BROADCAST_EXCHANGE_MAX_THREAD_THRESHOLD()
    assert entry.key() == BROADCAST_THREADS_CONF
    assert str(entry.defaultValueString()) == "128"
    assert spark.conf.get(BROADCAST_THREADS_CONF) == str(BROADCAST_THREADS) == "8"


def test_spark_serializes_broadcasts_and_takes_pages_in_small_pieces(spark):
    """A broadcast's buffer grows 256 KiB at a time and a hash map's or sorter's page is 1 MiB, under the
    keys Spark defines (a misspelt key would leave its 4 MiB pieces and pages derived from the heap);
    a broadcast larger than a piece still arrives whole."""
    jvm = spark.sparkContext._jvm
    config = getattr(getattr(jvm.org.apache.spark.internal.config, "package$"), "MODULE$")  # Scala's object
    assert config.BROADCAST_BLOCKSIZE().key() == BROADCAST_BLOCK_CONF
    assert str(config.BROADCAST_BLOCKSIZE().defaultValueString()) == "4m"
    assert config.BUFFER_PAGESIZE().key() == PAGE_SIZE_CONF
    conf = spark.sparkContext.getConf()
    assert conf.get(BROADCAST_BLOCK_CONF) == BROADCAST_BLOCK == "256k"
    assert conf.get(PAGE_SIZE_CONF) == PAGE_SIZE == "1m"
    big = list(range(200_000))  # ~1 MB pickled: four pieces at least
    b = spark.sparkContext.broadcast(big)
    try:
        assert spark.sparkContext.parallelize([0, 1], 2).map(lambda i: len(b.value) + i).collect() == [200_000, 200_001]
    finally:
        b.destroy()


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


@pytest.mark.parametrize(("processing_time", "available_now", "options"), [
    (None, False, "lean"), ("200 milliseconds", False, "low"), ("200 milliseconds", True, "lean")])
def test_a_pipeline_run_starts_its_jvm_with_the_options_of_its_latency_budget(monkeypatch, processing_time,
                                                                              available_now, options):
    """isbflow.ops.pipeline.run_here: the demo's 5 s budget gets the lean options, a 200 ms trigger the
    headroom, an available-now run (no latency to keep) the lean ones."""
    from isbflow.ops.pipeline import run_here
    from isbflow.spec import load_specs
    from isbflow.steps import runner
    from isbflow.steps.session import LOW_LATENCY_JAVA_OPTIONS

    monkeypatch.delenv("ISBFLOW_DRIVER_JAVA_OPTIONS", raising=False)
    monkeypatch.delenv("ISBFLOW_DRIVER_LOG", raising=False)
    started = []

    class Stop(Exception):
        pass

    def spark_session(master, app_name, conf):
        started.append(conf)
        raise Stop

    monkeypatch.setattr(runner, "spark_session", spark_session)
    specs = load_specs([ROOT / "pipelines" / "logs.yaml"])
    with pytest.raises(Stop):
        run_here(specs, specs.only_pipeline(), None, Path("/nonexistent"), available_now=available_now,
                 processing_time=processing_time)
    want = LOW_LATENCY_JAVA_OPTIONS if options == "low" else DRIVER_JAVA_OPTIONS
    assert started == [{"spark.driver.extraJavaOptions": want}]
