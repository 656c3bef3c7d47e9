"""The Spark side of a step: a SparkSession on loopback with isbflow's data sources, the
user's transforms, and the pipeline's checkpoint epoch."""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from pyspark import SparkContext
from pyspark.sql import SparkSession

from isbflow.connector.files import FilesDataSource
from isbflow.connector.reference import ReferenceDataSource
from isbflow.connector.source import JetStreamDataSource
from isbflow.sinks.delta import DeltaSinkDataSource
from isbflow.spec import transforms
from isbflow.spec.paths import DataDir
from isbflow.steps import hadoop_fs, zygote
from isbflow.steps.driver import MALLOC_ARENAS
from isbflow.steps.restart import StepError
from isbflow.steps.write_through import WriteThroughDataSource


def epoch_file(data_dir: Path, pipeline: str) -> Path:
    return DataDir(data_dir).epoch_file(pipeline)


def checkpoint_epoch(data_dir: Path, pipeline: str) -> int:
    """The pipeline's checkpoint epoch: 0 until recovery first moves its checkpoints aside."""
    f = epoch_file(data_dir, pipeline)
    return int(f.read_text().strip() or 0) if f.exists() else 0


#: Spark's checkpoint file manager on the FileSystem API. The default (FileContext) renames through
#: ``FileContext.rename``, which without Hadoop's native library runs ``readlink`` as a process for
#: every file it renames: measured on the demo (5 s trigger, 200 events/s), the driver JVM started
#: ~13 ``readlink`` processes a second and reaped 6.0 CPU-s of children a minute. A local file
#: system's rename is atomic (POSIX ``rename``), which is what the FileContext API is chosen for;
#: isbflow's checkpoints always live under the data dir, a local path.
CHECKPOINT_FILE_MANAGER = "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"


#: the JVM options of a pipeline's driver (:func:`driver_conf`): the serial collector, a small initial
#: heap, and a heap given back after a collection leaves it more than 30% free. Measured on the demo
#: (in-process runner, 100 events/s, 5 s trigger, PSS over 110 s): with the JVM's defaults (G1,
#: initial heap 1/64 of RAM: 384 MiB here, never given back) the JVM held 982 MiB for ~180 MiB of
#: live objects; with these 653 MiB, at the same CPU (29.5% of a core against 29.0%). A cap on the
#: heap (``spark.driver.memory 512m``) saved only 38 MiB more and could fail a large batch, so the
#: heap may still grow to Spark's 1 GiB. ``ISBFLOW_DRIVER_JAVA_OPTIONS`` replaces them ('' for none).
DRIVER_JAVA_OPTIONS = "-XX:+UseSerialGC -Xms64m -XX:MinHeapFreeRatio=10 -XX:MaxHeapFreeRatio=30"

#: the JVM options of a driver whose pipeline has a latency budget under :data:`LOW_LATENCY_S`: the
#: same collector with a quarter of the heap kept free after a collection, not a tenth. With a tenth,
#: the old generation sits ~90% full of what lives on (~80 MB in a busy driver), so every few seconds
#: of promotion end in a full collection, a pause of 130-190 ms for every query: a third of a
#: 200 ms micro-batch's time (Spark's task metrics at 20K events/s: JVM GC time 63 ms of 182 ms
#: per task on average). Measured (``bench/throughput.py`` F, 20K events/s, 200 ms trigger, 60 s; the
#: demo ``bench/cost.py --no-floors --rates 100``, 5 s budget): F's p50 0.39-0.41 s -> 0.31 s, its
#: write job 216-228 -> 174 ms a batch; the demo 219 -> 198 CPU ms a micro-batch, but 1,167 -> 1,267
#: MiB PSS (-XX:MinHeapFreeRatio=40 -XX:MaxHeapFreeRatio=70: 1,401 MiB). Hence by budget: memory
#: where batches can wait, headroom where they cannot.
LOW_LATENCY_JAVA_OPTIONS = "-XX:+UseSerialGC -Xms64m -XX:MinHeapFreeRatio=25 -XX:MaxHeapFreeRatio=40"
#: a latency budget (seconds) under which a driver gets :data:`LOW_LATENCY_JAVA_OPTIONS`
LOW_LATENCY_S = 1.0


def driver_conf(latency_budget_s: float | None = None) -> dict[str, str]:
    """The Spark conf of a pipeline's driver (a foreground or launched ``isbflow pipeline run``):
    :data:`LOW_LATENCY_JAVA_OPTIONS` for its JVM when its pipeline's latency budget
    (:func:`isbflow.steps.runner.latency_budget_s`) is under :data:`LOW_LATENCY_S`, else
    :data:`DRIVER_JAVA_OPTIONS`, unless ``ISBFLOW_DRIVER_JAVA_OPTIONS`` says otherwise.
    Only a session that starts its JVM applies them."""
    low = latency_budget_s is not None and latency_budget_s < LOW_LATENCY_S
    options = os.environ.get("ISBFLOW_DRIVER_JAVA_OPTIONS",
                             LOW_LATENCY_JAVA_OPTIONS if low else DRIVER_JAVA_OPTIONS).strip()
    return {"spark.driver.extraJavaOptions": options} if options else {}


#: How many idle Python workers of a kind (UDF, data source read, write, ...) Spark keeps for reuse on a
#: local master (:func:`task_slots` says it is one), instead of every worker it ever started: one.
#: Measured on the demo (in-process runner, 100 events/s, 5 s trigger, the driver JVM options above,
#: PSS mean over 110 s, one run each): Spark's Python processes held 499 MiB (33 processes)
#: unbounded, 429 MiB (31) with 2 per kind, 391 MiB (30) with 1 per kind; CPU of the tree 53.8%,
#: 51.0%, 55.5% of a core. Then on the launched demo (``bench/cost.py --rates 100 --window 120
#: --warmup 60``, one run each): the driver tree's PSS mean 1,237 MiB with 2 per kind (one per task
#: slot of ``local[2]``), 1,194 MiB with 1, at 0.391 and 0.401 of a core. With one, a batch running
#: two tasks of a kind at once forks the second worker from Spark's daemon (warm: it was forked from
#: the zygote) and ends it after the task.
IDLE_WORKERS = 1
IDLE_WORKERS_CONF = "spark.python.factory.idleWorkerMaxPoolSize"

#: Classes Spark keeps compiled from the code it generates (Janino), keyed by their source: 500, not
#: Spark's 100. The demo's seven queries use more than 100 at once (105-109 compiled classes alive,
#: ~135 with room), so a micro-batch evicted code that a later one compiled again: a new class, which
#: the JIT then compiled again too. Measured on the demo's driver 1-2 minutes into a run (100 events/s,
#: ``/proc`` per thread, ``jstat -class``): classes unloaded 93-124 -> 5 per 30 s, the JIT compiler
#: threads 0.089 -> 0.070 of a core, the JVM 0.338 -> 0.263 (with 1,000; the evicted are the least
#: recently used, and the live set is used every batch). Code whose source changes every batch (a
#: watermark's literal in a state store's predicate: ~0.4 new classes a second) still comes and goes,
#: bounded by the cache (see also :mod:`isbflow.steps.hadoop_fs`).
CODEGEN_CACHE_ENTRIES = 500
CODEGEN_CACHE_CONF = "spark.sql.codegen.cache.maxEntries"

#: Threads that build broadcast tables at once (a static conf; Spark's default 128). Spark's pool
#: keeps as many threads as it has, each for a minute after its last broadcast, and starts a new one
#: for every broadcast until it holds that many: the demo's ``enrich`` (a broadcast join every
#: micro-batch) kept 36 threads alive with adaptive execution, 12 without (:func:`step_query_conf`),
#: ~90 KiB of touched stack each in the driver's PSS. Eight broadcast tables are built at once, the
#: rest wait for one of them (a reference table takes milliseconds).
BROADCAST_THREADS = 8
BROADCAST_THREADS_CONF = "spark.sql.broadcastExchange.maxThreadThreshold"

#: The buffer Spark serializes a broadcast into grows in pieces of this size: 256 KiB, not Spark's
#: 4 MiB. Every job broadcasts its task binary (and a stateful batch its Hadoop configuration, twice),
#: so each took a fresh 4 MiB array however small the object: on the demo's driver (JFR, allocations
#: outside TLABs, 30 s at minute 14) 47 such arrays from the DAG scheduler alone, 250 MB of the 530
#: MB allocated outside TLABs. Transient, but they filled the young generation, so collections came
#: more often and carried the batch's live objects into the old one (8-9 MB a collection), and full
#: collections (~200 ms each) followed every 15-20 s. With this and :data:`PAGE_SIZE`, the demo's GC
#: fell from 15.0 to 7.8-8.8 ms a micro-batch and its driver tree from 1,205 to 1,138-1,141 MiB PSS.
#: A broadcast larger than a piece is still one broadcast, in more pieces.
BROADCAST_BLOCK = "256k"
BROADCAST_BLOCK_CONF = "spark.broadcast.blockSize"
#: The page Spark's hash maps and sorters take memory in: 1 MiB, the smallest Spark derives itself
#: (from the heap and the cores), not the 8 MiB it derives from the driver's heap here: the demo's
#: ``enrich`` built the hash table of a reference table of a few rows in a fresh 8 MiB page every
#: micro-batch. A map that outgrows a page takes another (a record larger than a page gets a page
#: of its size).
PAGE_SIZE = "1m"
PAGE_SIZE_CONF = "spark.buffer.pageSize"


SHUFFLE_PARTITIONS_CONF = "spark.sql.shuffle.partitions"
#: the session's shuffle partitions for batch work (quality checks, recovery's merges); a step's
#: query gets its vertex's partitions instead (:func:`step_query_conf`)
SHUFFLE_PARTITIONS = 2
#: Spark's adaptive query execution, on for the session's batch work, off in a step's query
#: (:func:`step_query_conf`)
ADAPTIVE_CONF = "spark.sql.adaptive.enabled"
#: Spark's whole-stage code generation, off in a step's query (:func:`step_query_conf`): a step's
#: micro-batch at the rates people run holds a few hundred rows, so the code Spark generates and
#: compiles for each plan (Janino on the stream's thread, then the JIT) costs more than it saves.
#: Measured on the demo (``bench/cost.py --no-floors --rates 100``, three drivers at once, two rounds
#: in opposite orders): 135.8 / 146.6 -> 130.4 / 138.0 CPU ms a micro-batch, the stream threads
#: 31.3 / 32.7 -> 27.0 / 28.3 ms; at 10,000 events/s 0.0627 CPU-s per 1,000 events without it, 0.0615 and
#: 0.0752 in two runs with it (no cost seen). Spark's switch for all code generation
#: (``spark.sql.codegen.factoryMode``, internal) cut 9% at 100 events/s but cost 26% per event at
#: 10,000: not used. The session's batch work (quality checks, recovery's merges) keeps it.
WHOLE_STAGE_CONF = "spark.sql.codegen.wholeStage"
_conf_lock = threading.Lock()


@contextmanager
def step_query_conf(spark, partitions: int) -> Iterator[None]:
    """A streaming query started inside runs its shuffles, and keeps its state, in ``partitions``
    partitions, and without adaptive query execution.

    Spark copies the session's conf when a streaming query starts, and a stateful query's checkpoint
    records its shuffle partitions at its first batch: its state partitions for life (a checkpoint
    that exists keeps its own number, whatever the session says). A vertex's ``partitions`` is its
    parallelism (one read task per input partition), so its state has as many: the demo's
    ``minutely`` (one partition) ran three tasks a batch, its read and a shuffle into two state
    stores, for a few hundred rows; it runs two, into one state store.

    Adaptive execution re-plans a job at its exchanges from what the finished stages measured
    (coalescing shuffle partitions, switching join strategies, skew): Spark runs it in a stateless
    micro-batch with an exchange, such as the demo's ``enrich`` (a stream-static broadcast join),
    where every batch then planned twice, ran its broadcast as a query stage and its result as
    another, through two more thread pools (``QueryStageCreator``, ``ResultQueryStage``), to
    adapt a plan that a batch of a few hundred rows leaves as it is. Spark already turns it off
    for stateful queries. Nor with whole-stage code generation (:data:`WHOLE_STAGE_CONF`). The
    session's values are put back on the way out; queries started at once from other threads wait
    for each other."""
    conf = {SHUFFLE_PARTITIONS_CONF: str(max(1, partitions)), ADAPTIVE_CONF: "false", WHOLE_STAGE_CONF: "false"}
    with _conf_lock:
        before = {k: spark.conf.get(k) for k in conf}
        for k, v in conf.items():
            spark.conf.set(k, v)
        try:
            yield
        finally:
            for k, v in before.items():
                spark.conf.set(k, v)


class QueryStarter:
    """A streaming query's writer whose ``start()`` runs it under :func:`step_query_conf` (the
    vertex's partitions, no adaptive execution): the runner's first start and every restart from
    the checkpoint."""

    def __init__(self, spark, writer, partitions: int):
        self.spark, self.writer, self.partitions = spark, writer, partitions

    def start(self):
        with step_query_conf(self.spark, self.partitions):
            return self.writer.start()


def task_slots(master: str) -> int | None:
    """Tasks a ``local`` master runs at once (``local``: 1, ``local[N]`` and ``local[N,F]``: N,
    ``local[*]``: the machine's cores); ``None`` for a cluster master (its executors say)."""
    m = re.fullmatch(r"local(?:\[(\*|\d+)(?:,\d+)?\])?", master.strip())
    if m is None:
        return None
    n = m.group(1)
    return 1 if n is None else (os.cpu_count() or 1) if n == "*" else max(1, int(n))


#: the environment variables that name Spark's Python (executors' and the driver's)
PYTHON_EXECUTABLES = ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON")


CLASSPATH_CONF = "spark.driver.extraClassPath"
LOCAL_FS_CONF = "spark.hadoop.fs.file.impl"


def local_fs_conf(conf: dict[str, str]) -> dict[str, str]:
    """The conf that makes ``file:`` paths go through :data:`isbflow.steps.hadoop_fs.CLASS` (no ``chmod``
    process per file created), for a local master: its jar on the classpath of the JVM about to
    start (after a user's ``spark.driver.extraClassPath``), and the class as ``fs.file.impl``. A JVM
    already running gets the class only when it can load it (and one that ``spark-submit`` started,
    not yet reachable, does not). Empty when the class cannot be had
    (:func:`isbflow.steps.hadoop_fs.classpath` says why) or ``conf`` names its own ``fs.file.impl``."""
    if LOCAL_FS_CONF in conf:
        return {}
    if SparkContext._gateway is None:
        if "PYSPARK_GATEWAY_PORT" in os.environ:  # under spark-submit: its JVM runs already
            return {}
        where = hadoop_fs.classpath()
        if where is None:
            return {}
        own = conf.get(CLASSPATH_CONF)
        return {CLASSPATH_CONF: f"{own}{os.pathsep}{where}" if own else where, LOCAL_FS_CONF: hadoop_fs.CLASS}
    try:
        SparkContext._jvm.java.lang.Class.forName(hadoop_fs.CLASS)
    except Exception:  # noqa: BLE001 - py4j raises its own errors for a class the JVM lacks
        return {}
    return {LOCAL_FS_CONF: hadoop_fs.CLASS}


def spark_session(master: str = "local[2]", app_name: str = "isbflow", conf: dict[str, str] | None = None):
    """A SparkSession on loopback with isbflow's data sources registered.

    The Spark UI cannot kill stages or jobs (``spark.ui.killEnabled=false``: anyone who reaches
    the UI port could), Hadoop writes checkpoints with the umask 077 (owner only, like the
    data dir they live in: :mod:`isbflow.spec.paths`), through the FileSystem API
    (:data:`CHECKPOINT_FILE_MANAGER`) and, on a local master, with isbflow's local file system
    (:func:`local_fs_conf`: no ``chmod`` process per file).
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

    b = (SparkSession.builder.master(master).appName(app_name)
         .config("spark.driver.host", "127.0.0.1")
         .config("spark.driver.bindAddress", "127.0.0.1")
         .config("spark.ui.host", "127.0.0.1")
         .config(SHUFFLE_PARTITIONS_CONF, str(SHUFFLE_PARTITIONS))
         .config("spark.sql.session.timeZone", "UTC")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.ui.killEnabled", "false")
         .config("spark.hadoop.fs.permissions.umask-mode", "077")
         .config("spark.sql.streaming.checkpointFileManagerClass", CHECKPOINT_FILE_MANAGER)
         .config(CODEGEN_CACHE_CONF, str(CODEGEN_CACHE_ENTRIES))
         .config(BROADCAST_THREADS_CONF, str(BROADCAST_THREADS))
         .config(BROADCAST_BLOCK_CONF, BROADCAST_BLOCK)
         .config(PAGE_SIZE_CONF, PAGE_SIZE))
    conf = dict(conf or {})
    if task_slots(master) is not None:
        b = b.config(IDLE_WORKERS_CONF, str(IDLE_WORKERS))
        conf.update(local_fs_conf(conf))  # a user's classpath is kept in it, a user's fs.file.impl wins
    for k, v in conf.items():
        b = b.config(k, v)
    real = {k: os.environ.get(k) for k in (*PYTHON_EXECUTABLES, "MALLOC_ARENA_MAX")}
    if SparkContext._active_spark_context is None:
        # the JVM and the zygote start now, with their malloc arenas bounded (a user's value kept;
        # a launched driver has it from its environment already: MALLOC_ARENAS)
        os.environ.setdefault("MALLOC_ARENA_MAX", MALLOC_ARENAS)
        # Spark reads its Python executables when the context starts (the driver's for its data
        # source lookups): the zygote's launcher then (Python processes forked warm,
        # :mod:`isbflow.steps.zygote`); the environment is put back so processes this driver
        # starts later see the real Python
        os.environ.update({k: zygote.launcher_for(os.environ[k]) for k in PYTHON_EXECUTABLES})
    try:
        spark = b.getOrCreate()
    finally:
        for k, v in real.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    quiet_trigger_warnings(spark)
    register_sources(spark)
    return spark


#: Spark's logger that warns once per micro-batch longer than its trigger interval (Spark 4 moved it)
TRIGGER_LOGGERS = ("org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
                   "org.apache.spark.sql.execution.streaming.ProcessingTimeExecutor")


def quiet_trigger_warnings(spark) -> None:
    """Log only errors from Spark's ``ProcessingTimeExecutor``, whatever the root level: on a busy
    machine every batch longer than the trigger interval logs "Current batch is falling behind",
    one line per batch for the life of the stream (385 KB of a 30-minute soak's driver log). How
    long batches take is in the step's heartbeats and metrics (batch duration, rates) instead."""
    jvm = spark.sparkContext._jvm  # log4j 2 through py4j: Spark's setLogLevel only sets the root
    error = jvm.org.apache.logging.log4j.Level.ERROR
    for name in TRIGGER_LOGGERS:
        jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, error)


def register_sources(spark) -> None:
    for ds in (JetStreamDataSource, FilesDataSource, ReferenceDataSource, DeltaSinkDataSource,
               WriteThroughDataSource):
        spark.dataSource.register(ds)


def load_transform(entry: str) -> Callable:
    """The vertex's transform; a :class:`StepError` when the entry names no importable callable."""
    try:
        return transforms.load_transform(entry)
    except transforms.TransformError as e:
        raise StepError(str(e)) from None
