"""The desired state of provisioning: every stream and KV bucket a pipeline's spec asks for. Pure.

See :mod:`isbflow.isb.provision` for how each spec field maps to a JetStream config field.
The dead-letter stream is configured by ``bufferConfig.deadLetter`` alone
(:class:`isbflow.spec.models.DeadLetterConfig`: its own defaults, never ``bufferConfig.stream``'s).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, is_dataclass
from enum import Enum
from typing import Any, Literal

from nats.js.api import DiscardPolicy, RePublish, RetentionPolicy, StorageType

from isbflow.isb import naming
from isbflow.spec.load import Specs
from isbflow.spec.models import Pipeline, Retention, Storage
from isbflow.spec.models import StreamConfig as StreamSpec

Kind = Literal["stream", "kv", "server"]  # "server": the ISB service itself (diff only)

#: Fields JetStream cannot change on an existing stream: changing them needs a recreate.
IMMUTABLE_FIELDS = frozenset({"storage", "retention"})
META_PREFIX = "isbflow."
HASH_KEY = "isbflow.spec-hash"
KV_HISTORY = {"control": 5, "status": 1, "ledger": 5}

RETENTION = {
    Retention.LIMITS: RetentionPolicy.LIMITS,
    Retention.INTEREST: RetentionPolicy.INTEREST,
    Retention.WORK_QUEUE: RetentionPolicy.WORK_QUEUE,
}
STORAGE = {Storage.FILE: StorageType.FILE, Storage.MEMORY: StorageType.MEMORY}
DURATIONS = frozenset({"max_age", "duplicate_window"})
_DEFAULT_DUPLICATES = 120.0  # what the server stores when duplicate_window is 0


def plain(v: Any) -> Any:
    """An enum's value (JetStream's own spelling), a nested config (``RePublish``) as its set
    fields, anything else as is."""
    if is_dataclass(v) and not isinstance(v, type):
        return {k: x for k, x in asdict(v).items() if x is not None}
    return v.value if isinstance(v, Enum) else v


def same(name: str, a: Any, b: Any) -> bool:
    """Equal as JetStream stores them (durations in nanoseconds)."""
    if name in DURATIONS:
        return round((a or 0) * 1e9) == round((b or 0) * 1e9)
    return plain(a) == plain(b)


def spec_hash(fields: dict[str, Any]) -> str:
    data = json.dumps({k: plain(v) for k, v in sorted(fields.items())}, sort_keys=True)
    return hashlib.sha256(data.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Resource:
    """One thing isbflow provisions: a stream or a KV bucket, with its managed fields.

    ``fields`` uses JetStream's config names and values (enums, seconds);
    ``stream`` is the server-side stream (``KV_<bucket>`` for a bucket).
    An unmanaged resource (a source stream the spec names with ``stream:``, which
    its producers own) is created when missing and otherwise never changed.
    ``reader`` is the vertex that reads the stream and records its committed
    sequence in the status bucket (None: nobody reads it, e.g. dead letters or a bucket).
    """

    name: str
    kind: Kind
    fields: dict[str, Any]
    labels: dict[str, str]
    managed: bool = True
    reader: str | None = None

    @property
    def stream(self) -> str:
        return f"KV_{self.name}" if self.kind == "kv" else self.name

    def metadata(self, fields: dict[str, Any] | None = None) -> dict[str, str]:
        """Labels plus the hash of ``fields`` (default: the desired ones)."""
        return {**self.labels, HASH_KEY: spec_hash(self.fields if fields is None else fields)}


def select_pipeline(specs: Specs, pipeline: str | None = None) -> Pipeline:
    """The named pipeline, or the only one when ``pipeline`` is None (else :class:`SpecError`)."""
    return specs.select(pipeline)


def discard_policy(retention: Retention, max_msgs: int, max_bytes: int) -> DiscardPolicy:
    """``new`` for a bounded WorkQueue/Interest buffer, else ``old`` (see :mod:`isbflow.isb.provision`)."""
    bounded = max_msgs > 0 or max_bytes > 0
    return DiscardPolicy.NEW if bounded and retention != Retention.LIMITS else DiscardPolicy.OLD


def stream_fields(sc: StreamSpec, max_payload: int, replicas: int, discard: DiscardPolicy) -> dict[str, Any]:
    """The managed JetStream fields of a stream configured by ``sc`` (``bufferConfig.stream`` or
    ``bufferConfig.deadLetter``)."""
    duplicates = sc.duplicates or (min(_DEFAULT_DUPLICATES, sc.maxAge) if sc.maxAge else _DEFAULT_DUPLICATES)
    return {
        "retention": RETENTION[sc.retention],
        "storage": STORAGE[sc.storage],
        "max_msgs": sc.maxMsgs,
        "max_bytes": sc.maxBytes,
        "max_age": sc.maxAge,
        "num_replicas": replicas,
        "duplicate_window": duplicates,
        "max_msg_size": max_payload,
        "discard": discard,
        "allow_direct": True,
    }


def dead_letter_discard(dl: StreamSpec) -> DiscardPolicy:
    """``new`` whenever the dead-letter stream is bounded: a full one refuses letters, never drops one."""
    return DiscardPolicy.NEW if dl.maxMsgs > 0 or dl.maxBytes > 0 else DiscardPolicy.OLD


def desired_resources(specs: Specs, pipeline: str | None = None) -> list[Resource]:
    """Every stream and bucket the pipeline needs, configured from its ISB service. Pure."""
    p = select_pipeline(specs, pipeline)
    jet = specs.service_for(p).spec.jetstream
    sc, dl = jet.bufferConfig.stream, jet.bufferConfig.deadLetter
    base = stream_fields(sc, jet.settings.max_payload, sc.replicas,
                         discard_policy(sc.retention, sc.maxMsgs, sc.maxBytes))
    dead = stream_fields(dl, jet.settings.max_payload, jet.bufferConfig.dead_letter_replicas,
                         dead_letter_discard(dl))
    out: list[Resource] = []

    def stream(name: str, subjects: list[str], description: str, managed: bool = True,
               reader: str | None = None, config: dict[str, Any] = base, wake: bool = False, **labels: str) -> None:
        fields = {**config, "subjects": subjects, "description": description}
        if wake:  # each stored message's headers on naming.wake_subject: what an idle reader waits on
            fields["republish"] = RePublish(src=">", dest=naming.wake_subject(name), headers_only=True)
        out.append(Resource(name, "stream", fields, {"isbflow.pipeline": p.name, **labels}, managed, reader))

    for v in p.spec.vertices:
        if v.source is not None and v.source.jetstream is not None:
            stream(naming.source_stream(p, v.name), [v.source.jetstream.subject],
                   f"isbflow pipeline {p.name}: events of source {v.name}",
                   managed=v.source.jetstream.stream is None, reader=v.name, wake=True,
                   **{"isbflow.role": "source", "isbflow.vertex": v.name})
    for ep in naming.edge_partitions(p):
        stream(ep.stream, [ep.subject],
               f"isbflow pipeline {p.name}: buffer {ep.from_vertex} -> {ep.to_vertex}, partition {ep.partition}",
               reader=ep.to_vertex, wake=True,
               **{"isbflow.role": "edge", "isbflow.edge": f"{ep.from_vertex}->{ep.to_vertex}",
                  "isbflow.partition": str(ep.partition)})
    stream(naming.dlq_stream(p.name), [naming.dlq_subjects(p.name)],
           f"isbflow pipeline {p.name}: dead letters", config=dead, **{"isbflow.role": "dlq"})
    storage = StorageType.FILE if jet.persistence else StorageType.MEMORY
    for role, bucket in (("control", naming.control_bucket(p.name)), ("status", naming.status_bucket(p.name)),
                         ("ledger", naming.ledger_bucket(p.name))):
        fields = {
            "description": f"isbflow pipeline {p.name}: {role}",
            "storage": storage,
            "num_replicas": sc.replicas,
            "max_msgs_per_subject": KV_HISTORY[role],
            "allow_direct": True,
        }
        out.append(Resource(bucket, "kv", fields, {"isbflow.pipeline": p.name, "isbflow.role": role}))
    return out
