"""The step runner: wires each vertex of a pipeline as Spark streaming queries.

For every vertex the runner builds what the spec says, the user's code only
transforms DataFrames:

* **source** (JetStream subject of JSON events, or a landing folder): read
  events, parse them with ``from_json`` against the spec's ``schema`` in the JVM;
  a record that is not JSON, has a wrong type or misses a field gets
  ``_isb_error`` and the writer sends it to the dead-letter buffer with that
  reason; the rest flow on with their ``_isb_id``;
* **udf**: read the frames of every input edge partition, call
  ``module:function(df, **references)``; each reference is a broadcast
  ``isb-ref`` table, cached in the driver and read again when its KV bucket's
  revision moves (the runner asks on every heartbeat, 2-5 s), so a changed value
  shows up in a batch after the next beat;
* **sink**: read the frames and write the Delta table (one Delta commit per micro-batch; the read
  tasks write the Parquet, :mod:`isbflow.steps.write_through`, or under a failure policy Spark's
  Parquet writer, :mod:`isbflow.sinks.delta_spark`) or the PostgreSQL table.

A udf with ``output: update`` (a streaming aggregation) runs in Spark's update
output mode and publishes through :mod:`isbflow.steps.update` (each row stamped
with its version); rows of one key always go to one edge partition, and the sink
it feeds upserts on its ``keys`` (the Delta sink's ``mode=upsert``, latest version
per key and batch), so every window, open ones included, is in the sink.

Each vertex runs one query, however many out edges it has: the jetstream
writer's fan-out writes them all from one pass over the transform's output
(:mod:`isbflow.connector.writer`); an edge with ``conditions.tags`` takes only
the records whose ``_tags`` match (:mod:`isbflow.steps.routing`); rows are
routed to an edge's partitions by ``pmod(xxhash64(partitionKey), partitions)``,
computed in the JVM. The query's checkpoint is named after the vertex, or, for a
vertex with one out edge, after that edge (:meth:`Pipeline.query_to`).

After each micro-batch the runner records, per input stream, the sequence the
step has committed (``committed.<vertex>.<stream>`` in the status bucket: what
writers' backpressure and buffer release go by), releases WorkQueue/Interest
buffers up to it, and writes the step's heartbeat. Triggers:

* ``available-now``: steps run one after the other in topological order, each
  until it has processed what its inputs held when it started (the batch mode
  of the same code);
* ``continuous``: all steps run at once; the runner follows the control keys
  and drains a step when told (:mod:`isbflow.steps.drain`): it freezes the
  step's end offsets (the reader never reads past them), waits until they are
  committed, stops the query and reports ``drained`` with its final offsets.
  Source steps batch every ``limits.readTimeout`` (the latency budget); steps
  that read buffers are *event-driven* (on ``Limits`` buffers): a trigger that
  finds nothing new waits for its input to grow (:mod:`isbflow.isb.wait`), so a
  step starts its batch as soon as the upstream's frames land, and an idle step
  costs one wait per :data:`IDLE_WAIT` seconds instead of a look per trigger.

Relative sink paths and checkpoints live under the data dir.

Sinks record the source offsets they commit in the offset ledger
(:mod:`isbflow.isb.ledger`). For recovery (:mod:`isbflow.recovery.recover`)
the runner takes ``starting_offsets`` (vertex -> the reader's ``startingOffsets``
JSON, used by a query without a checkpoint) and ``sink_mode`` (``merge``:
sinks insert only rows whose key they lack; ``merge_keys`` names the key of a
sink whose rows have no ``_isb_id``). A sink's app id carries the pipeline's
*checkpoint epoch* (:func:`checkpoint_epoch`, bumped by recovery when it moves
checkpoints aside) so a fresh checkpoint's batch ids are not taken for
batches the table already holds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyspark.sql import functions as F
from pyspark.sql.types import LongType, StringType, StructField, StructType

from isbflow.connector.files import FILES_SCHEMA, FilesSourceError, landing_folder
from isbflow.connector.reader import EVENTS_SCHEMA, dead_frames
from isbflow.connector.writer import read_write_totals
from isbflow.isb import naming
from isbflow.isb import state as st
from isbflow.isb.buffers import release, stream_state
from isbflow.isb.connect import IsbSettings, SyncSession, settings_to_json
from isbflow.isb.reference import current_revision
from isbflow.spec import Specs, constants
from isbflow.spec.models import OutputMode, Pipeline, Vertex
from isbflow.spec.paths import DataDir
from isbflow.steps import routing, sink_policy, write_through
from isbflow.steps.autoscale_apply import Autoscaler, await_query
from isbflow.steps.checkpoints import fan_out_start
from isbflow.steps.delta_sink import delta_option_map, delta_writer, writes_through
from isbflow.steps.driver import interval_s
from isbflow.steps.pg_sink import postgres_writer
from isbflow.steps.progress import (  # noqa: F401
    RunningQuery,
    StepRun,
    account_batches,
    committed_offsets,
    has_new_batch,
    last_progress,
    step_committed,
)
from isbflow.steps.restart import (  # noqa: F401 - re-exported for callers of the runner
    DEFAULT_RESTARTS,
    TRANSIENT_FAILURES,
    RestartPolicy,
    StepError,
    error_summary,
    is_transient,
)
from isbflow.steps.session import (  # noqa: F401 - re-exported
    QueryStarter,
    checkpoint_epoch,
    epoch_file,
    load_transform,
    register_sources,
    spark_session,
)
from isbflow.steps.update import VERSION_COLUMN, UpdatePublisher

log = logging.getLogger(__name__)

PARTITION_COLUMN = "_isb_partition"
ERROR_COLUMN = "_isb_error"
#: seconds a continuous step's trigger that finds no new input waits for it (``ISBFLOW_IDLE_WAIT``;
#: 0: poll each trigger, as before); bounded, as stopping a query waits for a trigger in progress
#: (the runner tells readers to stop waiting first: :meth:`PipelineRunner.stop_all`)
IDLE_WAIT = float(os.environ.get("ISBFLOW_IDLE_WAIT", "5"))
#: the trigger interval of an event-driven step (one that reads buffers, with idle waits): what a
#: batch waits at most once its input has grown; also what bounds its polling should waits fail
EVENT_TRIGGER_S = 0.25
#: seconds without a batch in any step after which the continuous loop looks at the queries once per
#: heartbeat interval and beats every :data:`QUIET_HEARTBEAT_S` (well inside the UI's 30 s staleness)
QUIET_AFTER_S = 10.0
QUIET_HEARTBEAT_S = 5.0
#: the shortest heartbeat interval of a busy continuous run (:func:`heartbeat_interval_s`)
HEARTBEAT_S = 2.0


def trigger_interval(p: Pipeline, v: Vertex, override: str | None = None, event_driven: bool = False) -> str:
    """The micro-batch interval of ``v``'s query: ``override`` when given (a runner's
    ``processing_time``), else the spec's ``limits.readTimeout`` (the vertex's over the
    pipeline's, default :data:`~isbflow.spec.constants.READ_TIMEOUT_S`): the latency budget, how long
    events gather before a batch.

    ``event_driven`` (a continuous run whose readers wait for their input, :mod:`isbflow.isb.wait`):
    that budget is spent once, at the source; a step that reads buffers starts a batch as soon
    as its input grows (:data:`EVENT_TRIGGER_S` apart at most), unless its own ``limits.readTimeout``
    sets its interval."""
    if event_driven and not v.source:
        own = v.limits.readTimeout if v.limits is not None else None
        return f"{round((own or EVENT_TRIGGER_S) * 1000)} milliseconds"
    if override:
        return override
    seconds = v.effective_limits(p.spec.limits).readTimeout or constants.READ_TIMEOUT_S
    return f"{round(seconds * 1000)} milliseconds"


def latency_budget_s(p: Pipeline, override: str | None = None) -> float:
    """The pipeline's latency budget: the shortest interval at which one of its sources starts a
    batch (:func:`trigger_interval`; ``override`` as a runner's ``processing_time``), what an event
    waits at most before its first step takes it. Chooses the driver's JVM options
    (:func:`isbflow.steps.session.driver_conf`). Validation ensures a pipeline has a source."""
    return min(interval_s(trigger_interval(p, v, override)) for v in p.spec.vertices if v.source)


def heartbeat_interval_s(p: Pipeline, override: str | None = None) -> float:
    """How often a busy continuous run beats: the pipeline's latency budget (:func:`latency_budget_s`),
    at least :data:`HEARTBEAT_S` and at most :data:`QUIET_HEARTBEAT_S`. A beat writes every step's
    status and reads its counters, control key and failure (NATS requests and Py4J calls per step):
    with a 5 s budget, data moves every 5 s and a 2 s beat wrote each status two or three times
    between its batches."""
    return min(QUIET_HEARTBEAT_S, max(HEARTBEAT_S, latency_budget_s(p, override)))


class PipelineRunner:
    def __init__(self, spark, specs: Specs, pipeline: Pipeline, settings: IsbSettings, data_dir: Path,
                 processing_time: str | None = None, starting_offsets: dict[str, dict] | None = None,
                 sink_mode: str = "append", merge_keys: dict[str, list[str]] | None = None,
                 restarts: RestartPolicy = DEFAULT_RESTARTS, idle_wait: float = IDLE_WAIT, replay: bool = False):
        self.spark = spark
        #: a replay of what the buffers hold already (recovery's): its written-through sinks read in
        #: batches of :func:`~isbflow.steps.write_through.replay_read_rows`
        self.replay = replay
        self.idle_wait = idle_wait
        self.restarts = restarts
        self.specs = specs
        self.p = pipeline
        self.settings = settings
        self.data_dir = Path(data_dir).absolute()
        DataDir(self.data_dir).ensure()  # 0700: sinks, checkpoints and stats are the owner's only
        self.processing_time = processing_time
        self.service = specs.service_for(pipeline)
        # a Redis buffer is released after the downstream commit, as JetStream's Interest buffers are
        self.retention = ("Interest" if self.service.store == "redis"
                          else self.service.spec.jetstream.bufferConfig.stream.retention.value)
        #: source stream -> how many of its newest committed events stay after a release: on Redis a
        #: source keeps the last bufferMaxLength events its step committed, what recovery replays from
        #: (a JetStream source keeps what its stream's limits say); an edge partition keeps nothing
        self._source_keep = ({naming.source_stream(pipeline, v.name): v.effective_limits(pipeline.spec.limits).bufferMaxLength
                              for v in pipeline.spec.vertices if v.source is not None and v.source.jetstream is not None}
                             if self.service.store == "redis" else {})
        self.max_payload = self.service.spec.jetstream.settings.max_payload
        self._schemas: dict[str, Any] = {}
        self.runs: dict[str, StepRun] = {}
        self.nats = SyncSession(settings, name="isbflow-runner")
        self.nats.nc  # noqa: B018 - connect now: an unreachable ISB service fails the runner's start
        self.settings_json = settings_to_json(settings)
        self.starting_offsets = starting_offsets or {}
        self.sink_mode = sink_mode
        self.merge_keys = merge_keys or {}
        self.sink_policies: dict[str, sink_policy.SinkPolicy] = {}  # sink vertex -> its failure policy
        #: (reference, key column) -> the cached DataFrame and the bucket revision it was cached at
        self._refs: dict[tuple[str, str], tuple[Any, int | None]] = {}
        self.metrics: Any = None  # isbflow.steps.metrics.PipelineMetrics when served (--metrics-port)
        #: the fewest tasks a large batch of a written-through sink is read in (``minPartitions``)
        self.task_slots = max(1, int(spark.sparkContext.defaultParallelism))
        self.autoscaler = Autoscaler(self)  # acts on each vertex's scale (isbflow.steps.autoscale_apply)

    # ------------------------------------------------------------------ planning
    @property
    def event_driven(self) -> bool:
        """Continuous steps that read buffers wait for their input (:mod:`isbflow.isb.wait`)."""
        return self.idle_wait > 0 and self.retention == "Limits"

    def trigger_interval(self, v: Vertex) -> str:
        return trigger_interval(self.p, v, self.processing_time, self.event_driven)

    def sink_path(self, v: Vertex) -> str:
        assert v.sink is not None
        if v.sink.delta is None:
            raise StepError(f"sink {v.name!r} is a PostgreSQL table ({v.sink.postgres.table}), not a Delta table")
        path = Path(v.sink.delta.path)
        return str(path if path.is_absolute() else self.data_dir / path)

    def sink_app_id(self, vertex: str) -> str:
        """The sink's Delta app id: ``<pipeline>/<vertex>``, plus ``#e<epoch>`` after a recovery."""
        epoch = checkpoint_epoch(self.data_dir, self.p.name)
        return f"{self.p.name}/{vertex}" + (f"#e{epoch}" if epoch else "")

    def checkpoint(self, vertex: str, to: str | None) -> str:
        return str(DataDir(self.data_dir).checkpoint(self.p.name, vertex, to))

    def input_streams(self, vertex: str) -> list[str]:
        v = self.p.vertex(vertex)
        if v.source:
            return [naming.source_stream(self.p, vertex)] if v.source.jetstream else []
        return [ep.stream for ep in naming.edge_partitions(self.p) if ep.to_vertex == vertex]

    def source_schema(self, v: Vertex):
        assert v.source is not None
        if not v.source.schema_:
            raise StepError(f"source {v.name!r}: the spec needs source.schema (Spark DDL of one event)")
        return StructType.fromDDL(v.source.schema_)

    def output_schema(self, vertex: str):
        """The schema a vertex writes to its output edges (transforms applied to an empty frame)."""
        if vertex not in self._schemas:
            df = self.apply_transform(vertex, self._empty_input(vertex))
            drop = (ERROR_COLUMN, "_isb_raw") + ((routing.TAGS_COLUMN,) if self.p.vertex(vertex).udf else ())
            self._schemas[vertex] = df.drop(*drop).schema  # _tags is routing metadata (steps.routing)
        return self._schemas[vertex]

    def _empty_input(self, vertex: str):
        v = self.p.vertex(vertex)
        if v.source:
            schema = EVENTS_SCHEMA if v.source.jetstream else FILES_SCHEMA
            return self.spark.createDataFrame([], schema)
        return self.spark.createDataFrame([], self.input_schema(vertex))

    def update_keys(self, vertex: str) -> list[str] | None:
        """The ``udf.keys`` of a step with ``udf.output: update``; None for every other vertex."""
        v = self.p.vertex(vertex)
        return list(v.udf.keys) if v.udf and v.udf.output == OutputMode.UPDATE else None

    def upsert_keys(self, sink: str) -> list[str] | None:
        """The keys a sink upserts on: those of the update step feeding it (None: not such a sink)."""
        for e in self.p.inputs(sink):
            keys = self.update_keys(e.from_)
            if keys:
                return keys
        return None

    def _wire_schema(self, vertex: str):
        """What a vertex's frames carry: its output, plus the row version for an update step."""
        schema = self.output_schema(vertex)
        if self.update_keys(vertex):
            schema = StructType([*schema.fields, StructField(VERSION_COLUMN, LongType())])
        return schema

    def input_schema(self, vertex: str):
        schemas = {e.from_: self._wire_schema(e.from_) for e in self.p.inputs(vertex)}
        first = next(iter(schemas.values()))
        for up, s in schemas.items():
            if s != first:
                raise StepError(f"step {vertex!r}: its inputs have different schemas ({up!r} differs)")
        return first

    def _references(self, v: Vertex) -> dict[str, Any]:
        """The vertex's reference tables, each a broadcast ``isb-ref`` DataFrame cached in the driver.

        Spark plans a stream-static join's static side again for every micro-batch; uncached, a Python
        source's side cost every batch a planning call in a Python process and a read task that
        connected to NATS and read the whole bucket. Cached, a batch builds its broadcast from the
        driver's memory; :meth:`_refresh_references` drops the cache when the bucket's revision moves,
        and the next batch reads the table again."""
        refs = {}
        for r in (v.udf.references if v.udf else []):
            cached = self._refs.get((r.name, r.key))
            if cached is None:
                revision = self._reference_revision(r.name)  # before the read: a put racing it reloads
                df = (self.spark.read.format("isb-ref").option("pipeline", self.p.name).option("name", r.name)
                      .option("key", r.key).option("settings", self.settings_json).load()).persist()
                cached = self._refs[(r.name, r.key)] = (df, revision)
            refs[r.name.replace("-", "_")] = F.broadcast(cached[0])
        return refs

    def _reference_revision(self, name: str) -> int | None:
        """The reference table's revision (``None`` when it is missing): :func:`isbflow.isb.reference.current_revision`."""
        return self.nats.run(current_revision(self.nats.nc, self.p.name, name))

    def _refresh_references(self, vertex: str) -> None:
        """On the beat: a reference of ``vertex`` whose bucket moved since it was cached is read again
        by the next micro-batch that joins it (the same DataFrame, cached anew)."""
        v = self.p.vertex(vertex)
        for r in (v.udf.references if v.udf else []):
            cached = self._refs.get((r.name, r.key))
            if cached is None:
                continue
            revision = self._reference_revision(r.name)
            if revision != cached[1]:
                df = cached[0]
                df.unpersist()
                df.persist()
                self._refs[(r.name, r.key)] = (df, revision)
                log.info("step %s: reference %s changed (revision %s -> %s); the next batch reads it again",
                         vertex, r.name, cached[1], revision)

    def apply_transform(self, vertex: str, df):
        """What a vertex does to its input DataFrame (source parse, user transform, or nothing)."""
        v = self.p.vertex(vertex)
        if v.source:
            schema = self.source_schema(v)
            with_corrupt = StructType([*schema.fields, StructField("_isb_corrupt", StringType())])
            parsed = df.select(F.from_json("value", with_corrupt, {"columnNameOfCorruptRecord": "_isb_corrupt"})
                               .alias("_r"), "_isb_id", "value", *[c for c in (ERROR_COLUMN,) if c in df.columns])
            missing = F.concat_ws(", ", *[F.when(F.col(f"_r.{f.name}").isNull(), F.lit(f.name))
                                          for f in schema.fields])
            malformed = F.col("_r").isNull() | F.col("_r._isb_corrupt").isNotNull()
            reason = F.lit("malformed record: not JSON, or a field of the wrong type")
            error = (F.when(F.col(ERROR_COLUMN).isNotNull(), F.col(ERROR_COLUMN)).when(malformed, reason)
                     if ERROR_COLUMN in df.columns  # the source's own reason first (isb-files: not UTF-8, too long)
                     else F.when(malformed, reason)).when(missing != "", F.concat(F.lit("missing field(s): "), missing))
            return parsed.select(*[F.col(f"_r.{f.name}").alias(f.name) for f in schema.fields], "_isb_id",
                                 error.alias(ERROR_COLUMN), F.when(error.isNotNull(), F.col("value"))
                                 .alias("_isb_raw"))
        if v.udf:
            fn = load_transform(v.udf.transform)
            try:
                return fn(df, **self._references(v))
            except Exception as e:
                raise StepError(f"step {vertex!r}: transform {v.udf.transform} failed: {e}") from e
        return df

    def _read(self, vertex: str, available_now: bool = False, through: dict[str, str] | None = None):
        """The vertex's input; ``through``: a Delta sink's options, its tasks write the sink's files
        (:mod:`isbflow.steps.write_through`)."""
        v = self.p.vertex(vertex)
        limits = v.effective_limits(self.p.spec.limits)
        if v.source and v.source.files:
            try:
                path = landing_folder(v.source.files.path, self.data_dir)
            except FilesSourceError as e:
                raise StepError(f"source {vertex!r}: {e}") from None
            return (self.spark.readStream.format("isb-files").option("path", str(path))
                    .option("pattern", v.source.files.pattern)
                    .option("readMaxRows", str(limits.readBatchSize)).load())
        rows = limits.readBatchSize
        if through is not None and self.replay:
            rows = write_through.replay_read_rows(rows)
        r = (self.spark.readStream.format("jetstream" if through is None else write_through.FORMAT)
             .option("settings", self.settings_json)
             .option("streams", ",".join(self.input_streams(vertex)))
             .option("readMaxRows", str(rows))
             .option("onBufferLoss", v.onBufferLoss.value)
             .option("pipeline", self.p.name).option("vertex", vertex)
             .options(**self.autoscaler.reader_options(vertex)))
        if vertex in self.starting_offsets:
            r = r.option("startingOffsets", json.dumps(self.starting_offsets[vertex]))
        if not available_now and self.event_driven:
            # event-driven: a trigger that finds nothing new waits for the input to grow (isb.wait)
            no_wait = DataDir(self.data_dir).no_wait(self.p.name, vertex)
            no_wait.unlink(missing_ok=True)
            r = r.option("idleWait", str(self.idle_wait)).option("noWaitFile", str(no_wait))
        if v.source:
            return r.option("mode", "events").option("sourceName", vertex).load()
        if through is not None:  # each task reads and writes in one Python process: fill the task slots
            return r.option("mode", "frames").option("minPartitions", str(self.task_slots)).options(
                **write_through.through_options(self.input_schema(vertex), through)).load()
        return r.option("mode", "frames").schema(self.input_schema(vertex)).load()

    def _start(self, vertex: str, available_now: bool) -> StepRun:
        v = self.p.vertex(vertex)
        run = StepRun(vertex)
        # Spark looks data sources up through the calling thread's active session
        self.spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(self.spark._jsparkSession)
        carried = fan_out_start(self.data_dir, self.p, vertex)  # per-edge checkpoints of an older isbflow
        if carried and vertex not in self.starting_offsets:
            self.starting_offsets[vertex] = carried
        through = self._through_options(v)
        df = self.apply_transform(vertex, self._read(vertex, available_now, through))
        inputs = self.input_streams(vertex)
        keys = self.update_keys(vertex)
        if keys:
            missing = [k for k in keys if k not in df.columns]
            if missing:
                raise StepError(f"step {vertex!r}: udf.keys {missing} are not columns of what "
                                f"{v.udf.transform} returns ({', '.join(df.columns)})")
        routing.check_tags(df, self.p, vertex, v.udf.transform if v.udf else vertex)
        outs = self.p.outputs(vertex)
        edges = [(e.to, str(DataDir(self.data_dir).stats(self.p.name, vertex, e.to))) for e in outs]
        if v.sink:
            w = self._sink_writer(v, df, through)
        else:
            w = self._edge_writer(v, df, keys, edges)
        # update: each micro-batch emits the current value of every key it changed (module doc)
        to = self.p.query_to(vertex)
        w = w.outputMode("update" if keys else "append")
        checkpoint = self.checkpoint(vertex, to)
        w = w.option("checkpointLocation", checkpoint)
        w = w.queryName(f"{self.p.name}.{vertex}" + (f".to.{to}" if to else ""))
        w = w.trigger(availableNow=True) if available_now else w.trigger(processingTime=self.trigger_interval(v))
        # its shuffles and state in the vertex's partitions, at every start (QueryStarter)
        starter = QueryStarter(self.spark, w, v.partitions)
        self.autoscaler.start(vertex, carry=available_now)
        run.queries.append(RunningQuery(vertex, to, starter.start(), inputs, edges=edges, writer=starter,
                                        checkpoint=checkpoint))
        run.status = st.StepStatus(vertex, state=st.Observed.RUNNING, app=self.spark.sparkContext.applicationId,
                                   pid=os.getpid())
        self.runs[vertex] = run
        return run

    def _edge_writer(self, v: Vertex, df, keys: list[str] | None, edges: list[tuple[str, str]]):
        """The writer of every out edge of ``v`` in one pass (the jetstream writer's fan-out; an
        update step publishes through ``foreachBatch``): each row goes to the partition its edge's
        ``partitionKey`` (or the update keys) hashes to, on each edge whose conditions it matches."""
        parts, targets = [], []
        for e, (_, stats) in zip(self.p.outputs(v.name), edges, strict=True):
            to = self.p.vertex(e.to)
            n = to.partitions
            if e.partitionKey and n > 1:
                part = F.pmod(F.xxhash64(F.col(e.partitionKey)), F.lit(n))
            elif keys and n > 1:  # every version of a key to one partition, so the sink sees them in order
                part = F.pmod(F.xxhash64(*[F.col(k) for k in keys]), F.lit(n))
            else:
                part = F.lit(0)
            parts.append(part)
            limits = to.effective_limits(self.p.spec.limits)
            targets.append({"to": e.to, "partitions": str(n), "bufferMaxLength": str(limits.bufferMaxLength),
                            "bufferUsageLimit": str(limits.bufferUsageLimit), "statsDir": stats})
            gated = [s.name for s in self.p.spec.vertices if s.sink is not None and self.p.gate(s.name) is e]
            if gated:  # the offsets this edge routes elsewhere, recorded for the sinks behind it (isb.routed)
                targets[-1]["routedSinks"] = ",".join(gated)
        if not targets:
            raise StepError(f"step {v.name!r} has no out edge and is not a sink: nothing would read what it makes")
        out = routing.routed(df, self.p, v.name, parts)
        opts = {"settings": self.settings_json, "pipeline": self.p.name, "step": v.name,
                "maxPayload": str(self.max_payload), "onFull": v.onFull.value}
        if len(targets) == 1:
            opts.update(targets[0])
        else:
            opts["targets"] = json.dumps(targets)
        if keys:
            return out.writeStream.foreachBatch(UpdatePublisher(opts, checkpoint_epoch(self.data_dir, self.p.name)))
        return out.writeStream.format("jetstream").options(**opts)

    def _through_options(self, v: Vertex) -> dict[str, str] | None:
        """A Delta sink vertex written through: its sink's options (:func:`delta_option_map`)."""
        if not writes_through(v):
            return None
        return delta_option_map(self, v, self.sink_mode, self.merge_keys.get(v.name), self.upsert_keys(v.name))

    def _sink_writer(self, v: Vertex, df, through: dict[str, str] | None = None):
        """The ``foreachBatch`` writer of sink ``v`` (Delta: :mod:`isbflow.steps.delta_sink`, PostgreSQL:
        :mod:`isbflow.steps.pg_sink`): append (or the runner's ``sink_mode``); a sink fed by an update
        step upserts on its keys, keeping the latest version of a key per batch."""

        assert v.sink is not None
        mode, keys = self.sink_mode, self.merge_keys.get(v.name)
        upsert = self.upsert_keys(v.name)
        if v.sink.postgres is not None:
            return df.writeStream.foreachBatch(self._guarded(v, postgres_writer(self, v, df.columns, mode, keys,
                                                                                upsert)))
        if through is not None:  # the read tasks write the files: the rows never reach this query
            return df.writeStream.foreachBatch(delta_writer(through, self.input_schema(v.name).fieldNames(),
                                                            v.name, through=True))
        write = delta_writer(delta_option_map(self, v, mode, keys, upsert), df.columns, v.name)
        if v.sink.retryStrategy is not None or v.sink.fallback is not None:
            # a Delta sink refuses no rows one by one: without a policy it needs no wrapper (nor its
            # per-batch totals file), and a failed commit fails the query as before (the restart policy)
            write = self._guarded(v, write)
        return df.writeStream.foreachBatch(write)

    def _guarded(self, v: Vertex, write):
        """Sink ``v``'s ``foreachBatch`` function under its failure policy (:mod:`isbflow.steps.sink_policy`)."""
        self.sink_policies[v.name] = policy = sink_policy.policy_for(self, v, write)
        return policy

    # ------------------------------------------------------------------ bookkeeping
    def _bookkeep(self, run: StepRun, counters: bool = True) -> None:
        """After new batches: committed offsets, buffer release, heartbeat fields (``counters``:
        also the dead-letter, unrouted and lag figures, which cost NATS round trips and file reads:
        the continuous loop asks for them once per heartbeat, not every poll)."""
        status = run.status
        assert status is not None
        progress = last_progress(run.queries)
        committed = step_committed(run.queries, progress)
        account_batches(status, run.queries, progress)
        if committed and committed != status.committed:
            status.committed = committed
            self.nats.run(st.put_committed(self.nats.nc, self.p.name, run.vertex, committed))
            if self.retention in ("WorkQueue", "Interest"):
                for s, seq in committed.items():
                    upto = seq - self._source_keep.get(s, 0)
                    if upto > 0:
                        self.nats.run(release(self.nats.nc, s, upto, self.retention))
        if not counters:
            return
        status.dlq_total = self._dlq_total(run)
        status.unrouted_total = routing.unrouted_total([d for rq in run.queries for _, d in rq.edges])
        sink_policy.fold_status(status, self.sink_policies.get(run.vertex))
        status.lag = self._lag(run, committed)

    def _dlq_total(self, run: StepRun) -> int:
        """Records the step's writer dead-lettered plus input frames its reader dead-lettered."""
        total = 0
        for rq in run.queries:
            if rq.edges and Path(rq.edges[0][1]).exists():
                # one small file, however many batches ran (the writer keeps the running totals);
                # the writer counts a row's dead letter once, in its first edge's stats
                total += int(read_write_totals(rq.edges[0][1]).get("dead_lettered") or 0)
                break
        if run.vertex in self.sink_policies:  # rows the sink refused, dead-lettered
            total += self.sink_policies[run.vertex].totals.dead_lettered
        if not self.p.vertex(run.vertex).source:  # frames in: unreadable ones are counted in the status KV
            total += self.nats.run(dead_frames(self.nats.nc, self.p.name, run.vertex))
        return total

    def _lag(self, run: StepRun, committed: dict[str, int]) -> dict[str, int]:
        lag = {}
        for s in run.queries[0].inputs if run.queries else []:
            state = self.nats.run(stream_state(self.nats.nc, s))
            if state is not None:
                lag[s] = max(0, state.last_seq - committed.get(s, max(0, state.first_seq - 1)))
        return lag

    def _heartbeat(self, run: StepRun) -> None:
        assert run.status is not None
        self._refresh_references(run.vertex)
        self.autoscaler.look(run)
        self.nats.run(st.put_status(self.nats.nc, self.p.name, run.status))
        if self.metrics is not None:
            self.metrics.observe(self, run)
        self.nats.run(st.record_rates(self.nats.nc, self.p.name, run.status))  # the UI's rate chart

    def _restart_if_transient(self, run: StepRun, rq: RunningQuery, exc: BaseException) -> bool:
        """Start a query that failed transiently again from its checkpoint; False if not transient
        or out of restarts."""
        text = str(exc)
        policy = self.restarts
        if rq.restarts >= policy.max_restarts or not is_transient(exc):
            return False
        rq.restarts += 1
        if run.status is not None:
            run.status.restarts += 1
        wait = policy.wait_before(rq.restarts)
        log.warning("step %s: query %s failed transiently (%s); restart %d of %d from its checkpoint in %.0fs",
                    run.vertex, rq.to or run.vertex, text.splitlines()[0][:200], rq.restarts, policy.max_restarts, wait)
        time.sleep(wait)
        rq.query = rq.writer.start()
        return True

    def _check_failed(self, run: StepRun) -> None:
        for rq in run.queries:
            exc = rq.query.exception()
            if exc is not None and self._restart_if_transient(run, rq, exc):
                continue
            if exc is not None:
                assert run.status is not None
                run.status.state = st.Observed.FAILED
                run.status.error = error_summary(exc)
                self._heartbeat(run)
                self.stop_all()
                # the other steps of this runner stop with it: say so, or their last heartbeats
                # ("running") would claim they still run (recovery then waits to drain them)
                for other in self.runs.values():
                    if other is not run and other.status is not None and other.status.state in (
                            st.Observed.STARTING, st.Observed.RUNNING, st.Observed.DRAINING):
                        other.status.state = st.Observed.STOPPED
                        other.status.error = f"stopped with step {run.vertex!r}, which failed"
                        self._heartbeat(other)
                raise StepError(f"step {run.vertex!r} failed: {run.status.error}")

    # ------------------------------------------------------------------ modes
    def steps(self, only: list[str] | None = None) -> list[str]:
        order = self.p.topological_order()
        return [v for v in order if only is None or v in only]

    def run_available_now(self, only: list[str] | None = None,
                          on_step: Callable[[str, st.StepStatus], None] | None = None) -> dict[str, st.StepStatus]:
        """Each step in topological order until it has processed what its inputs hold."""
        out = {}
        for vertex in self.steps(only):
            # a drain point left by an earlier drain would cap this run at that drain's end
            self.nats.run(st.clear_drain_point(self.nats.nc, self.p.name, vertex))
            run = self._start(vertex, available_now=True)
            self._heartbeat(run)
            for rq in run.queries:
                while True:
                    try:
                        await_query(self, run, rq, heartbeat_interval_s(self.p, self.processing_time))
                        break
                    except Exception as e:  # noqa: BLE001 - StreamingQueryException; reported below
                        if not self._restart_if_transient(run, rq, e):
                            break
            self._check_failed(run)
            self._bookkeep(run)
            assert run.status is not None
            run.status.state = st.Observed.STOPPED
            run.status.final_offsets = dict(run.status.committed)
            self._heartbeat(run)
            out[vertex] = run.status
            if on_step:
                on_step(vertex, run.status)
        return out

    def run_continuous(self, only: list[str] | None = None, poll: float = 0.5, heartbeat_every: float | None = None,
                       should_stop: Callable[[], bool] | None = None) -> dict[str, st.StepStatus]:
        """All steps at once; returns when every step has drained (or ``should_stop``).

        The loop looks at the queries every ``poll`` seconds and beats every ``heartbeat_every``
        (default :func:`heartbeat_interval_s`: the latency budget, 2-5 s) while they work; once no
        step has run a batch for :data:`QUIET_AFTER_S` it looks once per ``heartbeat_every`` and
        beats every :data:`QUIET_HEARTBEAT_S`. A look asks Spark for a
        query's progress only when its checkpoint holds a batch not yet accounted for
        (:func:`has_new_batch`: a ``stat``); the control keys (drain), failed queries and the
        counters are read on the beat (each costs Py4J calls or NATS requests per step), and every
        look while a step drains."""
        if heartbeat_every is None:
            heartbeat_every = heartbeat_interval_s(self.p, self.processing_time)
        vertices = self.steps(only)
        for v in vertices:
            self.nats.run(st.clear_drain_point(self.nats.nc, self.p.name, v))
            if self.nats.run(st.get_desired(self.nats.nc, self.p.name, v)) != st.Desired.RUNNING:
                self.nats.run(st.set_desired(self.nats.nc, self.p.name, v, st.Desired.RUNNING))
            # "starting" before any query exists: a status left by an earlier run ("stopped") would
            # tell a drain that starts as soon as the queries do (recovery's replay) that it ended
            self.nats.run(st.put_status(self.nats.nc, self.p.name, st.StepStatus(
                v, state=st.Observed.STARTING, app=self.spark.sparkContext.applicationId, pid=os.getpid())))
        for v in vertices:
            self._heartbeat(self._start(v, available_now=False))
        last_beat = 0.0
        last_busy = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                quiet = now - last_busy >= QUIET_AFTER_S
                beat = now - last_beat >= (max(heartbeat_every, QUIET_HEARTBEAT_S) if quiet else heartbeat_every)
                for run in self.runs.values():
                    if run.status and run.status.state == st.Observed.DRAINED:
                        continue
                    batch = run.status.batch_id if run.status else None
                    if beat:
                        self._check_failed(run)
                    if beat or run.draining or any(has_new_batch(rq) for rq in run.queries):
                        self._bookkeep(run, counters=beat)
                    if beat or run.draining:
                        self._follow_control(run)
                    if run.draining or (run.status is not None and run.status.batch_id != batch):
                        last_busy = now
                for run in self.runs.values():
                    if beat or (run.status and run.status.state == st.Observed.DRAINED):
                        self._heartbeat(run)
                if beat:
                    last_beat = now
                if all(r.status and r.status.state == st.Observed.DRAINED for r in self.runs.values()):
                    break
                if should_stop is not None and should_stop():
                    for run in self.runs.values():  # the counters as they stand, not as of the last beat
                        if run.status and run.status.state != st.Observed.DRAINED:
                            self._bookkeep(run)
                    break
                time.sleep(poll if now - last_busy < QUIET_AFTER_S else max(poll, heartbeat_every))
        finally:
            self.stop_all()
        return {v: r.status for v, r in self.runs.items() if r.status}

    def _follow_control(self, run: StepRun) -> None:
        """Drain: freeze the end offsets, wait for them to be committed, then stop."""

        status = run.status
        assert status is not None
        if not run.draining:
            if self.nats.run(st.get_desired(self.nats.nc, self.p.name, run.vertex)) != st.Desired.DRAINING:
                return
            point = {}
            for s in run.queries[0].inputs:
                state = self.nats.run(stream_state(self.nats.nc, s))
                point[s] = state.last_seq if state else 0
            self._no_wait(run.vertex)  # a reader waiting for input would hold the drain up
            run.drain_point, run.draining = point, True
            self.nats.run(st.put_drain_point(self.nats.nc, self.p.name, run.vertex, point))
            status.state = st.Observed.DRAINING
            self._heartbeat(run)
            log.info("step %s draining up to %s", run.vertex, point)
        assert run.drain_point is not None
        done = all(
            (committed_offsets(rq) or {}).get(s, 0) >= seq or seq == 0
            for rq in run.queries for s, seq in run.drain_point.items()
        ) and all(not rq.query.status.get("isDataAvailable") for rq in run.queries)
        # stop between micro-batches only: a batch still running (e.g. a no-data batch an
        # aggregation runs to move its watermark) would be cancelled mid-write, and Spark's
        # handling of a foreachBatch cancelled that way can kill the stream thread
        done = done and all(not rq.query.status.get("isTriggerActive") for rq in run.queries)
        if not run.drain_point:  # a files source: drain when nothing is left to read
            done = all(not rq.query.status.get("isDataAvailable") and not rq.query.status.get("isTriggerActive")
                       for rq in run.queries)
        if done:
            for rq in run.queries:
                rq.query.stop()
            self._bookkeep(run)  # the final counters (the loop refreshes them once per heartbeat)
            status.state = st.Observed.DRAINED
            status.final_offsets = {**status.committed}
            self._heartbeat(run)
            log.info("step %s drained at %s", run.vertex, status.final_offsets)

    def _no_wait(self, vertex: str) -> None:
        """Tell ``vertex``'s reader to stop waiting for new input (its trigger then ends soon)."""
        path = DataDir(self.data_dir).no_wait(self.p.name, vertex)
        DataDir(self.data_dir).make(path.parent)
        path.touch()

    def stop_all(self) -> None:
        for policy in list(self.sink_policies.values()):  # a sink waiting to retry stops waiting
            policy.cancel()
        for vertex in list(self.runs):  # stopping a query waits for its trigger: end the waits first
            self._no_wait(vertex)
        # a copy: another thread (a signal's, a test's) may stop the runner while it still starts steps
        for run in list(self.runs.values()):
            for rq in list(run.queries):
                try:
                    if rq.query.isActive:
                        rq.query.stop()
                except Exception:  # noqa: BLE001 - best effort on the way out
                    log.exception("stopping %s", rq.query.name)

    def close(self) -> None:
        self.stop_all()
        for df, _ in self._refs.values():  # the session may outlive the runner (tests, recovery)
            df.unpersist()
        self._refs.clear()
        self.nats.close()
